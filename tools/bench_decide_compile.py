"""What compiling the draft controller's decision kernel costs: seconds and PTX size per variant, no GPU needed.

An engine compiles ``decide_triton``'s two kernels (``KERNELS``) once per variant (``decide_triton.kernel_variant``: row
chunk, calibrated or not, column and depth blocks of the cost table) while it warms its CUDA graphs, so a
variant that takes a minute to compile stalls the first rounds of every concurrency level. This compiles each
variant of a table ahead of time for a GPU architecture (``triton.compile`` with an explicit target: Triton's
front end and ptxas run on the CPU) and prints a table (seconds, PTX and cubin bytes) and writes JSON::

    python tools/bench_decide_compile.py --batches 1,2,4,8,64 --topk 8,1 --table-depths 6 \\
        --out docs/bench/decide_compile_cpu.json

Needs ``triton`` importable (the CUDA torch wheel carries it; on a CPU machine, Triton's own wheel). Times
are this machine's CPU's, and Triton's cache is bypassed (a fresh cache directory a run).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from recipes.bench import csv_values  # noqa: E402
from torchspec.cli import user_errors  # noqa: E402
from torchspec.io import atomic_write_text  # noqa: E402

POINTERS = {"valid_ptr": "*i1", "go_ptr": "*i1", "width_ptr": "*i64", "ints_ptr": "*i64", "pool_ptr": "*fp32",
            "front_ptr": "*fp32", "edge_ptr": "*fp32", "sums_ptr": "*i64", "estimates_ptr": "*i64",
            "averages_ptr": "*i64"}  # every other pointer is float64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,8,64", help="padded batch sizes (comma-separated)")
    p.add_argument("--topk", default="8,1", help="dynamic trees' widths (1: the chain), comma-separated")
    p.add_argument("--table-depths", type=int, default=6, help="the cost table's depths")
    p.add_argument("--num-nodes", type=int, default=32,
                   help="the trees' verified nodes at most (a chain verifies up to --table-depths): the averaged "
                        "table's verify widths, as the runtime passes them")
    p.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: Hopper)")
    p.add_argument("--out", default="docs/bench/decide_compile_cpu.json")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return p


def compile_variant(batch: int, topk: int, table_depths: int, calibrated: bool, arch: int, num_nodes: int = 32) -> dict:
    """Compile one variant for ``arch`` (its averaged table as wide as the round's verify widths: 0 .. ``num_nodes``
    for a tree, 0 .. ``table_depths`` for a chain); -> its compile-time arguments, seconds and sizes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torchspec.runtime.decide_triton import KERNELS, kernel_variant
    from torchspec.runtime.drafting import pool_steps
    from torchspec.runtime.plan_averages import AVERAGED, plans_how

    widths = (num_nodes if topk > 1 else table_depths) + 1
    meta = kernel_variant(batch, pool_steps(topk), topk, table_depths, calibrated, plans_how() in AVERAGED, widths)
    meta["EXACT"] = True  # what a GPU compiles (the interpreter's NumPy exp needs no compile)
    num_warps = meta.pop("num_warps")
    seconds, ptx, cubin = 0.0, 0, 0
    for kernel in KERNELS.values():  # both passes: the rank sums' grid and the plan's one program
        names = kernel.arg_names
        signature = {n: "constexpr" if n in meta else POINTERS.get(n, "*fp64") if n.endswith("_ptr") else "i32"
                     for n in names}
        source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in meta.items()})
        start = time.perf_counter()
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
        seconds += time.perf_counter() - start
        ptx, cubin = ptx + len(compiled.asm["ptx"]), cubin + len(compiled.asm["cubin"])
    return {"batch": batch, "calibrated": calibrated, "averaged": meta["AVERAGED"],
            **{k: meta[k] for k in ("RB", "BG", "BT")}, "seconds": round(seconds, 2), "ptx_bytes": ptx,
            "cubin_bytes": cubin}


def bench(args) -> dict:
    batches, widths = csv_values("--batches", args.batches, int), csv_values("--topk", args.topk, int)
    if min(batches) < 1 or min(widths) < 1 or args.table_depths < 1 or args.num_nodes < 1:
        raise ValueError(f"--batches {args.batches} / --topk {args.topk} / --table-depths {args.table_depths} / "
                         f"--num-nodes {args.num_nodes}: each at least 1.")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="decide_compile_")  # every variant compiled afresh
    import triton

    rows, seen = [], set()
    for topk in widths:
        for calibrated in (False, True):
            for b in batches:
                row = {"topk": topk, **compile_variant(b, topk, args.table_depths, calibrated, args.arch,
                                                       args.num_nodes)}
                key = (topk, row["RB"], row["BG"], row["BT"], calibrated)
                row["new_variant"] = key not in seen  # a batch of the same row chunk reuses the compiled kernel
                seen.add(key)
                rows.append(row)
                print(f"k={topk}  batch {b:>3}  calibrated {calibrated!s:<5}  RB {row['RB']:>2} BG {row['BG']:>3}  "
                      f"{row['seconds']:6.2f} s  ptx {row['ptx_bytes'] / 1e3:8.0f} KB", flush=True)
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "triton": triton.__version__,
           "arch": f"sm_{args.arch}", "args": {k: v for k, v in vars(args).items() if k not in ("out", "debug")},
           "variants": len(seen), "rows": rows}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(out, indent=1))
    print(f"{len(seen)} variants for batches {args.batches}, k {args.topk}, {args.table_depths} table depths; "
          f"wrote {args.out}")
    return out


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    with user_errors("bench_decide_compile", args.debug):
        return bench(args)


if __name__ == "__main__":
    main()
