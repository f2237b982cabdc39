"""Where a plain decode step's time goes (GPU): kernel time by kind, kernel count, graph replay time.

Builds the random-weight target of ``tools/bench_runtime_efficiency.py`` at a shape, prefills
``--batch`` rows of ``--ctx`` tokens, then (1) times the CUDA-graphed plain step (median of
replays) and (2) profiles eager steps with torch.profiler and groups kernel time by name, so the
gap between the step and its HBM floor can be attributed (GEMMs, attention, elementwise, launches).

    python tools/profile_decode_step.py --shape qwen3-8b --batch 1 --ctx 512 [--fuse]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))


def main() -> None:
    from bench_runtime_efficiency import build_engine
    from profile_round import graph_ms as graph_replay_ms

    from torchspec.runtime.costs import bytes_per_plain_step, copy_rate_bytes_per_s
    from torchspec.runtime.sampling import SamplingParams
    from torchspec.runtime.steps import plain_step

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--fuse", action="store_true", help="serve the fused decoder (TargetDecoder.fuse_for_serving)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    engine = build_engine(args.shape, 0.1, args.batch, args.max_context, 0, "cuda", fuse=args.fuse)
    b = args.batch
    prompts = torch.randint(0, engine.decoder.vocab_size, (b, args.ctx)).tolist()
    engine.generate(prompts, max_new_tokens=4, ignore_eos=True)  # warm-up, graphs captured
    # a step over a live-looking batch: rows own pages for ctx tokens
    for i in range(b):
        pages = engine.allocator.alloc(-(-(args.ctx + 1) // engine.page_size))
        engine.block_table[i, : len(pages)] = torch.tensor(pages)
    ctx = torch.full((b,), args.ctx, dtype=torch.long, device="cuda")
    root = torch.zeros(b, dtype=torch.long, device="cuda")
    valid = torch.ones(b, dtype=torch.bool, device="cuda")
    params = SamplingParams()

    bt = engine.block_table[:b, :engine.table_columns_for(args.ctx + 1)]  # the columns the engine's step reads

    def step():
        return plain_step(engine.decoder, engine.caches, bt, ctx, root, valid, params, None)

    graph_ms, _ = graph_replay_ms(step)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += e.device_time / 5 / 1e3
            by_name[e.name][1] += 1 / 5
    kernel_ms = sum(v[0] for v in by_name.values())
    kernels = sum(v[1] for v in by_name.values())
    floor_ms = bytes_per_plain_step(engine, b, args.ctx) / copy_rate_bytes_per_s("cuda") * 1e3
    print(f"{torch.cuda.get_device_name()}  shape {args.shape}  batch {b}  ctx {args.ctx}  fuse {args.fuse}")
    print(f"graph step {graph_ms:.3f} ms   kernel sum {kernel_ms:.3f} ms   kernels {kernels:.0f}   "
          f"HBM floor {floor_ms:.3f} ms   ({floor_ms / graph_ms:.0%} of floor)")
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    for name, (ms, n) in rows[:25]:
        print(f"{ms:8.3f} ms {n:6.0f}x  {name[:110]}")
    if args.json:
        out = {"device": torch.cuda.get_device_name(), "args": vars(args), "graph_ms": graph_ms,
               "kernel_ms": kernel_ms, "kernels": kernels, "floor_ms": floor_ms,
               "top": [{"name": k, "ms": v[0], "count": v[1]} for k, v in rows[:40]]}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
