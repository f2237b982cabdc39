"""Plot issue 15's equal-token ablations and the warm start from the runs' ``metrics.jsonl`` files.

Inputs: ``docs/bench/ablation_smollm2_<run>_metrics.jsonl`` (the trainer's metrics of each run of one
``tools/device_quality.sh`` session; ``RUNS`` names them) -- held-out ``eval/chain_acceptance_d{d}``
(greedy chain rounds of depth d walked over MT-Bench answered by the target, the served-comparable
number) against ``train/tokens``, and for the MoE run ``train/moe_load_imbalance`` (max expert load /
mean load, 1.0 = balanced). The warm run's tokens are counted from its own start; the EAGLE-3 run it
was converted from is drawn at the tokens it had then.

    python tools/plot_ablation.py --depth 5 --warm-from eagle3   # -> docs/img/ablation_smollm2.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
PREFIX = "ablation_smollm2_"


def read_runs(bench: Path = BENCH) -> dict[str, list[dict]]:
    """{run name: its metric rows} for every ``ablation_smollm2_<run>_metrics.jsonl`` in ``bench``."""
    runs = {}
    for path in sorted(bench.glob(f"{PREFIX}*_metrics.jsonl")):
        runs[path.name[len(PREFIX):-len("_metrics.jsonl")]] = [
            json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return runs


def held_out_curve(rows: list[dict], depth: int) -> list[tuple[float, float]]:
    """(training tokens, held-out chain acceptance at ``depth``) at every evaluation, step 0 = 0 tokens."""
    tokens = {r["step"]: r["train/tokens"] for r in rows if "train/tokens" in r}
    tokens[0] = 0.0
    key = f"eval/chain_acceptance_d{depth}"
    return [(tokens[r["step"]], r[key]) for r in rows if key in r and r["step"] in tokens]


def tokens_to_reach(curve: list[tuple[float, float]], level: float) -> float | None:
    """The first evaluated token count whose acceptance is >= ``level`` (None if never)."""
    return next((t for t, a in curve if a >= level), None)


def plot(runs: dict[str, list[dict]], depth: int, warm: str, warm_from: str, out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for name, rows in runs.items():
        if name != warm:
            curve = held_out_curve(rows, depth)
            if curve:
                ax.plot([t / 1e6 for t, _ in curve], [a for _, a in curve], "-o", ms=3, label=name)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel(f"held-out chain acceptance, depth {depth}")
    ax.set_title("equal-token ablations (MT-Bench answered by SmolLM2)", fontsize=9)
    ax.legend(fontsize=7)

    ax = axes[1]
    if warm in runs and warm_from in runs:
        base = held_out_curve(runs[warm_from], depth)
        warm_curve = held_out_curve(runs[warm], depth)
        level = base[-1][1]
        ax.plot([t / 1e6 for t, _ in warm_curve], [a for _, a in warm_curve], "-o", ms=3, color="tab:red",
                label=f"{warm}: EAGLE-4 from converted {warm_from}")
        ax.plot([t / 1e6 for t, _ in base], [a for _, a in base], "-", color="tab:blue", label=f"{warm_from} (from scratch)")
        if "eagle4" in runs:
            cold = held_out_curve(runs["eagle4"], depth)
            ax.plot([t / 1e6 for t, _ in cold], [a for _, a in cold], "--", color="tab:orange", label="eagle4 (from scratch)")
        ax.axhline(level, color="tab:blue", lw=0.8, ls=":")
        reach = tokens_to_reach(warm_curve, level)
        note = (f"reaches {level:.2f} after {reach / 1e6:.2f}M tokens = {reach / base[-1][0]:.1%} of {warm_from}'s"
                if reach is not None else f"does not reach {level:.2f}")
        ax.set_title(f"warm start: {note}", fontsize=9)
        ax.set_xscale("symlog", linthresh=0.5)
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, f"no warm start here: runs '{warm}' and '{warm_from}' are both needed",
                ha="center", va="center", fontsize=9, transform=ax.transAxes)
        ax.set_xticks([]), ax.set_yticks([])
    ax.set_xlabel("training tokens (millions; warm: since the conversion)")

    ax = axes[2]
    for name, rows in runs.items():
        pts = [(r["train/tokens"] / 1e6, r["train/moe_load_imbalance"]) for r in rows
               if "train/moe_load_imbalance" in r and "train/tokens" in r]
        if pts:
            ax.plot(*zip(*pts), "-", label=f"{name}: all TTT steps")
            per_step = sorted(k for k in rows[-1] if k.startswith("train/moe_load_imbalance_"))
            for key in per_step[:: max(1, len(per_step) // 3)]:
                ax.plot(*zip(*[(r["train/tokens"] / 1e6, r[key]) for r in rows if key in r and "train/tokens" in r]),
                        ":", lw=0.8, label=f"{name}: step {key.rsplit('_', 1)[1]}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("expert load imbalance (max / mean)")
    ax.set_title("MoE expert balance", fontsize=9)
    if ax.lines[1:]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", type=Path, default=BENCH)
    p.add_argument("--depth", type=int, default=5, help="the served depth whose held-out chain walk is drawn")
    p.add_argument("--warm", default="warm", help="the warm-started run's name")
    p.add_argument("--warm-from", default="eagle3", help="the run it was converted from")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "ablation_smollm2.png")
    args = p.parse_args(argv)
    runs = read_runs(args.bench)
    if not runs:
        raise SystemExit(f"{args.bench}: no {PREFIX}<run>_metrics.jsonl files; copy a device_quality.sh session's "
                         f"res/<run>_metrics.jsonl there first")
    plot(runs, args.depth, args.warm, args.warm_from, args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
