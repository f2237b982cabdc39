"""The controller's and the fixed shapes' speedups priced per round, as slots refilled in serving would see them.

``tools/bench_controller.py`` times whole runs: at concurrency c, c requests start together and the run lasts
until the slowest of them ends. Its closing rounds then carry fewer live rows than slots, at the price of a full
batch, and a shape whose acceptance varies more between rows (a deeper plan) pays more of that tail. A serving
engine refills a slot as soon as its request ends, so what it sees is each round's price: the mean tokens a live
row gains a round (the run's ``acceptance``, plain rounds included) over the mean wall time of its rounds, against
plain decoding's one token over a plain round's time:

    priced speedup = acceptance * mean plain round ms / mean round ms      (means weighted by rounds of each kind)

Where the two readings agree (c = 1: one row, no tail) the pricing is the measurement; at c = 8 and 64 the gap
between them is the run's tail (rounds with fewer live rows than slots) and the prefill every run pays. Refilled
slots (the bench's ``--requests-per-slot``) shorten the tail but keep the last requests': with 4 x c requests at
c = 64 chain3's priced x1.29 was measured x1.12 (129 rounds where full rows would need 117; twenty-eighth
session). So the pricing is an upper bound on a run's speedup; the runs' ratios agree better. Every bench row carries it
(``priced``); this script also reprices rows written before it did:

    python tools/price_controller_rounds.py docs/bench/controller_s26/controller_eagle4_h100.json \\
        docs/bench/controller_s26/controller_untrained_h100.json --out docs/bench/controller_priced_s26.json \\
        --plot docs/img/controller_priced_s26.png
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from torchspec.cli import read_json, user_errors  # noqa: E402
from torchspec.io import atomic_write_text  # noqa: E402

# (name in ``priced``, the row's round kinds, its acceptance, its measured speedup)
RUNS = (("best_fixed", "best_fixed_round_kinds", "best_fixed_acceptance", "best_fixed_speedup"),
        ("controller", "round_kinds", "acceptance", "speedup"),
        ("chain_controller", "chain_round_kinds", "chain_controller_acceptance", "chain_controller_speedup"),
        ("also_plans", "also_plans_round_kinds", "also_plans_acceptance", "also_plans_speedup"))


def mean_round_ms(kinds: dict) -> float:
    """The mean wall ms of a run's rounds ({kind: {"rounds": n, "ms": mean}}), weighted by their counts."""
    rounds = sum(k["rounds"] for k in kinds.values())
    if rounds < 1:
        raise ValueError(f"round kinds {kinds} hold no rounds; time at least one round of the run.")
    return sum(k["rounds"] * k["ms"] for k in kinds.values()) / rounds


def priced_speedup(acceptance: float, kinds: dict, plain_kinds: dict) -> float:
    """``acceptance`` tokens a row-round at ``kinds``' mean round time, against one a plain round of ``plain_kinds``."""
    return acceptance * mean_round_ms(plain_kinds) / mean_round_ms(kinds)


def priced_fields(row: dict) -> dict:
    """A bench row's runs priced per round: {run: priced speedup} for every run the row timed, and the
    controller's ratio to the best fixed shape priced so (``controller_vs_best_fixed`` is the measured one)."""
    plain = row["plain_round_kinds"]
    out = {name: priced_speedup(row[acc], row[kinds], plain) for name, kinds, acc, _ in RUNS if kinds in row}
    out["controller_vs_best_fixed"] = out["controller"] / out["best_fixed"]
    return out


def price_files(paths: list[str]) -> list[dict]:
    """Every row of the bench files at ``paths`` -> one entry a row: drafter, concurrency, requests, and each run's
    measured and priced speedups."""
    entries = []
    for path in paths:
        data = read_json(path, "pass a file tools/bench_controller.py wrote.")
        for i, row in enumerate(data.get("rows", [])):
            missing = [k for k in ("drafter", "concurrency", "best_fixed", "plain_round_kinds", "round_kinds",
                                   "acceptance", "speedup", "best_fixed_round_kinds", "best_fixed_acceptance",
                                   "best_fixed_speedup") if k not in row]
            if missing:
                raise ValueError(f"{path}: row {i} lacks {missing}; reprice rows tools/bench_controller.py wrote "
                                 "with round kinds (the twentieth session's bench on).")
            priced = priced_fields(row)
            entries.append({"file": str(path), "drafter": row["drafter"], "concurrency": row["concurrency"],
                            "requests": row.get("requests"), "best_fixed": row["best_fixed"],
                            "plans": row.get("plans"), "also_plans": row.get("also_plans"), "priced": priced,
                            "measured": {name: row[sp] for name, kinds, _, sp in RUNS if kinds in row}})
    if not entries:
        raise ValueError(f"{paths}: no rows to price; pass files tools/bench_controller.py wrote.")
    return entries


def format_entry(e: dict) -> str:
    runs = " ".join(f"{name} x{e['measured'][name]:.3f}/x{e['priced'][name]:.3f}" for name in e["measured"])
    return (f"{e['drafter']:<12} c={e['concurrency']:<3} (measured/priced) {runs}  controller/best fixed "
            f"priced {e['priced']['controller_vs_best_fixed']:.3f}")


LABELS = {"best_fixed": "best fixed", "controller": "controller", "chain_controller": "controller as a chain",
          "also_plans": "controller, other plans"}
COLORS = {"best_fixed": "tab:gray", "controller": "tab:green", "chain_controller": "tab:blue",
          "also_plans": "tab:olive"}


def _label(run: str, entry: dict) -> str:
    """A run's legend label; the controller's runs name their plans where the row recorded them."""
    plans = {"controller": entry.get("plans"), "also_plans": entry.get("also_plans")}.get(run)
    return f"controller, plans: {plans}" if plans else LABELS[run]


def plot(entries: list[dict], out: str, title: str = "") -> None:
    """A panel a drafter (its first file's rows), per concurrency each run's measured speedup (light) beside its
    priced one (dark)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters: dict[str, list[dict]] = {}
    for e in entries:
        rows = drafters.setdefault(e["drafter"], [])
        if all(r["file"] == e["file"] for r in rows) and e["concurrency"] not in [r["concurrency"] for r in rows]:
            rows.append(e)
    fig, axes = plt.subplots(1, len(drafters), figsize=(6.5 * len(drafters), 4.8), squeeze=False)
    for ax, (name, rows) in zip(axes[0], drafters.items()):
        rows.sort(key=lambda r: r["concurrency"])
        runs = [run for run in LABELS if all(run in r["measured"] for r in rows)]
        width = 0.8 / (2 * len(runs))
        for i, run in enumerate(runs):
            for j, (kind, alpha) in enumerate((("measured", 0.35), ("priced", 1.0))):
                xs = [c + (2 * i + j - (2 * len(runs) - 1) / 2) * width for c in range(len(rows))]
                values = [r[kind][run] for r in rows]
                ax.bar(xs, values, width, color=COLORS[run], alpha=alpha, label=f"{_label(run, rows[0])}, {kind}")
                for x, v in zip(xs, values):
                    ax.text(x, v + 0.01, f"{v:.2f}", ha="center", va="bottom", fontsize=5.5, rotation=90)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(rows)), [f"c={r['concurrency']}\nbest: {r['best_fixed']}" for r in rows])
        ax.set_ylim(0, max(r[k][run] for r in rows for k in ("measured", "priced") for run in runs) * 1.3)
        ax.set_ylabel("speedup over plain decoding")
        refilled = all((r["requests"] or 0) >= 2 * r["concurrency"] for r in rows if r["concurrency"] > 1)
        measured = "measured (slots refilled)" if refilled else "measured (closed batch)"
        ax.set_title(f"{name}: {measured} and priced a round", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=4)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="JSON files tools/bench_controller.py wrote")
    p.add_argument("--out", default=None, help="write the entries here (JSON)")
    p.add_argument("--plot", default=None, help="draw measured against priced speedups here (PNG)")
    p.add_argument("--title", default="", help="the plot's title")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    args = p.parse_args(argv)
    with user_errors("price_controller_rounds", args.debug):
        entries = price_files(args.files)
        for e in entries:
            print(format_entry(e))
        if args.out:
            pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(args.out, json.dumps({"method": " ".join(__doc__.split("\n\n")[:3]).replace("\n", " "),
                                                     "rows": entries}, indent=1))
        if args.plot:
            plot(entries, args.plot, args.title)
        return entries


if __name__ == "__main__":
    main()
