"""Benchmark attention over the paged KV cache: the Triton kernels against the gather reference.

One layer's attention as ``paged_attention`` runs it in serving (this forward's K/V already in the
pool), at the Qwen3-8B attention shape by default (32 query heads, 8 KV heads, head_dim 128, bf16):

* ``decode``: one query per row; ``tree16`` / ``tree32``: a verify forward of the root plus 16 / 32
  nodes of a random tree (Tq = 17 / 33); optional ``prefill512``: a 512-token chunk after the prefix.
* committed context 2K / 8K / 32K (32K less the forward's Tq, so the round fits) with the block
  table sized for ``--max-context`` (32K): the
  reference gathers all 32K slots of every row whatever its length, the kernels read ``ctx`` keys,
  so their time should follow the context column while the reference's stays flat.
* batch 1 / 8 / 64; rows hold scattered pages from a shared pool; table entries past a row's
  pages are the trash page, as the engine leaves them.

Timing (CUDA): each call is captured ``--inner`` times in one CUDA graph (serving replays graphs;
this drops launch overhead from the comparison), warm-up replays, then ``--repeats`` replays
between CUDA events; the median per call is reported. ``mask_ms`` is the reference's per-forward
dense mask (built once per forward, shared by the layers); the kernels need none. ``kv_gbps`` =
bytes of K and V the row lengths require (B * kv_heads * (ctx + Tq) * D * 2 * itemsize) / time, so
the reference's value shows how little of what it reads is needed; ``of_copy`` divides it by the
device-to-device copy rate measured here on a 2 GiB buffer ((read + write bytes) / time). Each case
first checks the kernel against the reference (``max_err``).

    python tools/bench_attention_paged.py --json docs/bench/attention_paged_h200.json     # GPU
    TRITON_INTERPRET=1 python tools/bench_attention_paged.py --smoke                       # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from torchspec.runtime.paged_kv import build_attention_meta, paged_attention_reference, table_columns
from torchspec.runtime.tree import tree_attention_mask

MODES = {"decode": 1, "chain6": 6, "tree16": 17, "tree32": 33, "prefill512": 512}  # new tokens per row
LENGTHS = ("uniform", "spread", "one_long")  # committed tokens per row: all ctx; ctx * (i+1)/B; one ctx, rest ctx/16


def row_lengths(kind: str, batch: int, ctx: int) -> list[int]:
    """Committed tokens of each row: ``ctx`` is the longest, so the block table's width is the same."""
    if kind == "spread":
        return [max(1, round(ctx * (i + 1) / batch)) for i in range(batch)]
    if kind == "one_long":
        return [ctx] + [max(1, ctx // 16)] * (batch - 1)
    return [ctx] * batch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny shapes; the kernels only under TRITON_INTERPRET=1 (else the reference alone)")
    p.add_argument("--modes", nargs="+", default=["decode", "tree16", "tree32"], choices=sorted(MODES))
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--max-context", type=int, default=32768, help="block table width in tokens")
    p.add_argument("--lengths", choices=LENGTHS, default="uniform",
                   help="rows' committed lengths: every row ctx; spread from ctx/B to ctx; or one row of ctx among "
                        "rows of ctx/16 (what the planner's long-row rule is for)")
    p.add_argument("--table", choices=("engine", "full"), default="engine",
                   help="block-table columns a forward gets: the engine's (its longest row's power-of-two bucket, "
                        "paged_kv.table_columns; the planner sees that width) or the whole --max-context table")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--impls", nargs="+", default=["kernel", "reference"], choices=["kernel", "kernel_bw", "reference"],
                   help="kernel_bw: the kernels with the bandwidth chunk rule alone (min_chunk >= 8 x rows keys, "
                        "the rule before small grids took one-tile splits)")
    p.add_argument("--splits", type=int, nargs="*", default=[],
                   help="also time the kernel at each of these explicit split counts (impl kernel_s<N>), to check "
                        "the planner's choice against the best one per case")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--inner", type=int, default=10, help="calls per CUDA graph replay")
    p.add_argument("--json", default=None, help="write the rows here (e.g. docs/bench/attention_paged_h200.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.modes = ["decode", "tree16"]
        args.contexts, args.batches, args.max_context = [40, 100], [2], 128
        args.heads, args.kv_heads, args.head_dim, args.dtype = 4, 2, 64, "fp32"
        args.warmup, args.repeats, args.inner = 1, 2, 1
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        args.impls = ["kernel", "reference"] if interpret and _has_triton() else ["reference"]
        args.device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            p.error("CUDA is not available; pass --smoke for the CPU check")
        args.device = torch.device("cuda")
    args.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    return args


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def copy_gbps(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, (read + write bytes) / time, median of 10."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        t0 = _now(device)
        dst.copy_(src)
        elapsed = _since(device, t0)
        if i >= 2:
            times.append(elapsed)
    return 2 * nbytes / statistics.median(times) / 1e9


def _now(device):
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _since(device, start) -> float:
    """Seconds since ``start`` (a CUDA event, synchronising, or a perf_counter reading)."""
    if device.type == "cuda":
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return time.perf_counter() - start


def make_case(args, batch: int, ctx: int, tq: int, seed: int = 0, mode: str = "tree"):
    """Pool, block tables, meta and q for ``batch`` rows of up to ``ctx`` committed tokens (``args.lengths``)
    plus ``tq`` new ones: a random tree of them, or a chain (``mode`` chain* / prefill*)."""
    dev, page = args.device, args.page_size
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages_per_row = args.max_context // page
    lens = row_lengths(getattr(args, "lengths", "uniform"), batch, ctx)
    need = [-(-(n + tq) // page) for n in lens]
    assert max(need) <= pages_per_row, f"ctx {ctx} + {tq} does not fit max_context {args.max_context}"
    num_pages = sum(need) + 1
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    bt = torch.zeros(batch, pages_per_row, dtype=torch.long)
    for row, n in enumerate(need):
        bt[row, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    shape = (num_pages * page, args.kv_heads, args.head_dim)
    k_pool = torch.randn(shape, dtype=args.dtype, device=dev)
    v_pool = torch.randn(shape, dtype=args.dtype, device=dev)
    q = torch.randn(batch, tq, args.heads, args.head_dim, dtype=args.dtype, device=dev).transpose(1, 2)
    if tq > 64 or mode.startswith(("chain", "prefill")):
        tree = torch.ones(tq, tq, dtype=torch.bool).tril().expand(batch, tq, tq)
    else:
        parents = torch.stack([torch.cat([torch.tensor([-1]), (torch.rand(tq - 1, generator=g)
                               * torch.arange(1, tq)).long()]) for _ in range(batch)])
        tree = tree_attention_mask(parents)
    ctx_len = torch.tensor(lens, dtype=torch.long)
    if getattr(args, "table", "engine") == "engine":  # the columns the engine passes: its longest row's bucket
        bt = bt[:, :table_columns(max(lens) + tq, page, pages_per_row)]
    meta = build_attention_meta(bt.to(dev), ctx_len.to(dev), tree.to(dev), page)
    return q, k_pool, v_pool, meta


def time_ms(args, call) -> float:
    """Median milliseconds per call (CUDA graph of ``inner`` calls, or perf_counter on CPU)."""
    if args.device.type != "cuda":
        for _ in range(args.warmup):
            call()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.inner):
            call()
    for _ in range(args.warmup):
        graph.replay()
    times = []
    for _ in range(args.repeats):
        start = _now(args.device)
        graph.replay()
        times.append(_since(args.device, start) * 1e3 / args.inner)
    return statistics.median(times)


def _bandwidth_rule(attend, *args):
    """``attend(*args)`` planned with the large-grid chunk rule alone (``bandwidth_split_rule``)."""
    from torchspec.runtime.attention_plan import bandwidth_split_rule

    with bandwidth_split_rule():
        return attend(*args)


def bench_case(args, mode: str, batch: int, ctx: int, copy: float) -> list[dict]:
    tq = MODES[mode]
    q, k_pool, v_pool, meta = make_case(args, batch, ctx, tq, mode=mode)
    scale = args.head_dim ** -0.5
    ref = paged_attention_reference(q, k_pool, v_pool, meta, scale)  # also builds meta.mask once
    calls = {"reference": lambda: paged_attention_reference(q, k_pool, v_pool, meta, scale)}
    max_err = None
    if {"kernel", "kernel_bw"} & set(args.impls):
        from torchspec.runtime.paged_attention_triton import paged_attention_triton

        calls["kernel"] = lambda: paged_attention_triton(q, k_pool, v_pool, meta, scale)
        calls["kernel_bw"] = lambda: _bandwidth_rule(paged_attention_triton, q, k_pool, v_pool, meta, scale)
        max_err = (calls["kernel"]().float() - ref.float()).abs().max().item()
        for n in args.splits:  # default arguments bind n now, not at the last iteration's value
            calls[f"kernel_s{n}"] = lambda n=n: paged_attention_triton(q, k_pool, v_pool, meta, scale, num_splits=n)
    needed = (int(meta.ctx_len.sum()) + batch * tq) * args.kv_heads * args.head_dim * 2 * k_pool.element_size()
    mask_ms = time_ms(args, lambda: build_attention_meta(meta.block_table, meta.ctx_len, meta.tree_mask,
                                                         meta.page_size).mask)
    rows = []
    impls = args.impls + [f"kernel_s{n}" for n in args.splits if f"kernel_s{n}" in calls]
    for impl in impls:
        ms = time_ms(args, calls[impl])
        gbps = needed / (ms * 1e-3) / 1e9
        rows.append(dict(mode=mode, tq=tq, batch=batch, ctx=ctx, lengths=args.lengths, impl=impl, ms=ms, kv_gbps=gbps,
                         table_keys=meta.block_table.shape[1] * meta.page_size,
                         of_copy=gbps / copy, mask_ms=mask_ms if impl == "reference" else 0.0,
                         max_err=max_err))
    return rows


def print_table(rows: list[dict]) -> None:
    print("| mode | Tq | batch | ctx | impl | ms | KV GB/s | of copy | mask ms | max err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['mode']} | {r['tq']} | {r['batch']} | {r['ctx']} | {r['impl']} | {r['skipped']} |")
            continue
        err = "" if r["max_err"] is None else f"{r['max_err']:.1e}"
        print(f"| {r['mode']} | {r['tq']} | {r['batch']} | {r['ctx']} | {r['impl']} | {r['ms']:.4f} | "
              f"{r['kv_gbps']:.0f} | {r['of_copy']:.2f} | {r['mask_ms']:.4f} | {err} |")


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    copy = copy_gbps(args.device, (2 << 30) if args.device.type == "cuda" else (64 << 20))
    print(f"device {torch.cuda.get_device_name() if args.device.type == 'cuda' else platform.processor() or 'cpu'}; "
          f"copy {copy:.0f} GB/s (read + write); impls {args.impls}; row lengths {args.lengths}")
    rows = []
    for mode in args.modes:
        for batch in args.batches:
            for ctx in args.contexts:
                ctx = min(ctx, args.max_context - MODES[mode])  # the round's tokens must fit the table
                try:
                    rows += bench_case(args, mode, batch, ctx, copy)
                except torch.OutOfMemoryError:
                    rows += [dict(mode=mode, tq=MODES[mode], batch=batch, ctx=ctx, impl=impl, skipped="out of memory")
                             for impl in args.impls]
                if args.device.type == "cuda":
                    torch.cuda.empty_cache()  # the case's pools are gone: give the next one room
    print_table(rows)
    if args.json:
        meta = dict(device=str(args.device), torch=torch.__version__, copy_gbps=copy, heads=args.heads,
                    kv_heads=args.kv_heads, head_dim=args.head_dim, page_size=args.page_size,
                    max_context=args.max_context, lengths=args.lengths, table=args.table, dtype=str(args.dtype).removeprefix("torch."),
                    gpu=torch.cuda.get_device_name() if args.device.type == "cuda" else None)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"setup": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
