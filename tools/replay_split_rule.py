"""Replay the attention planner's split counts against a measured split sweep (no GPU needed).

``tools/bench_attention_paged.py --splits 1 2 3 4 6 8 12 16 ...`` times every explicit split count of every
case. This asks ``torchspec.runtime.attention_plan.plan`` what it would choose for each case, on the GPU the
sweep ran on, and looks up that count's measured time, rounded to the nearest count swept. Against the best
swept count, it reports the geometric mean and the worst ratio, per file and over all of them:

    python tools/replay_split_rule.py docs/bench/attention_split_sweep_*_s7_h200.json \\
        --json docs/bench/split_rule_replay_h200.json

``--table engine`` (default) plans with the width the engine passes (``paged_kv.table_columns`` of the
longest row + the forward's tokens); ``--table full`` with the sweep's whole ``max_context`` table (the width
before buckets).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchspec.io import atomic_write_text  # noqa: E402
from torchspec.runtime.attention_plan import plan  # noqa: E402
from torchspec.runtime.paged_kv import table_columns  # noqa: E402

GPUS = {"NVIDIA H200": (132, 50 << 20), "NVIDIA H100 80GB HBM3": (132, 50 << 20)}  # SMs, L2 bytes


def replay_file(path: Path, table: str) -> list[dict]:
    data = json.loads(path.read_text())
    setup = data["setup"]
    sms, l2 = GPUS[setup["gpu"]]
    cases: dict = defaultdict(dict)
    for r in data["rows"]:
        cases[(r["mode"], r["tq"], r["batch"], r["ctx"], r["lengths"])][r["impl"]] = r["ms"]
    out = []
    for (mode, tq, batch, ctx, lengths), times in sorted(cases.items()):
        swept = {int(k.removeprefix("kernel_s")): ms for k, ms in times.items() if k.startswith("kernel_s")}
        if not swept:
            continue
        page = setup["page_size"]
        width = setup["max_context"] // page
        # ctx is the longest committed row in every --lengths kind (bench_attention_paged.row_lengths)
        cols = table_columns(ctx + tq, page, width) if table == "engine" else width
        cfg = plan(batch, setup["kv_heads"], tq, setup["heads"] // setup["kv_heads"], setup["head_dim"], cols * page,
                   getattr(torch, setup["dtype"]), torch.device("cpu"), sms=sms, l2_bytes=l2)
        chosen = min(swept, key=lambda n: abs(math.log(n) - math.log(cfg["num_splits"])))
        best = min(swept, key=swept.get)
        out.append(dict(file=path.name, mode=mode, batch=batch, ctx=ctx, lengths=lengths, planned=cfg["num_splits"],
                        chosen=chosen, best=best, ratio=swept[chosen] / swept[best],
                        ratio_at_sweep=times["kernel"] / swept[best] if "kernel" in times else None))
    return out


def summary(rows: list[dict], key: str = "ratio") -> tuple[float, float]:
    """(geometric mean, worst) of ``key`` over the rows that have it."""
    values = [r[key] for r in rows if r[key] is not None]
    return (math.exp(statistics.mean(math.log(v) for v in values)), max(values)) if values else (math.nan, math.nan)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweeps", nargs="+", type=Path)
    p.add_argument("--table", choices=("engine", "full"), default="engine")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = [row for path in args.sweeps for row in replay_file(path, args.table)]
    if not rows:
        raise SystemExit(f"{args.sweeps[0]}: no kernel_s<N> rows: sweep with --splits first")
    print("| sweep | cases | planned / best: geomean | worst | worst case | the sweep's own planner: geomean | worst |\n"
          "|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(r["file"] for r in rows):
        part = [r for r in rows if r["file"] == name]
        gm, worst = summary(part)
        w = max(part, key=lambda r: r["ratio"])
        then = summary(part, "ratio_at_sweep")
        print(f"| {name} | {len(part)} | {gm:.3f} | {worst:.2f} | {w['mode']} b={w['batch']} ctx={w['ctx']}: "
              f"{w['planned']} splits, best {w['best']} | {then[0]:.3f} | {then[1]:.2f} |")
    gm, worst = summary(rows)
    then = summary(rows, "ratio_at_sweep")
    print(f"| all | {len(rows)} | {gm:.3f} | {worst:.2f} | | {then[0]:.3f} | {then[1]:.2f} |")
    if args.json:
        atomic_write_text(args.json, json.dumps({"table": args.table, "geomean": gm, "worst": worst,
                                                 "geomean_at_sweep": then[0], "worst_at_sweep": then[1], "rows": rows},
                                                indent=1))


if __name__ == "__main__":
    main()
