"""Plot the draft controller with a trained drafter: measured on the GPU, and replayed in modeled time (CPU).

Reads a JSON like ``docs/bench/controller_trained_smollm2_s24.json`` (``measured``: the GPU's paired speedups
of plain, the fixed shapes and the controller; ``modeled``: ``tools/replay_controller.py`` and
``tools/replay_smoothed_plans.py`` rows, each with its ``speedup`` and ``acceptance``) and draws both side by
side, acceptance printed on each bar.

    python tools/plot_controller_trained.py docs/bench/controller_trained_smollm2_s24.json \\
        docs/img/controller_trained_s24.png
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_controller_trained(src: Path, out: Path) -> None:
    data = json.loads(src.read_text())
    panels = [(data["measured"], "measured"), (data["modeled"], "modeled")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, (part, kind) in zip(axes, panels):
        rows = part["rows"]
        labels = [r["label"] for r in rows]
        speedups = [r["speedup"] for r in rows]
        colors = ["tab:green" if r["label"].startswith("controller") else "tab:gray" for r in rows]
        bars = ax.bar(range(len(rows)), speedups, color=colors)
        for bar, r in zip(bars, rows):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01, f"x{r['speedup']:.2f}\nacc {r['acceptance']:.2f}",
                    ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylim(0, max(speedups) * 1.25)
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title(textwrap.fill(f"{kind}: {part['device']}", 70), fontsize=8)
    fig.suptitle(data["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_controller_trained.py <controller_trained JSON> <out.png>")
    plot_controller_trained(Path(sys.argv[1]), Path(sys.argv[2]))
