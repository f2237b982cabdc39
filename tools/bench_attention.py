"""Benchmark the TTT attention backends (torchspec/models/attention.py) at the drafter's shape.

Times one TTT step's attention as ``Attention.forward`` runs it: GQA expansion of the k + 1 steps'
keys/values (``repeat_kv``) plus the backend, forward only (under no_grad) and forward + backward
(gradients down to the un-expanded q/k/v). Default shape: the Qwen3.5-27B-class drafter attention,
24 query heads, 4 KV heads, head_dim 256, batch 1, bf16, on CUDA, at T = 2K, 8K, 32K, for k = 0
and k = 3 diagonal steps, window None vs 4096.

Timing (CUDA): warm-up calls (they also compile flex), then per repeat a pair of CUDA events
around the call, median of the repeats; peak memory is ``torch.cuda.max_memory_allocated`` over
the timed calls, and ``extra`` is that peak minus the memory held by the inputs. ``TFLOP/s`` counts
useful work only: 4*B*h*D per attended (query, key) pair forward, 3.5x that forward + backward
(FlashAttention's convention: backward = 2.5x forward). Eager is skipped where its [T, T] fp32
scores would not fit. A correctness check (forward, relative norm error against eager in fp32 on
upcast inputs, at the smallest T) comes first.

    python tools/bench_attention.py --out bench_attention.json          # GPU, flagship shapes
    python tools/bench_attention.py --cpu --small                      # CPU smoke check
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from torchspec.models.attention import TTT_ATTENTION, ttt_attention_eager
from torchspec.models.layers import repeat_kv

GIB = 2**30


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run on CPU (smoke check; no flex backward)")
    p.add_argument("--small", action="store_true", help="tiny shapes: T 64/200, 4 heads, 2 KV heads, dim 32")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="context lengths T")
    p.add_argument("--steps", type=int, nargs="+", default=[0, 3], help="diagonal steps k")
    p.add_argument("--windows", nargs="+", default=None, help="windows; 'none' = full causal")
    p.add_argument("--backends", nargs="+", default=["eager", "chunked", "flex"], choices=sorted(TTT_ATTENTION))
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--chunk", type=int, default=None, help="chunked backend's query block (default 512)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3; 1 with --small)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls, median reported (default 10; 3 with --small)")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--eager-mem-frac", type=float, default=0.7,
                   help="skip eager when its estimated memory exceeds this share of free GPU memory")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU (shared CI cores thrash at 2)")
    p.add_argument("--out", default=None, help="write all rows as JSON here")
    args = p.parse_args()
    if args.small:
        args.heads, args.kv_heads, args.head_dim = 4, 2, 32
        args.seq_lens = args.seq_lens or [64, 200]
        args.windows = args.windows or ["none", "32"]
        args.chunk = args.chunk or 48
        args.warmup = 1 if args.warmup is None else args.warmup
        args.repeats = args.repeats or 3
    args.seq_lens = args.seq_lens or [2048, 8192, 32768]
    args.windows = [None if w.lower() == "none" else int(w) for w in (args.windows or ["none", "4096"])]
    args.chunk = args.chunk or 512
    args.warmup = 3 if args.warmup is None else args.warmup
    args.repeats = args.repeats or 10
    args.device = torch.device("cpu" if args.cpu else "cuda")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; pass --cpu (with --small for a smoke check)")
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("fp32" if args.cpu else "bf16")]
    return args


def backend_fn(name: str, chunk: int):
    fn = TTT_ATTENTION[name]
    if name == "chunked":
        return lambda q, k, v, scale, window: fn(q, k, v, scale, window, chunk_size=chunk)
    return fn


def attended_pairs(t: int, steps: int, window: int | None) -> int:
    w = t if window is None else min(window, t)
    step0 = w * (w + 1) // 2 + (t - w) * w  # sum_t min(t + 1, w)
    return step0 + steps * t


def make_inputs(args, t: int, steps: int, grad: bool, seed: int = 0):
    g = torch.Generator(device=args.device).manual_seed(seed)
    b, d = args.batch, args.head_dim

    def rand(heads):
        x = torch.randn(b, heads, t, d, generator=g, device=args.device, dtype=args.dtype)
        return x.requires_grad_(grad)

    return rand(args.heads), [rand(args.kv_heads) for _ in range(steps + 1)], [rand(args.kv_heads) for _ in range(steps + 1)]


def attention_step(fn, q, keys, values, window, groups):
    """As ``Attention.forward``: expand GQA, then the backend."""
    return fn(q, [repeat_kv(k, groups) for k in keys], [repeat_kv(v, groups) for v in values],
              q.shape[-1] ** -0.5, window)


def eager_bytes(args, t: int, steps: int, backward: bool) -> int:
    """Rough peak of eager: about six fp32 [B, h, T, T + k] buffers live (scores, scaled, masked,
    concatenated, softmax, probs), more kept for backward."""
    return (8 if backward else 6) * 4 * args.batch * args.heads * t * (t + steps)


def time_call(args, call) -> list[float]:
    """Milliseconds per repeat (CUDA events, or perf_counter on CPU), after warm-up."""
    for _ in range(args.warmup):
        call()
    times = []
    if args.device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure(args, fn, t: int, steps: int, window: int | None, backward: bool) -> tuple[list[float], dict]:
    """Allocate inputs, time the call; the inputs are freed when this returns."""
    groups = args.heads // args.kv_heads
    q, keys, values = make_inputs(args, t, steps, grad=backward)
    grad_out = torch.randn(args.batch, args.heads, t, args.head_dim, device=args.device, dtype=args.dtype)
    leaves = [q, *keys, *values]

    def call():
        if backward:
            out = attention_step(fn, q, keys, values, window, groups)
            torch.autograd.grad(out, leaves, grad_out)
        else:
            with torch.no_grad():
                attention_step(fn, q, keys, values, window, groups)

    if args.device.type != "cuda":
        return time_call(args, call), {}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    times = time_call(args, call)
    peak = torch.cuda.max_memory_allocated()
    return times, {"peak_gib": peak / GIB, "extra_gib": (peak - held) / GIB}


def bench_one(args, name: str, t: int, steps: int, window: int | None, mode: str) -> dict:
    row = {"backend": name, "T": t, "k": steps, "window": window, "mode": mode, "chunk": args.chunk}
    backward = mode == "fwd+bwd"
    if name == "flex" and backward and args.device.type == "cpu":
        return {**row, "skipped": "flex has no backward on CPU"}
    if name == "eager" and args.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        need = eager_bytes(args, t, steps, backward)
        if need > args.eager_mem_frac * free:
            return {**row, "skipped": f"eager needs ~{need / GIB:.0f} GiB"}
    try:
        times, extra = measure(args, backend_fn(name, args.chunk), t, steps, window, backward)
    except torch.OutOfMemoryError:
        return {**row, "skipped": "out of memory"}
    except Exception as exc:  # a benchmark reports a failing backend and goes on
        return {**row, "skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    finally:
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    median = statistics.median(times)
    flops = 4 * args.batch * args.heads * args.head_dim * attended_pairs(t, steps, window)
    flops *= 3.5 if backward else 1.0
    row.update(median_ms=median, min_ms=min(times), max_ms=max(times), repeats=len(times),
               tflops=flops / (median * 1e-3) / 1e12)
    return {**row, **extra}


def check_backends(args) -> list[dict]:
    """Forward output of each backend against eager in fp32 on upcast inputs, smallest T."""
    t, rows = min(args.seq_lens), []
    groups = args.heads // args.kv_heads
    for steps in args.steps:
        for window in args.windows:
            q, keys, values = make_inputs(args, t, steps, grad=False, seed=1)
            with torch.no_grad():
                ref = attention_step(ttt_attention_eager, q.float(), [k.float() for k in keys],
                                     [v.float() for v in values], window, groups)
                for name in args.backends:
                    try:
                        out = attention_step(backend_fn(name, args.chunk), q, keys, values, window, groups)
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                    except Exception as exc:
                        err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    rows.append({"backend": name, "T": t, "k": steps, "window": window, "rel_err": err})
    return rows


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    if args.device.type == "cpu":
        torch.set_num_threads(args.cpu_threads)
    device_name = torch.cuda.get_device_name() if args.device.type == "cuda" else platform.processor() or "cpu"
    checks = check_backends(args)
    rows = []
    for t in args.seq_lens:
        for steps in args.steps:
            for window in args.windows:
                for name in args.backends:
                    for mode in args.modes:
                        rows.append(bench_one(args, name, t, steps, window, mode))
                        r = rows[-1]
                        print(f"T={t} k={steps} window={window} {name} {mode}: "
                              f"{fmt(r.get('median_ms'), '.3f')} ms {r.get('skipped', '')}", flush=True)

    print(f"\n# TTT attention, {device_name}, torch {torch.__version__}, {str(args.dtype).removeprefix('torch.')}, "
          f"B={args.batch} heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim} chunk={args.chunk}\n")
    print("Correctness (forward, relative norm error vs eager fp32):\n")
    print("| T | k | window | backend | rel err |\n|---|---|---|---|---|")
    for c in checks:
        err = c["rel_err"]
        print(f"| {c['T']} | {c['k']} | {c['window']} | {c['backend']} | "
              f"{format(err, '.2e') if isinstance(err, float) else err} |")
    print("\n| T | k | window | backend | mode | median ms | TFLOP/s | peak GiB | extra GiB | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['k']} | {r['window']} | {r['backend']} | {r['mode']} | "
              f"{fmt(r.get('median_ms'), '.3f')} | {fmt(r.get('tflops'), '.3g')} | "
              f"{fmt(r.get('peak_gib'), '.2f')} | {fmt(r.get('extra_gib'), '.2f')} | {r.get('skipped', '')} |")
    if args.out:
        meta = {k: str(v) if isinstance(v, torch.device | torch.dtype) else v for k, v in vars(args).items()}
        with open(args.out, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "args": meta,
                       "checks": checks, "rows": rows}, f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
