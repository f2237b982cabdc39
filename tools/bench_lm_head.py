"""LM-head share of one drafting step: EAGLE-3 pruned head vs EAGLE-4 full head vs EAGLE-4
efficient head (rank-r scorer over V + top-k + exact re-score of the k candidates).

What is timed is a cost model (``lm_head_cost_model``, not the trainer's code): one drafter decode
step at batch 1 over a KV cache of `context` tokens, for n = 1 new token (chain drafting) and n = 16
(tree drafting), and each head after it; defaults are the flagship shapes (H 5120, V 248,320,
context 2048, rank 128, top-128, bf16).

Timing (CUDA): warm-up, then per iteration the L2 is flushed (a read of 4x its size, outside the
timed region: in a real round the body's ~0.8 GB of weights evict the head's), a CUDA event pair
around one call, a sync; the median of ``--iters`` samples over ``--rounds`` interleaved rounds
(the per-round medians show the spread). Eager always; with ``--graphs`` also one CUDA graph per
measured function, since a batch-1 decode step is launch-bound in eager mode. Reported per
(mode, head, eager|graph): step = body + head, body alone, head alone, head share = head / step
and the marginal share (step - body) / step, and the head's memory floor (bytes it must read /
measured copy bandwidth).

    GPU:        python3 -m tools.bench_lm_head --graphs --out $OUT/bench_lm_head.json
    CPU smoke:  python -m tools.bench_lm_head --cpu --small
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from torchspec.models.lm_head import EfficientLMHead

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling tools modules, also under `python -m tools.*`

from lm_head_cost_model import SMALL, DraftStep, Shape, build_heads  # noqa: E402


class Timer:
    """Median-of-samples timer: CUDA events with a cold L2 (or perf_counter on CPU); optional graph."""

    def __init__(self, device: torch.device, warmup: int):
        self.device, self.warmup = device, warmup
        self.cuda = device.type == "cuda"
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
            self.flush_buf = torch.empty(max(4 * l2, 256 << 20) // 4, dtype=torch.float32, device=device).normal_()

    def prepare(self, fn: Callable[[], object], graph: bool) -> Callable[[], object]:
        if not graph:
            for _ in range(self.warmup):
                fn()
            return fn
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(max(self.warmup, 3)):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        for _ in range(self.warmup):
            g.replay()
        return g.replay

    def samples(self, run: Callable[[], object], iters: int) -> list[float]:
        """Milliseconds per call."""
        out = []
        for _ in range(iters):
            if self.cuda:
                self.flush_buf.sum()  # evict the L2, outside the timed region
                torch.cuda.synchronize(self.device)  # start with an idle GPU: launch gaps count
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                run()
                out.append((time.perf_counter() - t0) * 1e3)
        return out


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy, bytes read + written per second (the memory ceiling)."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 28, dtype=torch.float32, device=device).normal_()  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * 2 * src.numel() * 4 / (start.elapsed_time(end) / 1e3)


@torch.inference_mode()
def check(body: DraftStep, heads: dict, eff: EfficientLMHead, tokens, hidden) -> dict[str, float]:
    """Correct first: finite body output, candidate logits equal the full logits at those ids,
    draft ids in range."""
    y = body(tokens, hidden)
    assert torch.isfinite(y).all(), "body output is not finite"
    ids, logits = eff.candidates(y)
    ref = eff.full_logits(y).float().gather(-1, ids)
    rel = float((logits.float() - ref).norm() / ref.norm())
    assert rel < 2e-2, f"re-scored candidate logits differ from the full head's: rel err {rel:.3g}"
    for name, head in heads.items():
        out = head(y)
        assert out.min() >= 0 and out.max() < eff.vocab_size, f"{name}: draft ids out of range"
    return {"rescore_rel_err": rel}


def run_mode(s: Shape, n: int, device, dtype, args, timer: Timer, bw: float | None) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        body = DraftStep(s, n, device, dtype)
        heads, head_bytes, eff = build_heads(s, n, device, dtype, gen)
        tokens = torch.randint(0, s.vocab, (1, n), device=device, generator=gen)
        hidden = torch.randn(1, n, s.hidden, device=device, dtype=dtype, generator=gen)
        y = body(tokens, hidden)
    checks = check(body, heads, eff, tokens, hidden)
    fns = {("body", None): lambda: body(tokens, hidden)}
    for name, head in heads.items():
        fns[("head", name)] = lambda head=head: head(y)
        fns[("step", name)] = lambda head=head: head(body(tokens, hidden))
    fns[("part", "lowrank_scores")] = lambda: eff.lowrank_scores(y)
    fns[("part", "lowrank_scores+topk")] = lambda: eff.lowrank_scores(y).topk(s.topk, dim=-1, sorted=False)
    fns[("part", "candidates")] = lambda: eff.candidates(y)

    variants = ["eager"] + (["graph"] if args.graphs and device.type == "cuda" else [])
    times: dict[tuple, list[list[float]]] = {}
    errors: dict[str, str] = {}
    with torch.inference_mode():
        prepared = {}
        for variant in variants:
            for key, fn in fns.items():
                try:
                    prepared[(variant, *key)] = timer.prepare(fn, graph=variant == "graph")
                except Exception as e:  # a failed capture costs one entry, not the whole run
                    if variant == "eager":
                        raise
                    errors[f"{variant}/{key}"] = repr(e)
                    print(f"warning: graph capture of {key} failed: {e!r}")
        for _ in range(args.rounds):  # interleaved rounds: the per-round medians show the spread
            for key, run in prepared.items():
                times.setdefault(key, []).append(timer.samples(run, args.iters))

    def med(key):
        rounds = times.get(key)
        return None if rounds is None else statistics.median([t for r in rounds for t in r])

    def round_meds(key):
        return [statistics.median(r) for r in times.get(key, [])]

    rows = []
    body_bytes = body.bytes_read()
    for variant in variants:
        body_ms = med((variant, "body", None))
        for name in heads:
            step_ms, head_ms = med((variant, "step", name)), med((variant, "head", name))
            row = {
                "mode": "chain" if n == 1 else "tree", "tokens": n, "head": name, "variant": variant,
                "step_ms": step_ms, "body_ms": body_ms, "head_ms": head_ms,
                "head_share": None if step_ms is None or head_ms is None else head_ms / step_ms,
                "marginal_share": None if step_ms is None or body_ms is None else (step_ms - body_ms) / step_ms,
                "head_bytes": head_bytes[name], "body_bytes": body_bytes,
                "head_floor_ms": None if bw is None else head_bytes[name] / bw * 1e3,
                "body_floor_ms": None if bw is None else body_bytes / bw * 1e3,
                "round_medians_ms": {"step": round_meds((variant, "step", name)),
                                     "body": round_meds((variant, "body", None)),
                                     "head": round_meds((variant, "head", name))},
                "checks": checks,
            }
            if name == "eagle4_efficient":
                row["parts_ms"] = {p: med((variant, "part", p))
                                   for p in ("lowrank_scores", "lowrank_scores+topk", "candidates")}
            rows.append(row)
    if errors:
        rows.append({"mode": "chain" if n == 1 else "tree", "errors": errors})
    return rows


def fmt(x: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * scale:.{digits}f}"


def markdown(rows: list[dict]) -> str:
    lines = ["| mode | tokens | head | variant | step ms | body ms | head ms | head share | marginal share "
             "| head floor ms |", "|" + "---|" * 10]
    for r in rows:
        if "errors" in r:
            continue
        lines.append(f"| {r['mode']} | {r['tokens']} | {r['head']} | {r['variant']} | {fmt(r['step_ms'])} "
                     f"| {fmt(r['body_ms'])} | {fmt(r['head_ms'])} | {fmt(r['head_share'], 100, 1)}% "
                     f"| {fmt(r['marginal_share'], 100, 1)}% | {fmt(r['head_floor_ms'])} |")
    parts = [r for r in rows if "parts_ms" in r]
    if parts:
        lines += ["", "efficient head, cumulative parts (ms):", "",
                  "| mode | variant | lowrank scores | + top-k | + gather/re-score (candidates) |", "|---|---|---|---|---|"]
        for r in parts:
            p = r["parts_ms"]
            lines.append(f"| {r['mode']} | {r['variant']} | {fmt(p['lowrank_scores'])} "
                         f"| {fmt(p['lowrank_scores+topk'])} | {fmt(p['candidates'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test; use with --small)")
    p.add_argument("--small", action="store_true", help="tiny shapes")
    p.add_argument("--graphs", action="store_true", help="also time CUDA-graph replays")
    p.add_argument("--context", type=int, default=None, help="KV-cache length (default 2048; small: 32)")
    p.add_argument("--tree-tokens", type=int, default=None, help="new tokens per tree step (default 16)")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--topk", type=int, default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--iters", type=int, default=50, help="timed samples per round (>= 20)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="write the full results as JSON here")
    args = p.parse_args(argv)
    if args.iters < 20 and not args.cpu:
        raise ValueError(f"--iters={args.iters}: take the median of at least 20 samples.")

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --cpu --small for the CPU smoke run")
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = getattr(torch, args.dtype or ("float32" if args.cpu else "bfloat16"))
    shape = SMALL if args.small else Shape()
    overrides = {k: v for k, v in {"context": args.context, "tree_tokens": args.tree_tokens,
                                   "rank": args.rank, "topk": args.topk}.items() if v is not None}
    shape = replace(shape, **overrides)

    timer = Timer(device, args.warmup)
    bw = copy_bandwidth(device)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "dtype": str(dtype), "copy_bandwidth_GBps": None if bw is None else bw / 1e9, "shape": asdict(shape),
           "iters": args.iters, "rounds": args.rounds, "warmup": args.warmup}
    print(json.dumps({k: v for k, v in env.items() if k != "shape"}))
    rows = []
    for n in (1, shape.tree_tokens):
        rows += run_mode(shape, n, device, dtype, args, timer, bw)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
