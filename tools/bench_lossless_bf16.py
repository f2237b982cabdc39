"""bf16 losslessness on a real model: greedy speculative output vs plain greedy output of the same engine.

Issue 13's target: SmolLM2-135M-Instruct, all 80 MT-Bench prompts, greedy, on the GPU in bf16 with
CUDA graphs. For each head (below) and each concurrency (batch) c, the prompts are decoded by the
plain decoder and by each speculative shape (greedy dynamic tree, greedy chain) of the same engine;
a row reports how many prompts' outputs are identical to plain decoding at the same c, and every
divergence (the first differing position of a prompt) with the target's top-2 logit margin there
(`torchspec.runtime.margins`: the common prefix recomputed by one dense forward of the same bf16
decoder with the fp32-output head; margin in logits and in bf16 ulps of the top-1 logit; whether
the two diverging tokens are the top 2; whether the top 2 round to the same bf16 number). A
divergence that is not a near-tie (> ``--max-ulps`` = 2 ulps) is flagged ``suspect``: a bug, not
rounding. Rows ``mode=plain`` compare plain decoding at c > 1 with plain decoding at c = 1.

Heads: ``fp32`` is the head as it is (`torchspec.targets.head.fp32_logits`: bf16 operands,
logits accumulated and returned in fp32). ``bf16`` emulates the head before that change, whose
logits came out of a bf16 GEMM (fp32 accumulation, output rounded to bf16): while its rows run,
``torchspec.targets.head.fp32_logits`` is patched to compute ``hidden @ W.T`` in the weight dtype and
then ``.float()`` (restored afterwards; each head gets a fresh engine, so no CUDA graph captured
under one head replays under the other; `check_head` asserts the patch is in effect). Margins are
always measured with the fp32 head.

Without ``--drafter`` an untrained EAGLE-4 drafter initialised from the target
(``Drafter.init_from_target``: the target's embedding and head) drafts; the JSON then says
``"drafter": "untrained-init-from-target"``. Acceptance is then low, but every round still runs the
tree / chain verify forward whose numerics are what differ from a plain step.

    # H200 (bf16, graphs), after tools/device_smollm2.sh joined the GGUF under /tmp/work: about 7 minutes
    # with the untrained drafter (acceptance ~1: every round a full verify), ~5 with a trained export
    python tools/bench_lossless_bf16.py --target /tmp/work/smollm2.gguf --cache-dir /tmp/work/cache \\
        [--drafter /tmp/work/export] --json docs/bench/lossless_smollm2_h200.json
    # (the JSON is rewritten after each head; --heads fp32 / --heads bf16 split the run in two)
    # CPU smoke run (fp32: every row must be identical):
    python tools/bench_lossless_bf16.py --device cpu --dtype float32 --num-prompts 2 --max-new-tokens 8 \\
        --json /tmp/lossless_smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torchspec.targets.head as head_module  # noqa: E402
from torchspec.runtime.drafting import SpecConfig  # noqa: E402
from torchspec.runtime.engine import SpeculativeEngine  # noqa: E402
from torchspec.runtime.margins import MAX_ULPS, divergence  # noqa: E402

HEADS = ("fp32", "bf16")
UNTRAINED = "untrained-init-from-target"
DEFAULT_JSON = "docs/bench/lossless_smollm2_h200.json"


def weight_dtype_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The old head: ``hidden @ W.T`` in the weight's dtype (a bf16 GEMM rounds its output to bf16), then fp32."""
    flat = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
    return (flat @ weight.t()).float().view(*hidden.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def head_logits(head: str):
    """``fp32``: the serving head as it is; ``bf16``: `weight_dtype_logits` in place of ``fp32_logits``."""
    if head not in HEADS:
        raise ValueError(f"head={head!r} must be one of {HEADS}")
    saved = head_module.fp32_logits
    if head == "bf16":
        head_module.fp32_logits = weight_dtype_logits
    try:
        yield
    finally:
        head_module.fp32_logits = saved


@torch.no_grad()
def check_head(decoder, head: str) -> None:
    """With bf16 / fp16 weights, the logits in effect are rounded to that dtype exactly under the bf16 head."""
    w = decoder.lm_head_weight
    if w.dtype == torch.float32:
        return  # nothing to round: both heads are the fp32 product
    g = torch.Generator(device=w.device).manual_seed(0)
    logits = decoder.logits(torch.randn(4, w.shape[1], device=w.device, generator=g).to(w.dtype))
    rounded = torch.equal(logits, logits.to(w.dtype).float())
    assert rounded == (head == "bf16"), (f"head {head!r} with {w.dtype} weights: logits {'are' if rounded else 'are not'} rounded "
                             f"to {w.dtype}; the emulation of the old head did not take effect (does "
                             f"torchspec/targets/head.py still call fp32_logits through its module?)")


@torch.no_grad()
def untrained_drafter(decoder, dtype: torch.dtype, seed: int = 0):
    """An EAGLE-4 drafter (default flags) initialised from the target's embedding and head, untrained."""
    from torchspec.config import DrafterConfig
    from torchspec.models import build_drafter
    from torchspec.runtime.drafter_runner import DrafterRunner
    from torchspec.targets import default_aux_layer_ids

    torch.manual_seed(seed)
    drafter = build_drafter(DrafterConfig(), decoder.config, default_aux_layer_ids(decoder.num_layers))
    drafter.init_from_target(decoder.embed_tokens_weight.float().cpu(), decoder.lm_head_weight.float().cpu())
    device = decoder.embed_tokens_weight.device
    return DrafterRunner(drafter.to(device=device, dtype=dtype).eval(), decoder.vocab_size)


def load(args):
    """(the target decoder, a drafter runner, the tokenizer, the drafter's name) from the options."""
    from torchspec.runtime.loading import load_engine

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    stub = load_engine(args.target, args.drafter, device=device, dtype=args.dtype, max_batch=1, num_pages=2,
                       cache_dir=args.cache_dir)  # the engines below bring their own pools
    runner = stub.runner if args.drafter else untrained_drafter(stub.decoder, stub.decoder.embed_tokens_weight.dtype)
    return stub.decoder, runner, stub.tokenizer, args.drafter or UNTRAINED


def specs(args) -> dict[str, SpecConfig]:
    out = {}
    for shape in args.shapes.split(","):
        spec = SpecConfig(shape=shape, depth=args.depth, topk=args.topk, num_nodes=args.num_nodes)
        spec.validate()
        out[shape] = spec
    return out


def decode_all(engine: SpeculativeEngine, prompts: list[list[int]], shapes: dict[str, SpecConfig],
               levels: list[int], max_new: int) -> dict[tuple[str, int], dict]:
    """{(mode, c): {"outputs", "wall_s", "mean_acceptance"}} for plain and every shape at every c (greedy)."""
    runs = {}
    for c in levels:
        for mode, spec in [("plain", None), *shapes.items()]:
            t0 = time.perf_counter()
            results = engine.generate(prompts, max_new_tokens=max_new, spec=spec, concurrency=c)
            rounds = sum(len(r.accept_lengths) for r in results)
            runs[(mode, c)] = {"outputs": [r.token_ids for r in results], "wall_s": time.perf_counter() - t0,
                               "mean_acceptance": sum(map(sum, (r.accept_lengths for r in results))) / max(rounds, 1)}
    return runs


def compare(decoder, prompts: list[list[int]], reference: list[list[int]], outputs: list[list[int]],
            max_ulps: float = MAX_ULPS) -> dict:
    """identical / total and, per differing prompt, its first divergence measured against ``reference``."""
    divergences = []
    for i, (prompt, ref, out) in enumerate(zip(prompts, reference, outputs)):
        if out == ref:
            continue
        d = divergence(decoder, prompt, ref, out, max_ulps)
        if d is None:  # no token differs, only the length: never rounding (same stop rules on both sides)
            d = {"position": min(len(ref), len(out)), "margin": None, "margin_ulps": None, "tokens": None,
                 "top2": None, "suspect": True, "note": f"lengths differ ({len(ref)} vs {len(out)} tokens)"}
        divergences.append({"prompt": i, **d})
    same = len(prompts) - len(divergences)
    return {"identical": same, "total": len(prompts), "identical_fraction": same / max(len(prompts), 1),
            "divergences": divergences, "suspect": sum(bool(d["suspect"]) for d in divergences)}


def run_head(head: str, decoder, runner, tokenizer, prompts, args) -> list[dict]:
    """Every row of one head: decode under the head (a fresh engine), then measure under the fp32 head."""
    levels, shapes = [int(c) for c in args.concurrency.split(",")], specs(args)
    slack = 2 * max(s.num_nodes + 1 if s.shape == "tree" else s.depth + 1 for s in shapes.values()) + 16
    page = 16
    max_context = -(-(max(map(len, prompts)) + args.max_new_tokens + slack) // page) * page
    with head_logits(head):
        check_head(decoder, head)
        engine = SpeculativeEngine(decoder, runner, tokenizer, max_batch=max(levels), max_context=max_context,
                                   page_size=page, prefix_cache=not args.no_prefix_cache,
                                   cuda_graphs=False if args.eager else None)
        runs = decode_all(engine, prompts, shapes, levels, args.max_new_tokens)
        graphs = len(engine.graphs) if engine.graphs is not None else 0
        failed = sorted(map(str, engine.graphs.failed)) if engine.graphs is not None else []
        del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    check_head(decoder, "fp32")  # restored: margins are measured with the fp32 head
    rows = []
    for c in levels:
        pairs = [(mode, c, ("plain", c)) for mode in shapes]
        if c != levels[0]:
            pairs.insert(0, ("plain", c, ("plain", levels[0])))
        for mode, conc, ref in pairs:
            run = runs[(mode, conc)]
            rows.append({"mode": mode, "concurrency": conc, "head": head, "reference": f"{ref[0]} c={ref[1]}",
                         **compare(decoder, prompts, runs[ref]["outputs"], run["outputs"], args.max_ulps),
                         "mean_acceptance": run["mean_acceptance"], "wall_s": run["wall_s"],
                         "graphs": graphs, "graphs_failed": failed})
    return rows


def format_row(r: dict) -> str:
    m = [d["margin_ulps"] for d in r["divergences"] if d["margin_ulps"] is not None]
    ties = sum(bool(d.get("bf16_tie")) for d in r["divergences"])
    top2 = sum(bool(d.get("top2")) for d in r["divergences"])
    return (f"{r['mode']:<6} {r['concurrency']:>4} {r['head']:<5} {r['reference']:<12} "
            f"{r['identical']:>4}/{r['total']:<4} {len(r['divergences']):>5} {top2:>5} {ties:>5} "
            f"{(max(m) if m else 0.0):>8.2f} {r['suspect']:>7} {r['mean_acceptance']:>7.2f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2", help="HF dir, .gguf or alias (default smollm2)")
    p.add_argument("--cache-dir", default="~/.cache/torchspec", help="where a .gguf target is converted once")
    p.add_argument("--drafter", default=None, help=f"drafter export dir (default: {UNTRAINED})")
    p.add_argument("--prompt-set", default="mtbench", help="mtbench, humaneval or a .txt / .jsonl file")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,8", help="comma-separated; plain at the first is the plain reference")
    p.add_argument("--shapes", default="tree,chain")
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-nodes", type=int, default=32)
    p.add_argument("--heads", default=",".join(HEADS), help="fp32 (the head now), bf16 (the old head, emulated)")
    p.add_argument("--max-ulps", type=float, default=MAX_ULPS, help="near-tie bound, bf16 ulps of the top-1 logit")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bf16 on cuda, fp32 on cpu")
    p.add_argument("--no-prefix-cache", action="store_true", help="serve without prompt-page sharing")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--json", default=DEFAULT_JSON)
    return p


def main(argv: list[str] | None = None) -> dict:
    from torchspec.io import atomic_write_text
    from torchspec.runtime.prompts import load_prompt_set, render_prompts

    args = build_parser().parse_args(argv)
    heads = args.heads.split(",")
    if not set(heads) <= set(HEADS):
        raise SystemExit(f"--heads={args.heads!r}: each must be one of {HEADS}")
    specs(args)  # refuse a bad shape before the target loads
    decoder, runner, tokenizer, drafter_name = load(args)
    prompts = render_prompts(tokenizer, load_prompt_set(args.prompt_set, args.num_prompts))
    print(f"{len(prompts)} prompts ({args.prompt_set}), {decoder.embed_tokens_weight.dtype} on "
          f"{decoder.embed_tokens_weight.device}, drafter {drafter_name}", flush=True)
    print(f"{'mode':<6} {'conc':>4} {'head':<5} {'reference':<12} {'same':>9} {'diffs':>5} {'top2':>5} "
          f"{'ties':>5} {'max ulps':>8} {'suspect':>7} {'accept':>7}", flush=True)
    dev = decoder.embed_tokens_weight.device
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "dtype": str(decoder.embed_tokens_weight.dtype).removeprefix("torch."), "target": args.target,
           "drafter": drafter_name, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "specs": {k: dataclasses.asdict(v) for k, v in specs(args).items()}, "max_ulps": args.max_ulps,
           "heads": {"fp32": "the head as it is: logits accumulated and returned in fp32",
                     "bf16": "emulated old head: hidden @ W.T in the weight dtype (bf16 GEMM output), then .float()"},
           "suspect": 0, "args": vars(args), "rows": []}
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    for head in heads:
        for row in run_head(head, decoder, runner, tokenizer, prompts, args):
            out["rows"].append(row)
            print(format_row(row), flush=True)
        out["suspect"] = sum(r["suspect"] for r in out["rows"])
        atomic_write_text(path, json.dumps(out, indent=1))  # after each head: a partial run keeps its rows
    print(f"suspect divergences (> {args.max_ulps} bf16 ulps): {out['suspect']}; wrote {path}", flush=True)
    return out


if __name__ == "__main__":
    main()
