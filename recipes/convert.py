"""Convert a trained EAGLE-3 drafter into an EAGLE-4 drafter (warm start), then save it.

    torchspec-convert EAGLE3_DIR OUT_DIR --target TARGET_PATH [--drafter-preset eagle4|eagle4_moe]
                      [--fit-samples N] [--fit-data chats.jsonl] [--layout torchspec|sglang|vllm]
                      [--set key=value ...] [--distill-steps N [--distill-lr LR] [--distill-decay D]]

Read top to bottom: checks, before any model loads (options, OUT_DIR, the target's config.json, the
EAGLE-3 files and config against the target, the EAGLE-4 config: preset from torchspec/conf/drafter/,
sized like the EAGLE-3 drafter, ``--set`` overrides; the fit data) -> target -> EAGLE-3 weights -> fit
samples (the target's captured states on conversations, or on text the target samples itself) ->
``eagle3_to_eagle4`` -> optionally ``--distill-steps`` of distillation from EAGLE-3 on the same fit batch
(``torchspec/export/warm_start_distill.py``) -> report (with every config field taken from the target
rather than EAGLE-3) -> ``save_pretrained`` into a temp dir renamed into place. User errors print one line and exit 2
(``--debug``: the traceback). The choices the conversion makes are documented in
``torchspec/export/warm_start.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import torchspec.conf
from torchspec.cli import (
    ArgumentParser,
    check_at_least,
    check_safetensors,
    one_line,
    read_json,
    user_errors,
    valid_keys_hint,
)
from torchspec.config import DrafterConfig
from torchspec.data import collate, read_conversations, tokenize_conversation
from torchspec.data.dataset import Example
from torchspec.data.formats import SkipConversation
from torchspec.export.eagle3_layouts import load_layout, read_layout_config
from torchspec.export.warm_start import check_compatible, eagle3_to_eagle4, format_report
from torchspec.export.warm_start_distill import distill_from_eagle3
from torchspec.io import atomic_save_dir
from torchspec.models import drafter_config_from_target
from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter
from torchspec.models.eagle4 import Eagle4Config
from torchspec.runtime.engine import SpeculativeEngine
from torchspec.runtime.sampling import SamplingParams
from torchspec.targets import TargetDecoder, load_target_config, load_tokenizer, resolve_target_path

PRESET_DIR = Path(torchspec.conf.__file__).parent / "drafter"
SIZE_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="torchspec-convert", description=__doc__.split("\n")[0])
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
    p.add_argument("--distill-steps", type=int, default=0,
                   help="then distil the converted drafter from EAGLE-3 for N steps on the fit batch "
                        "(torchspec/export/warm_start_distill.py; 0: the closed-form conversion alone)")
    p.add_argument("--distill-lr", type=float, default=1e-3, help="AdamW learning rate of --distill-steps")
    p.add_argument("--distill-decay", type=float, default=0.1,
                   help="weight decay**k of TTT step k in the distillation (0.1: step 0 first; 0.8, the trainer's, lowered acc_0 on SmolLM2)")
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


def build_drafter_config(args: argparse.Namespace, e3_config: Eagle3Config) -> DrafterConfig:
    valid = [f.name for f in dataclasses.fields(DrafterConfig)]
    for item in args.set:
        key = item.split("=", 1)[0].strip()
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set sliding_window=null.")
        if key not in valid:
            hint = valid_keys_hint(key, valid)
            raise ValueError(f"--set {item}: the drafter config has no key {key!r}; "
                             + (f"{hint} valid keys: {sorted(valid)}." if hint.startswith("did") else f"{hint}."))
    fields = {**load_preset(args.drafter_preset), **{k: getattr(e3_config, k) for k in SIZE_FIELDS}}
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(DrafterConfig), fields, OmegaConf.from_dotlist(args.set))
        d: DrafterConfig = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:  # a value of the wrong type (--set or the preset file)
        raise ValueError(f"--set {' '.join(args.set) or '(none)'} / --drafter-preset={args.drafter_preset}: "
                         f"{one_line(err)}") from err
    if d.arch != "eagle4":
        raise ValueError(f"--drafter-preset={args.drafter_preset!r} builds arch={d.arch!r}; the warm start builds eagle4.")
    return d


def read_eagle3_config(args: argparse.Namespace, target_num_layers: int) -> Eagle3Config:
    """The EAGLE-3 drafter's config, strictly, and its weights file's header: no weight is read yet."""
    if args.layout != "torchspec":
        return read_layout_config(args.eagle3_dir, args.layout, target_num_layers)
    path = Path(args.eagle3_dir)
    fix = ("pass the directory an EAGLE-3 drafter was saved to by torchspec (config.json + model.safetensors), "
           "or --layout sglang|vllm for those layouts")
    if not path.is_dir():
        raise ValueError(f"{path} {'is a file' if path.exists() else 'does not exist'}; {fix}.")
    config = read_json(path / "config.json", fix + ".")
    if config.get("model_type") != Eagle3Config.model_type:
        layout = ("vllm" if "speculators_model_type" in config else
                  "sglang" if "LlamaForCausalLMEagle3" in (config.get("architectures") or []) else None)
        raise ValueError(f"{path / 'config.json'}: model_type={config.get('model_type')!r} is not a torchspec EAGLE-3 "
                         f"drafter ({Eagle3Config.model_type!r}); "
                         + (f"it is in the {layout} layout: pass --layout {layout}." if layout else f"{fix}."))
    check_safetensors(path / "model.safetensors", fix + ".")
    Eagle3Config.check_keys(config, source=str(path / "config.json"))
    return Eagle3Config(**{k: v for k, v in config.items() if k in Eagle3Config.ARCH_FIELDS})


def check_out_dir(args: argparse.Namespace) -> None:
    """OUT_DIR is replaced as a whole: it must be new, empty, or an earlier EAGLE-4 conversion."""
    out, source = Path(args.out_dir), Path(args.eagle3_dir)
    if out.exists() and source.exists() and out.resolve() == source.resolve():
        raise ValueError(f"{out} is the EAGLE-3 drafter itself; write the EAGLE-4 drafter to a new directory.")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; pass a new or empty directory for the EAGLE-4 drafter.")
    if out.is_dir() and any(out.iterdir()):
        try:
            ours = read_json(out / "config.json", "").get("model_type") == Eagle4Config.model_type
        except ValueError:
            ours = False
        if not ours:
            raise ValueError(f"{out} exists and is not an EAGLE-4 drafter directory; refusing to replace it. "
                             f"Choose a new or empty directory.")


def check_target(e3_cfg, target_cfg) -> None:
    problems = [f"{name}: EAGLE-3 {a}, target {b}" for name, a, b in (
        ("hidden_size", e3_cfg.hidden_size, target_cfg.hidden_size),
        ("vocab_size", e3_cfg.vocab_size, target_cfg.vocab_size),
        ("num_hidden_layers", e3_cfg.target_num_layers, target_cfg.num_hidden_layers)) if a != b]
    if problems:
        raise ValueError("the target does not match the EAGLE-3 drafter (" + "; ".join(problems)
                         + "); pass the target the drafter was trained on.")


def fit_conversations(args: argparse.Namespace, tokenizer, conversations: list) -> dict[str, torch.Tensor]:
    """The --fit-data batch, before any weights load: the first --fit-samples conversations that keep an
    assistant token within --fit-length tokens (a long first user turn leaves none), as [N, T] ids + mask."""
    examples, skipped = [], 0
    for messages in conversations:
        try:
            ids, mask = tokenize_conversation(tokenizer, messages, args.fit_length)
        except SkipConversation:
            skipped += 1
            continue
        examples.append(Example(torch.tensor(ids), torch.tensor(mask)))
        if len(examples) == args.fit_samples:
            break
    if not examples:
        raise ValueError(f"--fit-data={args.fit_data!r} holds no conversation with an assistant token in its first "
                         f"--fit-length={args.fit_length} tokens ({skipped} skipped); pass a longer --fit-length or "
                         "other conversations.")
    return collate(examples, tokenizer.pad_token_id or 0)


@torch.no_grad()
def sampled_fit_batch(args: argparse.Namespace, target: TargetDecoder) -> dict[str, torch.Tensor]:
    """Without --fit-data: --fit-samples sequences of --fit-length tokens the target samples from random starts."""
    gen = torch.Generator().manual_seed(args.seed)
    start = torch.randint(0, target.vocab_size, (args.fit_samples, 1), generator=gen)
    # The target samples the rest (top-k 50, transformers' default) through the serving engine.
    engine = SpeculativeEngine(target, max_batch=args.fit_samples, max_context=args.fit_length + 16)
    out = engine.generate(start.tolist(), max_new_tokens=args.fit_length - 1, seed=args.seed, ignore_eos=True,
                          sampling=SamplingParams(temperature=1.0, top_k=50))
    ids = torch.cat([start, torch.tensor([r.token_ids for r in out])], 1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with user_errors("torchspec-convert", args.debug):
        convert(args)


def convert(args: argparse.Namespace) -> None:
    # Everything a user passes is checked before a model loads: options, OUT_DIR, the target's config,
    # the EAGLE-3 files and config (against the target), the EAGLE-4 config, the fit data.
    check_at_least("--fit-samples", args.fit_samples, 1)
    check_at_least("--fit-length", args.fit_length, 2)
    check_at_least("--distill-steps", args.distill_steps, 0)
    if not args.distill_lr > 0:
        raise ValueError(f"--distill-lr={args.distill_lr} must be > 0; pass e.g. --distill-lr 1e-3")
    if not 0 < args.distill_decay <= 1:
        raise ValueError(f"--distill-decay={args.distill_decay} must lie in (0, 1]; pass e.g. --distill-decay 0.1")
    check_out_dir(args)
    target_path = resolve_target_path(args.target, os.path.expanduser(args.cache_dir))
    target_cfg = load_target_config(target_path).get_text_config()
    e3_config = read_eagle3_config(args, target_cfg.num_hidden_layers)
    check_target(e3_config, target_cfg)
    aux_ids = list(e3_config.aux_layer_ids)
    e4_config = drafter_config_from_target(build_drafter_config(args, e3_config), target_cfg, aux_ids)
    check_compatible(e3_config, e4_config)
    tokenizer = load_tokenizer(target_path)
    # a few more records than --fit-samples: the ones without a reply token within --fit-length are skipped
    batch = fit_conversations(args, tokenizer, read_conversations(args.fit_data, limit=4 * args.fit_samples)[0]) \
        if args.fit_data else None

    target = TargetDecoder.from_pretrained(target_path, aux_layer_ids=aux_ids)
    if args.layout == "torchspec":
        e3 = Eagle3Drafter.from_pretrained(args.eagle3_dir)
    else:  # a checkpoint without the embedding takes the target's
        e3 = load_layout(args.eagle3_dir, args.layout, target_num_layers=target.num_layers,
                         embed_weight=target.embed_tokens_weight)
    batch = batch if batch is not None else sampled_fit_batch(args, target)
    out = target.capture(batch["input_ids"], attention_mask=batch["attention_mask"])
    e4, report = eagle3_to_eagle4(e3, e4_config, target_lm_head=target.lm_head_weight,
                                  fit_tokens=batch["input_ids"], fit_aux=out.aux_hidden_states,
                                  fit_attention_mask=batch["attention_mask"], seed=args.seed)
    if args.distill_steps:
        report.metrics.update(distill_from_eagle3(e4, e3, batch["input_ids"], out.aux_hidden_states,
                                                  batch["attention_mask"], args.distill_steps, lr=args.distill_lr,
                                                  decay=args.distill_decay, progress=True))
        report.notes.append(f"then distilled from EAGLE-3 for {args.distill_steps} steps on the fit batch "
                            f"(lr {args.distill_lr:g}): count its distill_token_passes against the warm start")
    print(format_report(report))
    atomic_save_dir(Path(args.out_dir), lambda tmp: e4.save_pretrained(tmp))
    print(f"torchspec-convert: EAGLE-4 drafter written to {args.out_dir}")


if __name__ == "__main__":
    main()
