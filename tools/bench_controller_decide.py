"""What the draft controller's decision after a round costs on the GPU: tensor operations against one Triton kernel.

Ahead mode decides after every round (``controlled_rounds._decide_ahead``): the calibration's choice of
exponent and scale, the criterion at each drafted depth, the next round's plan and the calibration's evidence:
~130 small kernels inside the round's CUDA graph as tensor operations (``Calibration.choice`` / ``evidence``,
``controller_policy.decide_every_depth``), one as ``decide_triton.decide_every_depth_fused``. This times both the way a round
runs them -- captured in a CUDA graph and replayed (median of device-event timings over ``--replays``
replays, ``--repeats`` times; the inputs rotate among ``--sets`` random rounds so no cache holds them all) --
for each padded batch and depth count at a SmolLM2-sized cost table, checks the two decide alike on every
set, and prints a table (microseconds a decision) and writes JSON::

    python tools/bench_controller_decide.py --out docs/bench/controller_decide_h200.json

On CPU (no Triton, no graphs) it times the tensor version eagerly and leaves the fused column empty: a smoke
run, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from functools import partial

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from recipes.bench import csv_values  # noqa: E402
from torchspec.cli import check_at_least, user_errors  # noqa: E402
from torchspec.io import atomic_write_text  # noqa: E402
from torchspec.runtime.calibration import Calibration  # noqa: E402
from torchspec.runtime.controlled_rounds import decide_every_depth_calibrated  # noqa: E402
from torchspec.runtime.cost_profile import graph_replay  # noqa: E402
from torchspec.runtime.drafting import pool_steps  # noqa: E402

TABLE_DEPTHS = 6  # the cost table's depths (a SmolLM2 round: ~0.1 ms a depth, ~1 ms a verify forward)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,8,64", help="padded batch sizes (comma-separated)")
    p.add_argument("--depths", default="1,3,5", help="depths a round drafted (comma-separated, each < 6)")
    p.add_argument("--topk", type=int, default=8, help="the dynamic tree's width (1: a chain)")
    p.add_argument("--verified", type=int, default=8, help="the width the round verified (its evidence)")
    p.add_argument("--chunk-nodes", default=None,
                   help="pool nodes a program of the fused kernel's grid sorts at most (comma-separated values to "
                        "compare; default decide_triton.CHUNK_NODES)")
    p.add_argument("--sets", type=int, default=8, help="random rounds the replays rotate among")
    p.add_argument("--replays", type=int, default=200, help="graph replays a timing")
    p.add_argument("--repeats", type=int, default=5, help="timings a case (the median is reported)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/bench/controller_decide_h200.json")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return p


def check_args(args) -> tuple[list[int], list[int]]:
    batches, depths = csv_values("--batches", args.batches, int), csv_values("--depths", args.depths, int)
    if any(d < 1 or d >= TABLE_DEPTHS for d in depths) or any(b < 1 for b in batches):
        raise ValueError(f"--batches {args.batches} / --depths {args.depths}: batches >= 1, depths 1..{TABLE_DEPTHS - 1}.")
    for flag in ("topk", "verified", "sets", "replays", "repeats"):
        check_at_least(f"--{flag}", getattr(args, flag), 1)
    if args.verified > pool_sizes(args.topk, min(depths))[-1]:
        raise ValueError(f"--verified {args.verified}: a round of depth {min(depths)} drafts only "
                         f"{pool_sizes(args.topk, min(depths))[-1]} nodes; verify fewer.")
    return batches, depths


def pool_sizes(topk: int, depth: int) -> list[int]:
    """The nodes a dynamic tree's pool holds after each of ``depth`` depths (``drafting.pool_steps``)."""
    first, step = pool_steps(topk)
    return [first + step * d for d in range(depth)]


def random_round(gen: torch.Generator, batch: int, depth: int, topk: int, dev: torch.device) -> dict:
    """A round's decision inputs: path log-probs falling with depth, a few dead rows, a SmolLM2-like table."""
    def logp(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=gen) * -4.0).to(dev)
    sizes = pool_sizes(topk, depth)  # the dynamic tree's pool: k nodes at depth 1, k * k children a depth after
    pool = torch.cat([logp(batch, sizes[0])] + [logp(batch, sizes[1] - sizes[0]) * (d + 1) for d in range(1, depth)], 1)
    fronts = torch.stack([logp(batch, topk) * (d + 1) for d in range(depth)])
    edges = torch.stack([logp(batch, topk) for _ in range(depth)])
    valid = (torch.rand(batch, generator=gen) > 0.1).to(dev)
    valid[0] = True
    depth_ms = (0.1 + 0.02 * torch.rand(TABLE_DEPTHS, generator=gen)).float().to(dev)
    verify_ms = (0.9 + 0.01 * torch.arange(topk * TABLE_DEPTHS + 1) + 0.01 * torch.rand(topk * TABLE_DEPTHS + 1,
                                                                                             generator=gen)).float().to(dev)
    cal = Calibration(dev)  # random evidence (expectations rising as the exponent falls): any exponent and scale
    cal.accepted.fill_(float(torch.rand(1, generator=gen)) * 6)
    cal.expected.copy_(torch.sort(torch.rand(len(cal.expected), generator=gen, dtype=torch.float64) * 6).values)
    cal.accepted_by_rank.copy_(torch.rand(cal.accepted_by_rank.shape, generator=gen, dtype=torch.float64) * 2)
    cal.expected_by_rank.copy_(torch.sort(torch.rand(cal.expected_by_rank.shape, generator=gen, dtype=torch.float64) * 2,
                                          dim=0).values)
    return {"pool": pool, "sizes": sizes, "fronts": fronts, "edges": edges,
            "valid": valid,
            "depth_ms": depth_ms, "verify_ms": verify_ms, "cal": cal}


def decide_tensor(r: dict, verified: int):
    """What ahead mode runs after a round without the kernel (``controlled_drafting``)."""
    plan, r["cal"].pending = decide_every_depth_calibrated(r["pool"], r["sizes"], r["fronts"], r["edges"],
                                                           r["depth_ms"], r["verify_ms"], r["valid"], r["cal"],
                                                           verified)
    return plan


def decide_fused(r: dict, verified: int):
    """The same with the kernel (``controlled_rounds._decide_ahead`` on CUDA)."""
    from torchspec.runtime.decide_triton import decide_every_depth_fused

    plan, r["cal"].pending = decide_every_depth_fused(r["pool"], r["sizes"], r["fronts"], r["edges"], r["depth_ms"],
                                                      r["verify_ms"], r["valid"], r["cal"], verified)
    return plan


def outputs(plan, cal: Calibration) -> list:
    return [plan.go.tolist(), plan.width.tolist(), int(plan.next_depth), int(plan.next_width), int(plan.drafted),
            cal.pending.tolist()]


def time_us(fn, sets: list[dict], args) -> float:
    """Median microseconds a decision: graph replays over ``sets`` on CUDA (one graph a set), eager on CPU."""
    if args.device == "cpu":
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for i in range(args.replays):
                fn(sets[i % len(sets)], args.verified)
            times.append((time.perf_counter() - t0) / args.replays * 1e6)
        return statistics.median(times)
    graphs = [graph_replay(partial(fn, r, args.verified), 1)[1] for r in sets]  # warmed up, then captured
    times = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for i in range(args.replays):
            graphs[i % len(graphs)].replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / args.replays * 1e3)
    return statistics.median(times)


def bench(args) -> dict:
    batches, depths = check_args(args)
    dev, gen = torch.device(args.device), torch.Generator().manual_seed(args.seed)
    fused = dev.type == "cuda"
    chunks = [None]  # the fused kernel's chunk sizes to compare (none on the CPU)
    if fused:
        from torchspec.runtime import decide_triton
        default_chunk = decide_triton.CHUNK_NODES
        chunks = csv_values("--chunk-nodes", args.chunk_nodes, int) if args.chunk_nodes else [default_chunk]
        if min(chunks) < 1:
            raise ValueError(f"--chunk-nodes {args.chunk_nodes}: each at least 1.")
    rows = []
    out = {"device": torch.cuda.get_device_name(dev) if fused else "cpu",
           "timing": "cuda-graph replays, device events" if fused else "eager, host clock", "args": vars(args),
           "rows": rows}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        for b in batches:
            for d in depths:
                sets = [random_round(gen, b, d, args.topk, dev) for _ in range(args.sets)]
                tensor_us = time_us(decide_tensor, sets, args)
                for chunk_nodes in chunks:
                    fused_us = None
                    if fused:
                        decide_triton.CHUNK_NODES = chunk_nodes
                        for r in sets:  # the same decisions, bit for bit, on every set
                            want = outputs(decide_tensor(r, args.verified), r["cal"])
                            got = outputs(decide_fused(r, args.verified), r["cal"])
                            if want != got:
                                raise AssertionError(f"batch {b} depth {d}: fused {got} != tensor {want}")
                        fused_us = time_us(decide_fused, sets, args)
                    rows.append({"batch": b, "depths": d, "topk": args.topk, "chunk_nodes": chunk_nodes,
                                 "tensor_us": tensor_us, "fused_us": fused_us,
                                 "saved_us": None if fused_us is None else tensor_us - fused_us})
                    print(format_row(rows[-1]), flush=True)
                    atomic_write_text(args.out, json.dumps(out, indent=1))  # every row as it comes: a cut-off keeps them
    finally:  # the module's own chunk size back, whatever a case raised
        if fused:
            decide_triton.CHUNK_NODES = default_chunk
    return out


def format_row(r: dict) -> str:
    fused = "       -" if r["fused_us"] is None else f"{r['fused_us']:8.1f}"
    saved = "" if r["saved_us"] is None else f"  saved {r['saved_us']:7.1f} us"
    chunk = "" if r["chunk_nodes"] is None else f"  chunk {r['chunk_nodes']:>4}"
    return f"batch {r['batch']:>3}  depths {r['depths']}  k={r['topk']}{chunk}  tensor {r['tensor_us']:8.1f} us  fused {fused} us{saved}"


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    with user_errors("bench_controller_decide", args.debug):
        out = bench(args)
        print(f"wrote {args.out} ({out['device']})")
        return out


if __name__ == "__main__":
    main()
