"""Plot the draft controller with a trained drafter: measured on the GPU, and replayed in modeled time (CPU).

Reads a JSON like ``docs/bench/controller_trained_smollm2_s24.json`` (``measured``: the GPU's paired speedups
of plain, the fixed shapes and the controller; ``modeled``: ``tools/replay_controller.py`` and
``tools/replay_smoothed_plans.py`` rows, each with its ``speedup`` and ``acceptance``) and draws both side by
side, acceptance printed on each bar.

    python tools/plot_controller_trained.py docs/bench/controller_trained_smollm2_s24.json \\
        docs/img/controller_trained_s24.png

``plot_controller_progress`` draws the controller over its sweep's best fixed shape session by session
(``docs/bench/controller_h200.json``, ``tools/plot_results.py``: ``docs/img/controller_progress.png``).
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


def _plans_runs(row: dict) -> list[tuple[str, float, float, dict]]:
    """(label, speedup, acceptance, round kinds) of a ``bench_controller`` row's controller runs: the default
    plans and the ``--also-plans`` ones (``last_plans_*``: the twenty-fifth session's first name for them)."""
    also = "also_plans" if "also_plans_speedup" in row else "last_plans"
    other = row.get("also_plans", "last")
    return [(f"plans: {row.get('plans', 'average')}", row["speedup"], row["acceptance"], row["round_kinds"]),
            (f"plans: {other}", row[f"{also}_speedup"], row[f"{also}_acceptance"], row[f"{also}_round_kinds"])]


def plot_controller_plans(runs: dict[str, Path], out: Path) -> None:
    """One ``tools/bench_controller.py`` JSON per way of deciding ({label: file}, each timed with ``--also-plans``):
    the fixed tree and the controller under both plans (speedup, acceptance), and how many of the median run's
    rounds were plain."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.4))
    labels, speedups, accs, plain, device = [], [], [], [], ""
    for name, path in runs.items():
        data = json.loads(Path(path).read_text())
        row, device = data["rows"][0], data["device"]
        labels.append(f"{name} decisions\nfixed\n{row['best_fixed']}")
        speedups.append(row["best_fixed_speedup"])
        accs.append(row["best_fixed_acceptance"])
        plain.append(None)
        for label, speedup, acc, kinds in _plans_runs(row):
            labels.append(f"{name} decisions\ncontroller\n{label}")
            speedups.append(speedup)
            accs.append(acc)
            plain.append(kinds.get("plain-deferring", {}).get("rounds", 0) / sum(k["rounds"] for k in kinds.values()))
    colors = ["tab:gray" if p is None else "tab:green" for p in plain]
    bars = left.bar(range(len(labels)), speedups, color=colors)
    for bar, s, a in zip(bars, speedups, accs):
        left.text(bar.get_x() + bar.get_width() / 2, s + 0.01, f"x{s:.2f}\nacc {a:.2f}", ha="center", va="bottom",
                  fontsize=8)
    left.axhline(1.0, color="k", lw=0.8, ls="--")
    left.set_xticks(range(len(labels)), labels, fontsize=7)
    left.set_ylim(0, max(speedups) * 1.3)
    left.set_ylabel("speedup over plain decoding (median of 3 pairs)")
    shown = [(lab, p) for lab, p in zip(labels, plain) if p is not None]
    right.bar(range(len(shown)), [100 * p for _, p in shown], color="tab:orange")
    right.set_xticks(range(len(shown)), [lab for lab, _ in shown], fontsize=7)
    right.set_ylabel("plain rounds, % of the median run's rounds")
    right.set_title("a plain streak, once begun, rarely ends (its probes draft depth 0 alone)", fontsize=8)
    fig.suptitle(textwrap.fill(f"The controller's plans with a trained SmolLM2 drafter, MT-Bench c=1 ({device})", 90),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_controller_concurrency(drafters: dict[str, Path], out: Path) -> None:
    """One ``tools/bench_controller.py`` JSON per drafter ({label: file}, each timed with ``--also-plans``), a
    panel each: per concurrency the best fixed shape and the controller under both plans (speedup, acceptance)."""
    fig, axes = plt.subplots(1, len(drafters), figsize=(6.5 * len(drafters), 4.4), squeeze=False)
    device = ""
    for ax, (name, path) in zip(axes[0], drafters.items()):
        data = json.loads(Path(path).read_text())
        device = data["device"]
        rows = sorted(data["rows"], key=lambda r: r["concurrency"])
        series = {"best fixed": [(r["best_fixed_speedup"], r["best_fixed_acceptance"], r["best_fixed"]) for r in rows]}
        for row in rows:
            for label, speedup, acc, _ in sorted(_plans_runs(row)):
                series.setdefault(f"controller, {label}", []).append((speedup, acc, ""))
        width = 0.8 / len(series)
        colors = {"best fixed": "tab:gray", "controller, plans: average": "tab:green",
                  "controller, plans: last": "tab:olive"}
        for i, (label, values) in enumerate(series.items()):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))]
            ax.bar(xs, [v[0] for v in values], width, label=label, color=colors.get(label))
            for x, (s, a, shape) in zip(xs, values):
                ax.text(x, s + 0.01, f"x{s:.2f}\nacc {a:.2f}" + (f"\n{shape}" if shape else ""), ha="center",
                        va="bottom", fontsize=6)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(rows)), [f"c={r['concurrency']}" for r in rows])
        ax.set_ylim(0, max(v[0] for vs in series.values() for v in vs) * 1.35)
        ax.set_ylabel("speedup over plain decoding (median of 3 pairs)")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(textwrap.fill(f"The controller against the best fixed shape, SmolLM2 on MT-Bench ({device})", 90),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def progress_points(rows: list[dict]) -> dict[int, list[tuple[int, float, int, bool]]]:
    """The trained drafters' rows of ``controller_h200.json`` (drafter ``eagle4_*``, a ``session`` "sNN"):
    per concurrency, (session, mean controller / best fixed over the session's runs, runs, whether every run's
    sweep held a 2-deep tree: before the thirty-third session none did, and a 2-deep tree is the best fixed shape
    at c = 1 and 8 since) by session."""
    runs: dict[tuple[int, int], list[tuple[float, bool]]] = {}
    for row in rows:
        session = str(row.get("session") or "")
        if row.get("mode") == "controller" and row["drafter"].startswith("eagle4_") and session[1:].isdigit():
            shallow = any(shape.startswith("tree2x") for shape in row.get("sweep") or {})
            runs.setdefault((row["concurrency"], int(session[1:])), []).append((row["controller_vs_best_fixed"],
                                                                                shallow))
    points: dict[int, list[tuple[int, float, int, bool]]] = {}
    for (c, session), found in sorted(runs.items()):
        points.setdefault(c, []).append((session, sum(r for r, _ in found) / len(found), len(found),
                                         all(shallow for _, shallow in found)))
    return points


def plot_controller_progress(src: Path, out: Path) -> None:
    """The controller over the best fixed shape of its session's sweep, session by session, one line per
    concurrency (trained SmolLM2 drafters, ``progress_points``), with the issue's bar (1.0) drawn."""
    data = json.loads(src.read_text())
    points = progress_points(data["rows"])
    if not points:
        raise ValueError(f"{src} has no trained drafter's controller rows with a session; nothing to plot.")
    devices = sorted({r.get("device") or data["device"] for r in data["rows"] if r["drafter"].startswith("eagle4_")})
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    for c, series in points.items():
        line, = ax.plot([s for s, *_ in series], [r for _, r, *_ in series], label=f"c={c}")
        for session, ratio, _, shallow in series:  # hollow: a sweep without 2-deep trees (an easier bar)
            ax.plot(session, ratio, "o", color=line.get_color(), mfc=line.get_color() if shallow else "white")
        session, ratio, *_ = series[-1]
        ax.annotate(f"{ratio:.2f}", (session, ratio), textcoords="offset points", xytext=(6, -3), fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    sessions = sorted({s for series in points.values() for s, *_ in series})
    ax.set_xticks(sessions, [f"s{s}" for s in sessions])
    ax.set_xlabel("session (a session's runs averaged; hollow: its sweep had no 2-deep tree)")
    ax.set_ylabel("controller / best fixed shape")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(textwrap.fill("The draft controller against its sweep's best fixed shape, trained SmolLM2 drafters on "
                               f"MT-Bench ({', '.join(devices)})", 80), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_controller_trained.py <controller_trained JSON> <out.png>")
    plot_controller_trained(Path(sys.argv[1]), Path(sys.argv[2]))
