"""``torchspec-profile``: measure the cost table of a serving setup (what the draft controller weighs).

    torchspec-profile --target smollm2 --drafter runs/x/export --out costs.json --plot costs.png
    torchrun --nproc-per-node 2 -m recipes.profile_costs --target Qwen/Qwen3-8B --drafter runs/y/export --tp 2 \\
        --out costs_tp2.json --batches 1,8,64 --contexts 512,2048,8192

Loads the target and the exported drafter as ``torchspec-generate`` does, then times on this device,
for every context bucket (``--contexts``, committed tokens a row) and padded batch size
(``--batches``): one draft depth at each frontier width (``--widths``) and the target's verify
forward at each verified-node count (``--nodes``, 0 = a plain decode step), each the median of
``--repeats`` timed runs (``torchspec/runtime/cost_profile.py``): ``--timing graph`` (the default) replays
CUDA graphs, as the controller's "ahead" mode serves; ``--timing eager`` launches them op by op, as the
host-chained "within" mode does. Writes the versioned
table (``torchspec/runtime/cost_table.py``) atomically to ``--out``, keyed by (device, TP, target
fingerprint, drafter, dtype), and with ``--plot`` a PNG of it. On CPU the times are wall-clock and
mean nothing. Every option and path is checked before a model loads; user errors print one line
and exit 2, and leave ``--out`` untouched (``--debug``: the traceback).

(Not ``recipes/profile.py``: ``python recipes/train.py`` puts ``recipes/`` first on ``sys.path``, where a
``profile`` module shadows the standard library's, which ``cProfile`` imports.)
"""

from __future__ import annotations

import os

from torchspec.cli import ArgumentParser, check_at_least, user_errors
from torchspec.runtime.cli import check_drafter_export, check_output_file

DEFAULTS = {"batches": "1,8,64", "widths": "1,2,4,8", "nodes": "0,1,2,4,8,16,32,48,64", "contexts": "512,2048,8192"}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="torchspec-profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HF checkpoint dir, .gguf file, or alias (smollm2)")
    p.add_argument("--drafter", required=True, help="torchspec drafter export dir")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (launch with torchrun for N > 1)")
    p.add_argument("--out", required=True, help="the cost table (JSON), replaced atomically")
    p.add_argument("--batches", default=DEFAULTS["batches"], help="padded batch sizes, comma-separated")
    p.add_argument("--widths", default=DEFAULTS["widths"], help="frontier nodes a row of one draft depth")
    p.add_argument("--nodes", default=DEFAULTS["nodes"], help="verified drafted nodes a row; must hold 0 (plain step)")
    p.add_argument("--contexts", default=DEFAULTS["contexts"], help="context buckets: committed tokens a row")
    p.add_argument("--repeats", type=int, default=20, metavar="R", help="timed runs a measurement (median)")
    p.add_argument("--timing", default="graph", choices=["graph", "eager"],
                   help="graph: CUDA graph replays, as the ahead mode serves (default); eager: op by op, as within mode")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="serving dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (as the engine serves)")
    p.add_argument("--cache-dir", default="~/.cache/torchspec", help="where a .gguf target is converted once")
    p.add_argument("--chain-from-batch", type=int, default=None, metavar="N",
                   help="record the controller's chain rule in the table: greedy rounds of N rows or more draft a "
                        "chain (measure N with tools/bench_controller.py; default: the tree at every batch)")
    p.add_argument("--plot", default=None, metavar="PNG", help="also plot the measured costs to this PNG")
    return p


def int_list(flag: str, text: str, low: int) -> list[int]:
    """A comma-separated list of distinct ints >= ``low``, ascending; anything else names ``flag``."""
    from recipes.bench import csv_values

    values = csv_values(flag, text, int)
    if min(values) < low:
        raise ValueError(f"{flag}={text!r}: every value must be >= {low}.")
    if len(set(values)) != len(values):
        raise ValueError(f"{flag}={text!r} repeats a value; list each once.")
    return sorted(values)


def check_args(args) -> dict:
    """Every option and path, before a model loads: a typo must not cost a target load."""
    from torchspec.targets import BUILTIN_TARGETS

    grid = {"batches": int_list("--batches", args.batches, 1), "widths": int_list("--widths", args.widths, 1),
            "nodes": int_list("--nodes", args.nodes, 0), "contexts": int_list("--contexts", args.contexts, 1)}
    if grid["nodes"][0] != 0:
        raise ValueError(f"--nodes={args.nodes!r} must hold 0 (the plain step the controller compares with).")
    check_at_least("--repeats", args.repeats, 1)
    check_at_least("--tp", args.tp, 1)
    check_at_least("--page-size", args.page_size, 1)
    if args.chain_from_batch is not None:
        check_at_least("--chain-from-batch", args.chain_from_batch, 1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp != world:
        raise ValueError(f"--tp {args.tp} but {world} process(es) run; launch with torchrun --nproc-per-node "
                         f"{args.tp} -m recipes.profile_costs ... (or pass --tp {world}).")
    if args.target not in BUILTIN_TARGETS and not os.path.exists(args.target):
        raise ValueError(f"--target {args.target} does not exist; pass an HF checkpoint dir, a .gguf file or an "
                         f"alias ({', '.join(sorted(BUILTIN_TARGETS))}).")
    check_drafter_export(args.drafter)
    check_output_file("--out", args.out)
    if args.plot is not None:
        check_output_file("--plot", args.plot)
    return grid


def build_engine(args, grid: dict):
    """The target (tensor-parallel under torchrun) and the drafter, sized for the largest measurement."""
    from torchspec.runtime.cost_profile import profile_rows_needed
    from torchspec.runtime.loading import load_engine
    from torchspec.runtime.tp import init_tp_from_env

    tp_group, device = init_tp_from_env()
    return load_engine(args.target, args.drafter, device=device, dtype=args.dtype or "auto", tp_group=tp_group,
                       max_batch=max(grid["batches"]), page_size=args.page_size, cache_dir=args.cache_dir,
                       max_context=profile_rows_needed(grid["contexts"], grid["widths"], grid["nodes"]),
                       prefix_cache=False)


def run(args):
    from torchspec.runtime.cost_profile import profile_costs
    from torchspec.runtime.tp import is_rank0

    grid = check_args(args)
    engine = build_engine(args, grid)
    table = profile_costs(engine, **grid, repeats=args.repeats, timing=args.timing, log=print if is_rank0() else None)
    table.meta["args"] = {k: v for k, v in vars(args).items() if k != "debug"}
    table.chain_from_batch = args.chain_from_batch
    return table


def main(argv: list[str] | None = None) -> None:
    from torchspec.runtime.tp import is_rank0

    args = build_parser().parse_args(argv)
    with user_errors("torchspec-profile", args.debug):
        table = run(args)
        if is_rank0():
            from torchspec.runtime.cost_table import plot_costs

            table.save(args.out)
            print(f"wrote {args.out} ({table.key.describe()})")
            if args.plot is not None:
                plot_costs(table, args.plot)
                print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
