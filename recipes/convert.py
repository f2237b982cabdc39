"""Convert a trained EAGLE-3 drafter into an EAGLE-4 drafter (warm start), then save it.

    torchspec-convert EAGLE3_DIR OUT_DIR --target TARGET_PATH [--drafter-preset eagle4|eagle4_moe]
                      [--fit-samples N] [--fit-data chats.jsonl] [--layout torchspec|sglang|vllm]
                      [--set key=value ...]

Read top to bottom: EAGLE-3 drafter -> target (checked against the drafter before its weights load)
-> EAGLE-4 config (preset from torchspec/conf/drafter/, sized like the EAGLE-3 drafter, ``--set`` overrides)
-> fit samples (the target's captured states on conversations, or on text the target samples
itself) -> ``eagle3_to_eagle4`` -> report -> ``save_pretrained`` into a temp dir renamed into place.
The choices the conversion makes are documented in ``torchspec/export/warm_start.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf

import torchspec.conf
from torchspec.config import DrafterConfig
from torchspec.data import collate, read_conversations, tokenize_conversation
from torchspec.data.dataset import Example
from torchspec.export.warm_start import eagle3_to_eagle4, format_report
from torchspec.io import atomic_save_dir
from torchspec.models import drafter_config_from_target
from torchspec.models.eagle3 import Eagle3Drafter
from torchspec.target import TargetModel, load_target_config, load_tokenizer, resolve_target_path

PRESET_DIR = Path(torchspec.conf.__file__).parent / "drafter"
SIZE_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchspec-convert", description=__doc__.split("\n")[0])
    p.add_argument("eagle3_dir", help="EAGLE-3 drafter directory (torchspec save_pretrained, or --layout)")
    p.add_argument("out_dir", help="where the EAGLE-4 drafter is written (save_pretrained format)")
    p.add_argument("--target", required=True, help="target the EAGLE-3 drafter was trained on (alias, .gguf, HF dir)")
    p.add_argument("--cache-dir", default="~/.cache/torchspec", help="where .gguf targets are converted once")
    p.add_argument("--layout", default="torchspec", choices=("torchspec", "sglang", "vllm"),
                   help="format of EAGLE3_DIR: torchspec's own, or the SpecForge/SGLang or speculators/vLLM layout")
    p.add_argument("--drafter-preset", default="eagle4", help="torchspec/conf/drafter/<preset>.yaml, e.g. eagle4 | eagle4_moe")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a drafter field, e.g. --set sliding_window=null --set lm_head_rank=0")
    p.add_argument("--fit-samples", type=int, default=16, help="sequences the eh_proj/q/k/v fit runs EAGLE-3 on")
    p.add_argument("--fit-length", type=int, default=256, help="tokens per fit sequence")
    p.add_argument("--fit-data", default=None, help="JSONL/JSON conversations for the fit; default: text the "
                   "target samples itself from random start tokens")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_preset(name: str) -> dict:
    """torchspec/conf/drafter/<name>.yaml with its ``defaults`` list resolved (bases first, then the file)."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"--drafter-preset={name!r}: no {path}; choose one of "
                         f"{sorted(p.stem for p in PRESET_DIR.glob('*.yaml'))}.")
    raw = yaml.safe_load(path.read_text()) or {}
    merged: dict = {}
    for base in raw.pop("defaults", []):
        if base != "_self_":
            merged.update(load_preset(base))
    merged.update(raw)
    return merged


def build_drafter_config(args: argparse.Namespace, e3: Eagle3Drafter) -> DrafterConfig:
    fields = {**load_preset(args.drafter_preset), **{k: getattr(e3.config, k) for k in SIZE_FIELDS}}
    cfg = OmegaConf.merge(OmegaConf.structured(DrafterConfig), fields, OmegaConf.from_dotlist(args.set))
    d: DrafterConfig = OmegaConf.to_object(cfg)  # unknown keys are errors here
    if d.arch != "eagle4":
        raise ValueError(f"--drafter-preset={args.drafter_preset!r} builds arch={d.arch!r}; the warm start builds eagle4.")
    return d


def load_eagle3(args: argparse.Namespace, num_layers: int, embed: torch.Tensor) -> Eagle3Drafter:
    if args.layout == "torchspec":
        return Eagle3Drafter.from_pretrained(args.eagle3_dir)
    from torchspec.export.eagle3_layouts import load_layout

    return load_layout(args.eagle3_dir, args.layout, target_num_layers=num_layers, embed_weight=embed)


def check_target(e3_cfg, target_cfg) -> None:
    problems = [f"{name}: EAGLE-3 {a}, target {b}" for name, a, b in (
        ("hidden_size", e3_cfg.hidden_size, target_cfg.hidden_size),
        ("vocab_size", e3_cfg.vocab_size, target_cfg.vocab_size),
        ("num_hidden_layers", e3_cfg.target_num_layers, target_cfg.num_hidden_layers)) if a != b]
    if problems:
        raise ValueError("the target does not match the EAGLE-3 drafter (" + "; ".join(problems)
                         + "); pass the target the drafter was trained on.")


@torch.no_grad()
def fit_batch(args: argparse.Namespace, target: TargetModel, tokenizer) -> dict[str, torch.Tensor]:
    """[N, T] token ids (+ attention mask) to run EAGLE-3 on for the fit."""
    if args.fit_data:
        examples = []
        conversations, _ = read_conversations(args.fit_data, limit=args.fit_samples)
        for messages in conversations:
            ids, mask = tokenize_conversation(tokenizer, messages, args.fit_length)
            examples.append(Example(torch.tensor(ids), torch.tensor(mask)))
        if not examples:
            raise ValueError(f"--fit-data={args.fit_data!r} holds no usable conversation.")
        return collate(examples, tokenizer.pad_token_id or 0)
    gen = torch.Generator().manual_seed(args.seed)
    start = torch.randint(0, target.vocab_size, (args.fit_samples, 1), generator=gen)
    torch.manual_seed(args.seed)
    ids = target.hf_model.generate(start, attention_mask=torch.ones_like(start), do_sample=True,
                                   max_new_tokens=args.fit_length - 1, min_new_tokens=args.fit_length - 1,
                                   pad_token_id=0)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        convert(args)
    except ValueError as err:  # user errors: a message naming the problem, no traceback
        print(f"torchspec-convert: error: {err}", file=sys.stderr)
        sys.exit(2)


def convert(args: argparse.Namespace) -> None:
    target_path = resolve_target_path(args.target, os.path.expanduser(args.cache_dir))
    target_cfg = load_target_config(target_path).get_text_config()
    if args.layout == "torchspec":  # check before the target's weights load
        e3 = Eagle3Drafter.from_pretrained(args.eagle3_dir)
        check_target(e3.config, target_cfg)
    target = TargetModel.from_pretrained(target_path, aux_layer_ids=None if args.layout != "torchspec"
                                         else list(e3.config.aux_layer_ids))
    if args.layout != "torchspec":
        e3 = load_eagle3(args, target.num_layers, target.embed_tokens_weight)
        check_target(e3.config, target_cfg)
        target = TargetModel(target.hf_model, list(e3.config.aux_layer_ids))
    e4_config = drafter_config_from_target(build_drafter_config(args, e3), target.config, e3.config.aux_layer_ids)

    batch = fit_batch(args, target, load_tokenizer(target_path))
    out = target(batch["input_ids"], attention_mask=batch["attention_mask"])
    e4, report = eagle3_to_eagle4(e3, e4_config, target_lm_head=target.lm_head_weight,
                                  fit_tokens=batch["input_ids"], fit_aux=out.aux_hidden_states,
                                  fit_attention_mask=batch["attention_mask"], seed=args.seed)
    print(format_report(report))
    atomic_save_dir(Path(args.out_dir), lambda tmp: e4.save_pretrained(tmp))
    print(f"torchspec-convert: EAGLE-4 drafter written to {args.out_dir}")


if __name__ == "__main__":
    main()
