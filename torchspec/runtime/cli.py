"""Command-line options shared by ``torchspec-generate`` and ``torchspec-bench``.

SpeculativeEngine: ``--target`` (HF dir, .gguf or alias ``smollm2``), ``--drafter`` (a torchspec export),
``--device``, ``--dtype``, ``--max-batch``, ``--max-context``, ``--page-size``.
Speculation: ``--no-spec`` (plain decoder), ``--tree`` (default) or ``--chain``, ``--depth``,
``--topk`` and ``--num-nodes`` (dynamic tree), ``--branching`` (sampled tree at T > 0, children per
node at each depth), ``--candidates auto|sampled|deterministic``.
Sampling: ``--temperature`` (0 = greedy), ``--top-p``, ``--top-k``, ``--seed``.

``check_engine_args``, ``check_output_file`` and ``read_prompt_set`` refuse bad
values and paths before any model loads, so a typo costs a second, not a target load.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from torchspec.cli import check_at_least, check_safetensors, read_json
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.sampling import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--target", default="smollm2", help="HF checkpoint dir, .gguf file, or alias (default smollm2)")
    g.add_argument("--drafter", default=None, help="torchspec drafter export dir (omit with --no-spec)")
    g.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    g.add_argument("--max-batch", type=int, default=8, help="concurrent sequences (slots)")
    g.add_argument("--max-context", type=int, default=2048, help="tokens per sequence, prompt included")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--cache-dir", default="~/.cache/torchspec", help="where a .gguf target is converted once")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--no-spec", action="store_true", help="plain decoding (one target forward per token)")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--tree", dest="shape", action="store_const", const="tree", help="draft a tree (default)")
    shape.add_argument("--chain", dest="shape", action="store_const", const="chain", help="draft a chain")
    g.set_defaults(shape="tree")
    g.add_argument("--depth", type=int, default=5, help="draft depth per round")
    g.add_argument("--topk", type=int, default=8, help="dynamic tree: children per expanded node / frontier width")
    g.add_argument("--num-nodes", type=int, default=32, help="dynamic tree: drafted nodes verified per round")
    g.add_argument("--branching", default="4,2,1,1,1,1,1,1",
                   help="sampled tree (T > 0): children drawn per node at each depth, comma-separated")
    g.add_argument("--candidates", default="auto", choices=["auto", "sampled", "deterministic"],
                   help="T > 0: sampled drafts (verified with their draw probabilities) or top-k candidates "
                        "(point-mass rule); auto = sampled")
    g.add_argument("--controller", default=None, metavar="COSTS.json",
                   help="the draft controller with this torchspec-profile table: each round's depth and width are "
                        "chosen within the shape above")
    g.add_argument("--chain-from-batch", type=int, default=None,
                   help="with --controller: greedy rounds of this many rows or more draft a chain (default: the "
                        "cost table's chain_from_batch, if it has one)")
    g.add_argument("--controller-mode", default="ahead", choices=["ahead", "within"],
                   help="with --controller: ahead = each round's shape planned by the previous round on the GPU "
                        "(CUDA graphs); within = decided after every depth on the host (no CUDA graphs)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=256)


def sampling_from_args(args) -> SamplingParams:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    params.validate()
    return params


def spec_from_args(args) -> SpecConfig | None:
    if args.no_spec:
        return None
    try:
        branching = tuple(int(x) for x in args.branching.split(","))
    except ValueError:
        raise ValueError(f"--branching={args.branching!r} must be comma-separated ints, e.g. 4,2,1,1,1") from None
    branching = branching + (1,) * max(0, args.depth - len(branching))
    spec = SpecConfig(shape=args.shape, depth=args.depth, topk=args.topk, num_nodes=args.num_nodes,
                      candidates=args.candidates, branching=branching)
    spec.validate()
    return spec


def engine_kwargs(args) -> dict:
    kwargs = {"device": args.device, "dtype": args.dtype, "max_batch": args.max_batch,
              "max_context": args.max_context, "page_size": args.page_size, "cache_dir": args.cache_dir}
    if getattr(args, "controller", None) and args.controller_mode == "within":  # host-chained: no CUDA graphs
        kwargs["cuda_graphs"] = False
    return kwargs


def controller_from_args(args, engine):
    """``--controller``'s table, checked against the loaded engine's key (a mismatch names both keys), or None."""
    if not getattr(args, "controller", None):
        return None
    from torchspec.runtime.cost_table import CostTable, cost_key

    return CostTable.load(args.controller, cost_key(engine.decoder, engine.runner))


def check_engine_args(args, spec: SpecConfig | None) -> None:
    """The engine's options and the drafter export, checked before the target loads."""
    check_at_least("--max-batch", args.max_batch, 1)
    check_at_least("--max-context", args.max_context, 2)
    check_at_least("--page-size", args.page_size, 1)
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device={args.device!r} is not a device; pass cpu, cuda or cuda:N.") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device={args.device}: no CUDA device is visible here; pass --device cpu.")
    if spec is not None and args.drafter is not None:
        check_drafter_export(args.drafter)
    if getattr(args, "controller", None):
        if spec is None:
            raise ValueError("--controller chooses the shape of speculation rounds; drop --no-spec (or --controller).")
        if not Path(args.controller).is_file():
            raise ValueError(f"--controller {args.controller} does not exist; measure it with torchspec-profile "
                             f"--target T --drafter D --out {args.controller}.")
    if getattr(args, "controller_mode", "ahead") != "ahead" and not getattr(args, "controller", None):
        raise ValueError("--controller-mode needs --controller (it is how the controller decides).")
    if getattr(args, "chain_from_batch", None) is not None:
        if not getattr(args, "controller", None):
            raise ValueError("--chain-from-batch needs --controller (it is a choice the controller makes).")
        check_at_least("--chain-from-batch", args.chain_from_batch, 1)


def check_drafter_export(path: str) -> None:
    """--drafter: a torchspec export whose config.json parses and whose weights header reads."""
    fix = "pass a torchspec export directory (torchspec-export RUN_DIR OUT_DIR writes one)"
    if not os.path.isdir(path):
        raise ValueError(f"--drafter {path} {'is a file' if os.path.exists(path) else 'does not exist'}; {fix}.")
    config = read_json(Path(path) / "config.json", fix + ".")
    if "torchspec_export_version" not in config:
        raise ValueError(f"--drafter {path}: config.json has no torchspec_export_version, so it is not a torchspec "
                         f"export (a save_pretrained or converted drafter?); {fix}.")
    check_safetensors(Path(path) / "model.safetensors", "re-export the drafter.")


def check_output_file(flag: str, path: str) -> None:
    """An output file the command writes at the end: refuse now what would fail after the whole run."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; pass a file path (e.g. {os.path.join(path, 'out.json')}).")
    parent = os.path.dirname(path) or "."
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is a file, not a directory; pass another path.")


def read_prompt_set(source: str) -> list:
    """``load_prompt_set``, with a directory, a garbled JSONL line and an empty file refused by name."""
    from torchspec.runtime.prompts import load_prompt_set

    if os.path.isdir(source):
        raise ValueError(f"prompt file {source} is a directory; pass a .txt or .jsonl file, or mtbench / humaneval.")
    try:
        prompts = load_prompt_set(source)
    except json.JSONDecodeError as err:
        raise ValueError(f"prompt file {source}: a line is not JSON ({err}); write one JSON object per line.") from err
    if not prompts:
        raise ValueError(f"prompt file {source} holds no prompt; write one per line (.txt) or per JSON line (.jsonl).")
    return prompts
