"""Plot issue 15's equal-token ablations and the warm start from the runs' ``metrics.jsonl`` files.

Inputs: ``docs/bench/ablation_smollm2_<run>_metrics.jsonl`` (the trainer's metrics of each run of one
``tools/device_quality.sh`` session; ``RUNS`` names them) -- held-out ``eval/chain_acceptance_d{d}``
(greedy chain rounds of depth d walked over MT-Bench answered by the target, the served-comparable
number) against ``train/tokens``, and for the MoE run ``train/moe_load_imbalance`` (max expert load /
mean load, 1.0 = balanced). The warm run's tokens are counted from its own start; the EAGLE-3 run it
was converted from is drawn at the tokens it had then.

    python tools/plot_ablation.py --depth 5 --warm-from eagle3   # -> docs/img/ablation_smollm2.png
    python tools/plot_ablation.py --bench docs/bench/quality_smollm2_s11 --out docs/img/warm_start_s11.png \
        --json docs/bench/warm_start_smollm2_s11_h200.json          # + the table below, as JSON

``--json`` also prints and writes the numbers the plot shows: each run's last evaluation, every run against
``--warm-from`` at the evaluations both have (equal tokens), and the warm start's tokens to reach
``--warm-from``'s last acceptance (first evaluation at or above it) as a share of that run's tokens, with the
warm run's acceptance at 10% of them (issue 15's bound; interpolated between its evaluations).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from torchspec.io import atomic_write_text  # noqa: E402

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


def interpolate(curve: list[tuple[float, float]], tokens: float) -> float | None:
    """Acceptance at ``tokens``, linear between evaluations (None outside the evaluated range)."""
    for (t0, a0), (t1, a1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return a0 if t1 == t0 else a0 + (a1 - a0) * (tokens - t0) / (t1 - t0)
    return None


def summary(runs: dict[str, list[dict]], depth: int, warm: str, warm_from: str) -> dict:
    """The numbers behind the plot (module docstring, ``--json``)."""
    curves = {name: held_out_curve(rows, depth) for name, rows in runs.items()}
    curves = {name: c for name, c in curves.items() if c}
    out: dict = {"depth": depth, "metric": f"eval/chain_acceptance_d{depth}",
                 "last": {name: {"tokens": c[-1][0], "acceptance": c[-1][1]} for name, c in curves.items()}}
    base = dict(curves.get(warm_from, []))
    out["equal_tokens"] = [{"run": name, "tokens": t, "acceptance": a, warm_from: base[t], "ratio": a / base[t]}
                           for name, c in curves.items() if name not in (warm, warm_from)
                           for t, a in c if t in base and t > 0]
    if warm in curves and warm_from in curves:
        level, source_tokens = curves[warm_from][-1][1], curves[warm_from][-1][0]
        reach = tokens_to_reach(curves[warm], level)
        out["warm_start"] = {"source": warm_from, "source_tokens": source_tokens, "source_acceptance": level,
                             "converted_acceptance": curves[warm][0][1], "tokens_to_reach": reach,
                             "share_of_source_tokens": None if reach is None else reach / source_tokens,
                             "acceptance_at_10pct": interpolate(curves[warm], 0.1 * source_tokens),
                             "warm_last": {"tokens": curves[warm][-1][0], "acceptance": curves[warm][-1][1]}}
    return out


def print_summary(s: dict, warm_from: str) -> None:
    print(f"{'run':<10} {'tokens':>8} {s['metric']}")
    for name, last in s["last"].items():
        print(f"{name:<10} {last['tokens'] / 1e6:7.2f}M {last['acceptance']:.3f}")
    for row in s["equal_tokens"]:
        print(f"{row['run']:<10} {row['tokens'] / 1e6:7.2f}M {row['acceptance']:.3f} vs {warm_from} "
              f"{row[warm_from]:.3f}: x{row['ratio']:.3f}")
    w = s.get("warm_start")
    if w:
        at10 = "n/a" if w["acceptance_at_10pct"] is None else f"{w['acceptance_at_10pct']:.3f}"
        reach = ("never" if w["tokens_to_reach"] is None else
                 f"{w['tokens_to_reach'] / 1e6:.2f}M tokens ({w['share_of_source_tokens']:.1%} of {warm_from}'s)")
        print(f"warm start: converted {w['converted_acceptance']:.3f}; at 10% of {warm_from}'s "
              f"{w['source_tokens'] / 1e6:.2f}M tokens {at10} against {w['source_acceptance']:.3f}; reaches it: {reach}")


def plot(runs: dict[str, list[dict]], depth: int, warm: str, warm_from: str, out: Path) -> None:
    moe = any("train/moe_load_imbalance" in r for rows in runs.values() for r in rows)
    fig, axes = plt.subplots(1, 3 if moe else 2, figsize=(15 if moe else 10.5, 4.2))
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
        ax.axvline(0.1 * base[-1][0] / 1e6, color="k", lw=0.8, ls=":", label=f"10% of {warm_from}'s tokens")
        reach = tokens_to_reach(warm_curve, level)
        note = (f"reaches {level:.2f} after {reach / 1e6:.2f}M tokens = {reach / base[-1][0]:.1%} of {warm_from}'s"
                if reach is not None else f"does not reach {level:.2f}")
        ax.set_title(f"warm start: {note}", fontsize=9)
        ax.set_xscale("symlog", linthresh=0.5)
        ax.set_xlim(left=0)
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, f"no warm start here: runs '{warm}' and '{warm_from}' are both needed",
                ha="center", va="center", fontsize=9, transform=ax.transAxes)
        ax.set_xticks([]), ax.set_yticks([])
    ax.set_xlabel("training tokens (millions; warm: since the conversion)")

    if not moe:
        _save(fig, out)
        return
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
    _save(fig, out)


def _save(fig, out: Path) -> None:
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
    p.add_argument("--json", type=Path, default=None, help="also print the summary table and write it here")
    args = p.parse_args(argv)
    runs = read_runs(args.bench)
    if not runs:
        raise SystemExit(f"{args.bench}: no {PREFIX}<run>_metrics.jsonl files; copy a device_quality.sh session's "
                         f"res/<run>_metrics.jsonl there first")
    plot(runs, args.depth, args.warm, args.warm_from, args.out)
    print("wrote", args.out)
    if args.json:
        s = summary(runs, args.depth, args.warm, args.warm_from)
        print_summary(s, args.warm_from)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(str(args.json), json.dumps(s, indent=1) + "\n")
        print("wrote", args.json)


if __name__ == "__main__":
    main()
