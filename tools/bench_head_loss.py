"""Benchmark of the fused TTT head loss alone (forward + backward), against the field's fused
linear distillation loss, at the real head shapes.

    python tools/bench_head_loss.py --shape qwen3-8b flagship --out docs/bench/head_loss_h200.json

Cases per shape (N = sequence positions, K = 7 TTT steps, bf16 operands):

* ``torchspec-triton``: ``fused_ttt_head_loss`` with the Triton row pass (the training default on CUDA)
* ``torchspec-torch``: the same loop with the torch reference row pass
* ``liger-jsd``: liger-kernel's ``LigerFusedLinearJSD`` with jsd_beta=0 (forward KL), over the N*K
  drafter rows with the teacher's hidden state repeated K times (it takes one teacher row per
  student row), dense head only (it has no low-rank scorer). Skipped when liger-kernel is absent.

Columns: ms (median of CUDA-event timed runs), TFLOP/s of the useful matmul FLOPs
(6 N K V H for the trainable head, + 2 N V H for the teacher logits, + the scorer's 6 N K r (V + H)),
peak GiB over the call, and the loss's relative difference to the torch row pass (same inputs).
CPU runs are a smoke test of the script (tiny shape, no rate claims).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchspec.train.loss import TeacherHead, fused_ttt_head_loss  # noqa: E402

SHAPES = {  # H, V, positions N
    "qwen3-8b": (4096, 151_936, 2048),
    "flagship": (5120, 248_320, 4096),
    "smollm2": (576, 49_152, 2048),
    "tiny": (64, 1000, 64),
}
RANK, TOPK, K = 128, 128, 7


def make_inputs(h: int, v: int, n: int, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    states = (torch.randn(n, K, h, device=device, generator=g) * 1.0).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=g) * h**-0.5 * 3).to(dtype).requires_grad_()
    down = (torch.randn(RANK, h, device=device, generator=g) * h**-0.5).to(dtype).requires_grad_()
    up = (torch.randn(v, RANK, device=device, generator=g) * RANK**-0.5).to(dtype).requires_grad_()
    t_hidden = torch.randn(n, h, device=device, generator=g).to(dtype)
    t_weight = (torch.randn(v, h, device=device, generator=g) * h**-0.5 * 3).to(dtype)
    w = torch.full((n, K), 1.0 / n, device=device)
    return states, weight, down, up, t_hidden, t_weight, w


def run_case(impl: str, scorer: bool, inputs, chunk_gib: float):
    states, weight, down, up, t_hidden, t_weight, w = inputs
    if impl.startswith("torchspec"):
        out = fused_ttt_head_loss(states, weight, TeacherHead(t_hidden, t_weight), w,
                                  scorer=(down, up) if scorer else None, topk=TOPK, chunk_gib=chunk_gib,
                                  backend=impl.split("-")[1])
        out.loss.backward()
        return out.loss.detach()
    from liger_kernel.transformers import LigerFusedLinearJSD

    loss_fn = LigerFusedLinearJSD(jsd_beta=0.0)
    n, k, h = states.shape
    loss = loss_fn(states.reshape(n * k, h), weight, t_hidden.repeat_interleave(k, 0), t_weight, None)
    loss.backward()
    return loss.detach()


def useful_flops(h: int, v: int, n: int, scorer: bool) -> float:
    flops = 6 * n * K * v * h + 2 * n * v * h
    return flops + (6 * n * K * RANK * (v + h) if scorer else 0)


def timed(fn, warmup: int, iters: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    if device != "cuda":
        return float("nan")
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", default=["qwen3-8b"], choices=sorted(SHAPES))
    ap.add_argument("--impl", nargs="+", default=["torchspec-triton", "torchspec-torch", "liger-jsd"])
    ap.add_argument("--chunk-gib", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    rows = []
    for shape in args.shape:
        h, v, n = SHAPES[shape]
        inputs = make_inputs(h, v, n, device, dtype)
        ref = {}
        for scorer in (False, True):
            for impl in args.impl:
                if impl == "liger-jsd" and (scorer or device != "cuda"):
                    continue
                try:
                    loss = run_case(impl, scorer, inputs, args.chunk_gib)
                except ImportError as err:
                    print(f"skip {impl}: {err}")
                    continue
                for p in inputs[:4]:
                    p.grad = None
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                ms = timed(lambda impl=impl, scorer=scorer, inputs=inputs: run_case(impl, scorer, inputs, args.chunk_gib), 1, args.iters, device)
                peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
                for p in inputs[:4]:
                    p.grad = None
                if impl == "torchspec-torch":
                    ref[scorer] = loss
                flops = useful_flops(h, v, n, scorer)
                rows.append({"shape": shape, "impl": impl, "scorer": scorer, "positions": n, "ttt_steps": K,
                             "hidden": h, "vocab": v, "ms": ms, "tflops": flops / ms / 1e9 if ms == ms else None,
                             "peak_gib": peak, "loss": float(loss), "device": gpu})
        for r in rows:
            if r["shape"] == shape and r["scorer"] in ref and r["impl"].startswith("torchspec"):
                r["loss_rel_diff_vs_torch"] = abs(r["loss"] - float(ref[r["scorer"]])) / abs(float(ref[r["scorer"]]))
        del inputs
        torch.cuda.empty_cache() if device == "cuda" else None
    print(f"\n| shape | impl | scorer | ms | TFLOP/s | peak GiB | loss | rel diff vs torch |  ({gpu})")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        fmt = lambda x, f: "-" if x is None or x != x else format(x, f)  # noqa: E731
        print(f"| {r['shape']} | {r['impl']} | {r['scorer']} | {fmt(r['ms'], '.1f')} | {fmt(r['tflops'], '.0f')} | "
              f"{fmt(r['peak_gib'], '.1f')} | {r['loss']:.5f} | {fmt(r.get('loss_rel_diff_vs_torch'), '.1e')} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
