"""Plot the benchmark JSONs under docs/bench/ into PNGs under docs/img/ (for docs/results.md).

    python tools/plot_results.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from plot_controller_trained import (  # noqa: E402
    plot_controller_plans,
    plot_controller_progress,
    plot_controller_trained,
)
from plot_quality import plot_quality_results  # noqa: E402


def plot_attention(src: Path, out: Path) -> None:
    rows = json.loads(src.read_text())["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, backend in zip(axes, ("chunked", "flex")):
        for window, style in ((None, "o--"), (4096, "o-")):
            pts = sorted((r["T"], r["median_ms"] / r["T"] * 1000) for r in rows
                         if r["backend"] == backend and r["k"] == 3 and r["window"] == window
                         and r["mode"] == "fwd+bwd" and r.get("median_ms") is not None)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"window={window or 'none'}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context T (tokens)")
        ax.set_ylabel("µs per token (fwd+bwd, TTT step k=3)")
        ax.set_title(f"drafter attention, {backend}, H200 bf16")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_lm_head(src: Path, out: Path) -> None:
    rows = [r for r in json.loads(src.read_text())["rows"] if r["variant"] == "graph"]
    heads = ["eagle3_pruned", "eagle4_full", "eagle4_efficient"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for i, mode in enumerate(("chain", "tree")):
        shares = [100 * next(r["head_share"] for r in rows if r["mode"] == mode and r["head"] == h) for h in heads]
        ax.bar([x + i * width for x in range(3)], shares, width, label=f"{mode} ({'1' if mode == 'chain' else '16'} tokens)")
    ax.set_xticks([x + width / 2 for x in range(3)], ["EAGLE-3 32K pruned", "EAGLE-4 full 248K", "EAGLE-4 efficient"])
    ax.set_ylabel("LM head share of a draft step (%)")
    ax.set_title("LM-head cost, H=5120, V=248,320, bf16, H200, CUDA graphs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_runtime(efficiency: list[Path], smollm2: Path, out: Path) -> None:
    """Speedup against mean acceptance length: controlled-acceptance runs and the real SmolLM2 drafter."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    markers = {1: "o", 8: "s", 64: "^"}
    colors = {"qwen3-8b": "tab:blue", "smollm2-135m": "tab:orange"}
    seen = set()
    for src in efficiency:
        for r in json.loads(src.read_text())["rows"]:
            label = f"{r['shape']} (controlled), c={r['concurrency']}"
            ax.scatter(r["mean_acceptance"], r["speedup"], marker=markers.get(r["concurrency"], "o"),
                       color=colors.get(r["shape"], "gray"), facecolors="none" if r["mode"] == "chain" else None,
                       label=None if label in seen else label)
            seen.add(label)
    for r in json.loads(smollm2.read_text())["rows"]:
        if r["mode"] != "plain":
            label = "SmolLM2 + trained drafter (MT-Bench/HumanEval)"
            ax.scatter(r["mean_acceptance"], r["speedup"], marker="x", color="tab:green",
                       label=None if label in seen else label)
            seen.add(label)
    lim = 6.2
    ax.plot([1, lim], [1, lim], "k:", lw=1, label="ideal: speedup = acceptance")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("mean acceptance length (tokens per round)")
    ax.set_ylabel("decode speedup over the plain decoder")
    ax.set_title("Runtime speedup vs acceptance, H200, bf16, CUDA graphs\n(filled: tree, hollow: chain)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# The drafter step before the fused head loss (61c4e2b, issue 11's table: same step definition, one H200).
STEP_BEFORE = {("qwen3-8b", "eagle3", "full", 2048): (16_387, 0.318), ("qwen3-8b", "eagle4", "full", 2048): (2_660, 0.122),
               ("qwen3-8b", "eagle4", "efficient", 2048): (2_267, 0.107), ("qwen3-8b", "eagle3", "full", 4096): (17_945, 0.356),
               ("flagship", "eagle4", "efficient", 4096): (832, 0.077)}


def plot_drafter_step(src: Path, out: Path) -> None:
    rows = {(r["shape"], r["drafter"], r["head"], r["seq"]): r for r in json.loads(src.read_text())
            if not r.get("compile") and r["device"] != "cpu"}
    cases = [c for c in STEP_BEFORE if c in rows]
    labels = [f"{s}\n{d} {h}\nT={t}" for s, d, h, t in cases]
    x = range(len(cases))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, i, name in ((axes[0], 0, "tokens / s"), (axes[1], 1, "MFU (of 790 TFLOP/s)")):
        after = [rows[c]["tokens_per_s"] if i == 0 else rows[c]["mfu"] for c in cases]
        ax.bar([j - 0.2 for j in x], [STEP_BEFORE[c][i] for c in cases], 0.4, label="before (61c4e2b)")
        ax.bar([j + 0.2 for j in x], after, 0.4, label="fused head loss")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel(name)
        ax.legend()
    axes[1].axhline(0.4, color="grey", ls=":", lw=1)
    fig.suptitle("drafter training step (TTT K=7 + loss + backward + AdamW, batch 1), H200 bf16")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _kernel_kind(name: str) -> str:
    if name.startswith(("nvjet", "cublasLt::splitKreduce", "sm90_", "ampere_")):
        return "GEMM"
    if "attention" in name or name.startswith("_combine"):
        return "attention"
    if name.startswith("triton_"):
        return "fused elementwise"
    return "other elementwise / copies"


def plot_serving(attention: Path, unfused: Path, fused: Path, out: Path) -> None:
    """Left: paged decode attention time vs context (kernel vs gather). Right: a plain decode step's
    kernel time by kind, unfused vs fused, against the step's HBM floor."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    rows = json.loads(attention.read_text())["rows"]
    colors = {1: "tab:blue", 8: "tab:orange", 64: "tab:green"}
    for b, color in colors.items():
        for impl, style in (("kernel", "-o"), ("reference", ":x")):
            pts = sorted((r["ctx"], r["ms"]) for r in rows if r["mode"] == "decode" and r["batch"] == b
                         and r["impl"] == impl)
            if pts:
                axes[0].plot(*zip(*pts), style, color=color, label=f"batch {b}, {impl}")
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("context (tokens; block table sized for 32K)")
    axes[0].set_ylabel("ms per layer call")
    axes[0].set_title("decode attention over the paged KV (Qwen3-8B heads)")
    axes[0].legend(fontsize=7)
    kinds = ["GEMM", "attention", "fused elementwise", "other elementwise / copies"]
    bottoms = [0.0, 0.0]
    for kind in kinds:
        vals = []
        for src in (unfused, fused):
            d = json.loads(src.read_text())
            vals.append(sum(t["ms"] for t in d["top"] if _kernel_kind(t["name"]) == kind))
        axes[1].bar([0, 1], vals, 0.5, bottom=bottoms, label=kind)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    steps = [json.loads(src.read_text()) for src in (unfused, fused)]
    axes[1].scatter([0, 1], [s["graph_ms"] for s in steps], marker="_", s=900, color="k", label="graphed step")
    axes[1].axhline(steps[0]["floor_ms"], color="tab:red", ls="--", lw=1, label="HBM floor (weights + KV)")
    axes[1].set_xticks([0, 1], [f"unfused\n{steps[0]['kernels']:.0f} kernels", f"fused\n{steps[1]['kernels']:.0f} kernels"])
    axes[1].set_ylabel("ms per plain decode step")
    axes[1].set_title("Qwen3-8B shape, batch 1, ctx 512 (top kernels)")
    axes[1].legend(fontsize=7, loc="center right")
    fig.suptitle("serving on one H200, bf16")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_round(profiles: list[tuple[str, Path]], out: Path) -> None:
    """A speculation round's phases (tools/profile_round.py) in plain decode steps: draft, verify,
    catch-up, the rest (acceptance, compaction, glue), for each profile, mode and batch size <= 8.
    Profiles that carry ``device_ms`` (launch hidden) are drawn from it: a phase graph replayed alone
    otherwise counts a launch wait that a round does not have."""
    fig, ax = plt.subplots(figsize=(11, 4.6))
    labels, x = [], 0
    colors = {"draft": "tab:orange", "verify": "tab:blue", "catch_up": "tab:green", "rest": "tab:gray"}
    hidden = True
    for name, src in profiles:
        rows = [r for r in json.loads(src.read_text())["rows"] if r["batch"] <= 8]
        hidden &= all("device_ms" in r for r in rows)
        start = x
        for batch in sorted({r["batch"] for r in rows}):
            for mode in ("chain", "tree"):
                parts = round_parts(rows, batch, mode)
                if parts is None:
                    continue
                total = parts.pop("round")
                bottom = 0.0
                for k, v in parts.items():
                    ax.bar(x, v, 0.7, bottom=bottom, color=colors[k], label=k if x == 0 else None)
                    bottom += v
                ax.text(x, bottom + 0.03, f"{total:.2f}", ha="center", fontsize=7)
                labels.append(f"{mode}\nb={batch}")
                x += 1
        ax.text((start + x - 1) / 2, 2.8, name, ha="center", fontsize=9, weight="bold")
        x += 0.5
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.15, color="tab:red", ls="--", lw=1, label="issue 13 target (chain, c=1/8)")
    ax.set_xticks(_bar_positions(profiles), labels, fontsize=7)
    ax.set_ylim(0, 3.3)
    ax.set_ylabel("plain decode steps per round")
    ax.set_title("a speculation round's phases, each its own CUDA graph (H200, bf16, ctx 512; chain depth 5, "
                 "tree 16 nodes)" + ("; launch hidden" if hidden else ""), fontsize=10)
    ax.legend(fontsize=7, loc="upper center", ncol=5)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def round_parts(rows: list[dict], batch: int, mode: str) -> dict[str, float] | None:
    """A round's parts in plain steps at ``batch``: draft, verify, catch_up, the rest (round minus those)
    and the round itself, from ``device_ms`` (launch hidden) where the rows have it, else from events;
    None if absent."""
    plain = next((r for r in rows if r["batch"] == batch and r["phase"] == "plain"), None)
    phase = {r["phase"].split(".")[-1]: (r["device_ms"] / plain["device_ms"] if "device_ms" in r
                                         else r["plain_steps"]) for r in rows
             if r["batch"] == batch and r["phase"].startswith(mode + ".")}
    if plain is None or "round" not in phase:
        return None
    parts = {k: phase[k] for k in ("draft", "verify", "catch_up")}
    parts["rest"] = max(phase["round"] - sum(parts.values()), 0.0)
    return parts | {"round": phase["round"]}


def _bar_positions(profiles: list[tuple[str, Path]]) -> list[float]:
    """x of every bar plot_round draws (the same walk, without drawing)."""
    xs, x = [], 0.0
    for _, src in profiles:
        rows = [r for r in json.loads(src.read_text())["rows"] if r["batch"] <= 8]
        for batch in sorted({r["batch"] for r in rows}):
            for mode in ("chain", "tree"):
                if any(r["batch"] == batch and r["phase"].startswith(mode + ".") for r in rows):
                    xs.append(x)
                    x += 1
        x += 0.5
    return xs


def _attention_rows(src: Path, scale: float = 1.0) -> dict[tuple, dict[str, float]]:
    """tools/bench_attention_paged.py rows of ``src`` as {(mode, batch, ctx): {impl: ms * scale}}."""
    by: dict[tuple, dict[str, float]] = {}
    for r in json.loads(src.read_text())["rows"]:
        if "ms" in r:  # not an out-of-memory row
            by.setdefault((r["mode"], r["batch"], r["ctx"]), {})[r["impl"]] = r["ms"] * scale
    return by


def _case_labels(cases: list[tuple]) -> list[str]:
    return [f"{m}\nb={b} {c // 1024}K" if c >= 1024 else f"{m}\nb={b} {c}" for m, b, c in cases]


def plot_split_rule(sources: dict[str, Path], out: Path) -> None:
    """Issue 13: one layer's paged attention under the small-grid split rule against the bandwidth rule
    alone, per shape, mode, batch and context (tools/bench_attention_paged.py --impls kernel kernel_bw)."""
    fig, axes = plt.subplots(1, len(sources), figsize=(6 * len(sources), 3.8), squeeze=False)
    for ax, (title, src) in zip(axes[0], sources.items()):
        by = _attention_rows(src, 1e3)
        cases = [k for k, v in by.items() if {"kernel", "kernel_bw"} <= set(v)]
        x = range(len(cases))
        ax.bar([i - 0.2 for i in x], [by[c]["kernel_bw"] for c in cases], 0.4, label="before: >= 8 x rows keys a split")
        ax.bar([i + 0.2 for i in x], [by[c]["kernel"] for c in cases], 0.4, label="now: one tile a split when partials fit L2/4")
        ax.set_xticks(list(x), _case_labels(cases), fontsize=6)
        ax.set_ylabel("us per layer call (CUDA graph)")
        ax.set_title(f"{title} (H200, bf16)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_split_sweep(sources: dict[str, Path], out: Path) -> None:
    """Issue 13: the planner's split count against the best of the explicit ones, per shape, mode, batch
    and context (tools/bench_attention_paged.py --splits ...): time / best time, 1.0 = the planner is best."""
    fig, axes = plt.subplots(len(sources), 1, figsize=(13, 3.4 * len(sources)), squeeze=False)
    for ax, (title, src) in zip(axes[:, 0], sources.items()):
        by = _attention_rows(src)
        cases = [k for k, v in by.items() if "kernel" in v and any(i.startswith("kernel_s") for i in v)]
        best = {c: min((t, int(i[8:])) for i, t in by[c].items() if i.startswith("kernel_s")) for c in cases}
        x = range(len(cases))
        ax.bar(x, [by[c]["kernel"] / best[c][0] for c in cases], 0.6, color="tab:blue")
        ax.axhline(1.0, color="k", lw=0.8)
        for i, c in zip(x, cases):
            ax.text(i, by[c]["kernel"] / best[c][0] + 0.02, f"{best[c][1]}", ha="center", fontsize=6)
        ax.set_xticks(list(x), _case_labels(cases), fontsize=6)
        ax.set_ylabel("planner / best explicit split count")
        ax.set_title(f"{title}: one layer call in a CUDA graph (H200, bf16); numbers: the best split count", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_controller_decide(src: Path, out: Path) -> None:
    """The draft controller's decision after a round: tensor ops against the kernel (us, graph replays); the
    first, unrolled version where the file keeps it; one bar per chunk size where the file compares them."""
    data = json.loads(src.read_text())
    rows = [r for r in data["rows"] if r["fused_us"] is not None]
    chunks = sorted({r.get("chunk_nodes") for r in rows} - {None})
    cases = list(dict.fromkeys((r["batch"], r["depths"]) for r in rows))
    fused = {(r["batch"], r["depths"], r.get("chunk_nodes")): r["fused_us"] for r in rows}
    tensor = {(r["batch"], r["depths"]): r["tensor_us"] for r in rows}
    first = {(r["batch"], r["depths"]): r["fused_us"] for r in data.get("unrolled_first_version", {}).get("rows", [])}
    bars = [("tensor ops (~100 kernels)", [tensor[c] for c in cases])]
    if first:
        bars.append(("one kernel, unrolled (first version)", [first.get(c, 0) for c in cases]))
    if len(chunks) > 1:  # the two-pass kernel: its grid's programs sort at most this many pool nodes each
        bars += [(f"two passes, {n} nodes a program" + (" (default)" if n == min(chunks) else ""),
                  [fused[(*c, n)] for c in cases]) for n in chunks]
    else:
        bars.append(("one kernel, row-chunked (compiles in seconds)" if first else "one Triton kernel",
                     [fused[(*c, chunks[0] if chunks else None)] for c in cases]))
    x, width = range(len(cases)), 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, (label, values) in enumerate(bars):
        ax.bar([j + (i - (len(bars) - 1) / 2) * width for j in x], values, width, label=label)
    ax.set_xticks(list(x), [f"b={b}\n{d} depth{'s' if d > 1 else ''}" for b, d in cases])
    ax.set_ylabel("us a decision")
    ax.set_ylim(0, 1.35 * max(tensor.values()))  # room for the legend
    ax.set_title(f"The controller's decision after a round ({data['device']}, CUDA-graph replays)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_controller_pair(src: Path, out: Path) -> None:
    """The controlled pair's speedups over plain decoding by concurrency: the controller (tree and chain) beside
    the best fixed shape of the sweep, per drafter (rows of ``controller_h200.json`` from one device and code)."""
    data = json.loads(src.read_text())
    drafters = list(dict.fromkeys(r["drafter"] for r in data["rows"]))
    fig, axes = plt.subplots(1, len(drafters), figsize=(4.2 * len(drafters), 3.4), squeeze=False)
    for ax, name in zip(axes[0], drafters):
        rows = sorted((r for r in data["rows"] if r["drafter"] == name), key=lambda r: r["concurrency"])
        x, width = range(len(rows)), 0.27
        for i, (label, key) in enumerate((("controller (tree)", "speedup"), ("controller (chain)",
                                          "chain_controller_speedup"), ("best fixed shape", "best_fixed_speedup"))):
            ax.bar([j + (i - 1) * width for j in x], [r[key] for r in rows], width, label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.97, color="r", lw=0.8, ls=":")
        ax.set_xticks(list(x), [f"c={r['concurrency']}\n{r['best_fixed']}" for r in rows])
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("speedup over plain")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Draft controller vs the best fixed shape ({data['device']}, SmolLM2-135M shape)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    bench, img = ROOT / "docs" / "bench", ROOT / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    if (bench / "attention_h200.json").exists():
        plot_attention(bench / "attention_h200.json", img / "attention_long_context.png")
    if (bench / "lm_head_h200.json").exists():
        plot_lm_head(bench / "lm_head_h200.json", img / "lm_head_share.png")
    serving = [bench / f for f in ("attention_paged_h200.json", "decode_step_profile_unfused_h200.json",
                                   "decode_step_profile_fused_h200.json")]
    if all(p.exists() for p in serving):
        plot_serving(*serving, img / "serving_efficiency.png")
    efficiency = [bench / "runtime_efficiency.json", bench / "runtime_efficiency_qwen3_8b_mix002.json"]
    efficiency = [p for p in efficiency if p.exists()]
    if efficiency and (bench / "runtime_smollm2.json").exists():
        plot_runtime(efficiency, bench / "runtime_smollm2.json", img / "runtime_speedup.png")
    if (bench / "drafter_step_h200.json").exists():
        plot_drafter_step(bench / "drafter_step_h200.json", img / "drafter_step.png")
    rounds = [("Qwen3-8B before", bench / "round_profile_qwen3_8b_before_h200.json"),
              ("Qwen3-8B now", bench / "round_profile_qwen3_8b_h200.json"),
              ("SmolLM2 now", bench / "round_profile_smollm2_h200.json")]
    if all(p.exists() for _, p in rounds):
        plot_round(rounds, img / "round_cost.png")
    rounds = [(f"{shape} {when}", bench / f"round_profile_{key}_s9_{tag}_h200.json")  # ninth session: glue fused
              for shape, key in (("SmolLM2", "smollm2"), ("Qwen3-8B", "qwen3_8b"))
              for when, tag in (("before", "before"), ("after", "glue"))]
    if all(p.exists() for _, p in rounds):
        plot_round(rounds, img / "round_cost_s9.png")
    plot_quality_results(bench, img)
    split_rule = {"SmolLM2-135M attention": bench / "attention_paged_split_rule_smollm2_h200.json",
                  "Qwen3-8B attention": bench / "attention_paged_split_rule_qwen3_8b_h200.json"}
    if all(p.exists() for p in split_rule.values()):
        plot_split_rule(split_rule, img / "attention_split_rule.png")
    sweep = {"SmolLM2-135M attention": bench / "attention_split_sweep_smollm2_h200.json",
             "Qwen3-8B attention": bench / "attention_split_sweep_qwen3_8b_h200.json"}
    if all(p.exists() for p in sweep.values()):
        plot_split_sweep(sweep, img / "attention_split_sweep.png")
    if (bench / "controller_decide_h200.json").exists():
        plot_controller_decide(bench / "controller_decide_h200.json", img / "controller_decide_h200.png")
    if (bench / "controller_decide_h100_s20.json").exists():
        plot_controller_decide(bench / "controller_decide_h100_s20.json", img / "controller_decide_h100_s20.png")
    for session in ("s20", "s23"):
        if (bench / f"controller_pair_smollm2_h100_{session}_rows.json").exists():
            plot_controller_pair(bench / f"controller_pair_smollm2_h100_{session}_rows.json",
                                 img / f"controller_pair_h100_{session}.png")
    if (bench / "controller_trained_smollm2_s24.json").exists():
        plot_controller_trained(bench / "controller_trained_smollm2_s24.json", img / "controller_trained_s24.png")
    s25 = {"tensor": bench / "controller_s25/controller_eagle4_tensor_h100.json",
           "fused": bench / "controller_s25/controller_eagle4_fused_h100.json"}
    if all(p.exists() for p in s25.values()):
        plot_controller_plans(s25, img / "controller_plans_s25.png")
    if (bench / "controller_h200.json").exists():
        plot_controller_progress(bench / "controller_h200.json", img / "controller_progress.png")
    print("wrote", sorted(p.name for p in img.glob("*.png")))
