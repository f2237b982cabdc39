"""Plot how the draft controller's ways of planning compare, per drafter and concurrency, from bench JSONs.

Reads ``tools/bench_controller.py --also-plans P`` outputs (each row: ``drafter``, ``concurrency``, ``speedup``
of the controller planning as the default does, ``also_plans_speedup`` of ``also_plans``, ``best_fixed`` and its
``best_fixed_speedup``) and draws one group of bars per (drafter, concurrency): the best fixed shape, the default
plans and the other plans, each over plain decoding, acceptance printed on the bars. A later file's row for the
same (drafter, concurrency) replaces an earlier one's.

    python tools/plot_controller_plans.py docs/img/controller_held_s30.png docs/bench/controller_s30/*.json
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchspec.io import atomic_write_bytes  # noqa: E402


def controller_rows(paths: list[Path]) -> tuple[list[dict], str]:
    """The controller rows of every file, one per (drafter, concurrency), and the device they ran on."""
    rows, device = {}, set()
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e}); give tools/bench_controller.py --out files.") from None
        device.add(data.get("device", "?"))
        for row in data["rows"]:
            if row.get("mode") == "controller" and row.get("also_plans"):
                rows[row["drafter"], row["concurrency"]] = row
    if not rows:
        raise ValueError(f"{[str(p) for p in paths]} hold no controller row with also_plans; run "
                         f"tools/bench_controller.py with --also-plans.")
    order = sorted(rows, key=lambda k: (k[0], k[1]))
    return [rows[k] for k in order], ", ".join(sorted(device))


def plot_controller_plans(out: Path, paths: list[Path]) -> None:
    rows, device = controller_rows(paths)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(rows) + 2), 4.4))
    width = 0.27
    series = [("best fixed", "best_fixed_speedup", "best_fixed_acceptance", "#999999"),
              (f"controller ({rows[0].get('plans', 'average')} plans)", "speedup", "acceptance", "#1f77b4"),
              (f"controller ({rows[0]['also_plans']} plans)", "also_plans_speedup", "also_plans_acceptance",
               "#ff7f0e")]
    for s, (name, key, acc, colour) in enumerate(series):
        xs = [i + (s - 1) * width for i in range(len(rows))]
        ys = [r[key] for r in rows]
        ax.bar(xs, ys, width, label=name, color=colour)
        for x, y, r in zip(xs, ys, rows):
            ax.text(x, y + 0.01, f"{y:.2f}\n{r[acc]:.1f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['drafter'].replace('controlled_', '')}\nc={r['concurrency']}\n({r['best_fixed']})"
                        for r in rows], fontsize=8)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_ylim(0, max(max(r[k] for r in rows) for _, k, _, _ in series) * 1.2)
    ax.set_title(f"draft controller: plans compared ({device}; on the bars: speedup, acceptance)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, png.getvalue())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        raise SystemExit("usage: plot_controller_plans.py OUT.png BENCH.json [BENCH.json ...]")
    try:
        plot_controller_plans(Path(argv[0]), [Path(p) for p in argv[1:]])
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_controller_plans: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
