"""Drafter-head candidate selection on the GPU: the Triton top-k against ``torch.topk``, in CUDA graphs.

For each (rows N, vocabulary V) the scores [N, V] are random and each selection of k is captured in
its own CUDA graph (``profile_round.graph_ms``: median of 50 replays, CUDA events) and profiled once
eagerly for its kernel count (``profile_round.kernel_profile``):

    torch        torch.topk(k, sorted=False).indices (what EfficientLMHead.candidates ran)
    triton       runtime.select_triton.topk_indices_triton with its default plan
    triton@B     the same with BLOCK_V forced to B (``--blocks``; a sweep to check ``plan``'s rule)

``match`` says the Triton ids are the same set as torch's per row (random bf16 scores tie rarely
at the k-th; a tie may differ, so a few mismatching rows are reported, not raised). Under a minute
on an H200 with the defaults:

    python3 tools/bench_select.py --json /tmp/select.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from profile_round import graph_ms, kernel_profile  # noqa: E402

from torchspec.runtime.select_triton import plan, topk_indices_triton  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def same_sets(a: torch.Tensor, b: torch.Tensor) -> int:
    """Rows whose index sets differ."""
    return int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())


@torch.no_grad()
def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,64", help="comma-separated N (batch x frontier width)")
    p.add_argument("--vocab", default="49152,151936", help="comma-separated V")
    p.add_argument("--k", default="128", help="comma-separated k")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--blocks", default="2048,4096,8192", help="forced BLOCK_V sweep ('' for none)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    sweep = [int(b) for b in args.blocks.split(",") if b]
    rows = []
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  (ms per call, CUDA-graph replay median)")
    print("|    N |      V |   k | impl         |     ms | kernels | mismatched rows |")
    print("|-----:|-------:|----:|:-------------|-------:|--------:|----------------:|")
    for v in (int(x) for x in args.vocab.split(",")):
        for k in (int(x) for x in args.k.split(",")):
            for n in (int(x) for x in args.rows.split(",")):
                scores = torch.randn(n, v, device="cuda").to(dtype)
                want = scores.topk(k, dim=-1, sorted=False).indices
                impls = {"torch": (lambda s=scores, k=k: s.topk(k, dim=-1, sorted=False).indices, None),
                         "triton": (lambda s=scores, k=k: topk_indices_triton(s, k), plan(v, k, dtype)["block_v"])}
                for b in sweep:
                    if b >= plan(v, k, dtype)["kp"] and b != impls["triton"][1]:
                        impls[f"triton@{b}"] = (lambda s=scores, k=k, b=b: topk_indices_triton(s, k, block_v=b), b)
                for name, (fn, block_v) in impls.items():
                    ms = graph_ms(fn)
                    kernels = kernel_profile(fn, 4)[0] if "@" not in name else None
                    bad = 0 if name == "torch" else same_sets(fn(), want)
                    rows.append({"rows": n, "vocab": v, "k": k, "dtype": args.dtype, "impl": name,
                                 "block_v": block_v, "ms": ms, "kernels": kernels, "mismatched_rows": bad})
                    print(f"| {n:4d} | {v:6d} | {k:3d} | {name:<12} | {ms:6.4f} | {kernels if kernels else '':>7} | "
                          f"{bad:15d} |", flush=True)
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows},
                                  indent=1))
        tmp.replace(path)
    return rows


if __name__ == "__main__":
    main()
