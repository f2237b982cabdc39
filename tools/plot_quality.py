"""Issue 15's plots for docs/results.md, from ``docs/bench/quality_smollm2.json`` (``tools/bench_quality.py`` rows)
and the trainer metrics of each served drafter:

- ``quality_acceptance_vs_tokens.png``: held-out acceptance against training tokens per drafter (the trainer's
  held-out set, lines; the served greedy chain at the exported step, markers);
- ``quality_speedup_vs_concurrency.png``: served speedup against concurrency for each drafter, prompt set and
  mode at the served depth-5 shapes (chain, the 5 x 8 x 32 tree, the sampled tree); a row timed more than once
  (``timing_run``) is drawn at the mean of its timings with their range as an error bar;
- ``response_repetition.png``: the share of SmolLM2's greedy reply tokens a 3-gram lookup predicts, by position.

    python tools/plot_quality.py          # (tools/plot_results.py draws these too)
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COLORS = {"eagle3": "tab:blue", "eagle4": "tab:orange", "eagle4_27m": "tab:red", "eagle4_21m": "tab:green",
          "eagle4_24m": "tab:purple", "eagle4_26m_r256": "tab:brown", "eagle4_21m_s11": "tab:olive",
          "eagle4_33m_s12": "tab:cyan"}
SERVED_SHAPES = {"chain": None, "tree": (5, 8, 32), "sampled_tree": None}  # the speedup plot's shape per mode


def metrics_files(bench: Path) -> dict[str, Path]:
    """Each served drafter's trainer metrics (the JSON's drafter name -> its metrics.jsonl)."""
    files = {name: bench / f"quality_smollm2_{name}_metrics.jsonl" for name in ("eagle3", "eagle4", "eagle4_27m")}
    files["eagle4_21m"] = bench / "ablation_smollm2_s6" / "ablation_smollm2_eagle4_metrics.jsonl"  # sixth session
    files["eagle4_24m"] = bench / "quality_smollm2_s8" / "eagle4_24m_metrics.jsonl"  # eighth session
    # tenth session: every conversation of the subset, replies of at most 256 tokens
    files["eagle4_26m_r256"] = bench / "quality_smollm2_s10" / "eagle4_26m_r256_metrics.jsonl"
    # eleventh session: the same data regenerated again, trained beside EAGLE-3, the tree's selection fused
    files["eagle4_21m_s11"] = bench / "quality_smollm2_s11" / "ablation_smollm2_eagle4_metrics.jsonl"
    # twelfth session: up to 8 messages of every conversation (1.6x the replies), 32.75M tokens
    files["eagle4_33m_s12"] = bench / "quality_smollm2_s12" / "eagle4_33m_metrics.jsonl"
    return files


def speedup_points(rows: list[dict], drafter: str, mode: str, prompt_set: str) -> list[tuple[int, float, float, float]]:
    """(concurrency, mean speedup, lowest, highest) of one drafter's rows in ``mode`` at its plotted shape,
    over the timings of each concurrency."""
    shape = SERVED_SHAPES[mode]
    by_c: dict[int, list[float]] = {}
    for r in rows:
        if (r["drafter"], r["mode"], r["prompt_set"]) != (drafter, mode, prompt_set):
            continue
        if shape is not None and (r["depth"], r.get("tree_topk", 8), r.get("tree_nodes", 32)) != shape:
            continue
        by_c.setdefault(r["concurrency"], []).append(r["speedup"])
    return [(c, sum(v) / len(v), min(v), max(v)) for c, v in sorted(by_c.items())]


def plot_quality(metrics: dict[str, Path], quality: Path, out_acceptance: Path, out_speedup: Path) -> None:
    """The held-out acceptance and served speedup figures (module docstring)."""
    data = json.loads(quality.read_text())
    fig, ax = plt.subplots(figsize=(10.5, 4.4))
    for name, src in metrics.items():
        rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
        tokens = {r["step"]: r["train/tokens"] for r in rows if "train/tokens" in r}
        tokens[0] = 0
        # runs with the MT-Bench held-out set (data.eval_path) log the served-comparable chain walk
        key, held_out = (("eval/chain_acceptance", "MT-Bench chain walk") if any("eval/chain_acceptance" in r for r in rows)
                         else ("eval/acceptance_length", "ShareGPT split"))
        evals = [(tokens[r["step"]] / 1e6, r[key]) for r in rows if key in r and r["step"] in tokens]
        ax.plot(*zip(*evals), "-o", ms=3, color=COLORS[name], label=f"{name}: trainer held-out, {held_out} (K=7)")
    marks = {"mtbench": "s", "humaneval": "^"}
    for r in data["rows"]:
        if r["mode"] == "chain" and r["concurrency"] == 1:
            ax.plot(r["train_tokens"] / 1e6, r["served_acceptance"], marks[r["prompt_set"]], ms=8,
                    color=COLORS[r["drafter"]], mfc="none", label=f"{r['drafter']}: served chain K=5, {r['prompt_set']}")
    ax.set_xlabel("training tokens (millions, real)")
    ax.set_ylabel("acceptance (tokens per round)")
    ax.set_title("SmolLM2-135M drafters on regenerated ShareGPT (H200, bf16)", fontsize=10)
    handles = {line.get_label(): line for line in ax.get_lines()}  # a drafter timed twice: its label once
    ax.legend(list(handles.values()), list(handles), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out_acceptance, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.2), sharey=True)
    styles = {"tree": "-o", "chain": "--s", "sampled_tree": ":^"}
    for ax, prompt_set in zip(axes, ("mtbench", "humaneval")):
        for name in COLORS:
            for mode, style in styles.items():
                pts = speedup_points(data["rows"], name, mode, prompt_set)
                if not pts:
                    continue
                c, mean, low, high = zip(*pts)
                ax.errorbar(c, mean, yerr=[[m - lo for m, lo in zip(mean, low)], [h - m for m, h in zip(mean, high)]],
                            fmt=style, color=COLORS[name], capsize=3, label=f"{name} {mode}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(f"{prompt_set}: served speedup vs plain decoding", fontsize=9)
    axes[0].set_ylabel("speedup (x)")
    fig.suptitle("H200, bf16, 256 new tokens; error bars: the range of a row's repeated timings", fontsize=9)
    handles = {}  # both panels' lines, once each (a mode measured on one prompt set only is still listed)
    for ax in axes:
        for container in ax.containers:
            handles.setdefault(container.get_label(), container)
    labels = [k for k in handles if not k.startswith("_")]
    axes[1].legend([handles[k] for k in labels], labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out_speedup, dpi=110)
    plt.close(fig)


def plot_repetition(sources: dict[str, Path], out: Path) -> None:
    """Share of SmolLM2's greedy reply tokens a 3-gram lookup predicts, by position in the reply
    (tools/response_repetition.py): why long held-out replies read as easy."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, src in sources.items():
        rows = json.loads(src.read_text())["rows"]
        ax.plot([(r["start"] + r["end"]) / 2 for r in rows], [r["predicted"] for r in rows], "-o", label=name)
    ax.set_xlabel("position in the reply (tokens)")
    ax.set_ylabel("predicted by a 3-gram lookup")
    ax.set_ylim(0, 1)
    ax.set_title("SmolLM2-135M greedy replies loop as they grow (H200, bf16)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_quality_results(bench: Path, img: Path) -> None:
    """Every figure of the module docstring whose inputs exist under ``bench``, into ``img``."""
    metrics = metrics_files(bench)
    if (bench / "quality_smollm2.json").exists() and all(p.exists() for p in metrics.values()):
        plot_quality(metrics, bench / "quality_smollm2.json", img / "quality_acceptance_vs_tokens.png",
                     img / "quality_speedup_vs_concurrency.png")
    repetition = {name: bench / f"response_repetition_{name.lower().replace('-', '')}_h200.json"
                  for name in ("MT-Bench", "HumanEval")}
    if all(p.exists() for p in repetition.values()):
        plot_repetition(repetition, img / "response_repetition.png")


if __name__ == "__main__":
    plot_quality_results(ROOT / "docs" / "bench", ROOT / "docs" / "img")
