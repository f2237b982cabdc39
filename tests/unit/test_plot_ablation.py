"""tools/plot_ablation.py on synthetic trainer metrics: the curves it reads and the warm start's tokens."""

from __future__ import annotations

import json

import pytest

from tests.tool_loader import load_tool

plot_ablation = load_tool("plot_ablation")


def _write(bench, name, evals, moe=False):
    rows = []
    for step, tokens, acc in evals:
        row = {"step": step, "train/tokens": tokens, "train/loss": 1.0}
        if moe:
            row |= {"train/moe_load_imbalance": 1.5 - step / 1000, "train/moe_load_imbalance_0": 1.4}
        rows.append(row)
        rows.append({"step": step, "eval/chain_acceptance_d5": acc, "eval/chain_acceptance_d3": acc / 2})
    (bench / f"ablation_smollm2_{name}_metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def test_curves_tokens_to_reach_and_the_png(tmp_path):
    _write(tmp_path, "eagle3", [(100, 1e6, 1.5), (200, 2e6, 1.9), (300, 3e6, 2.1)])
    _write(tmp_path, "eagle4", [(100, 1e6, 1.6), (200, 2e6, 2.0), (300, 3e6, 2.3)])
    _write(tmp_path, "moe", [(100, 1e6, 1.4), (200, 2e6, 1.8)], moe=True)
    _write(tmp_path, "warm", [(10, 1e5, 1.8), (20, 2e5, 2.15), (30, 3e5, 2.3)])
    runs = plot_ablation.read_runs(tmp_path)
    assert sorted(runs) == ["eagle3", "eagle4", "moe", "warm"]
    curve = plot_ablation.held_out_curve(runs["eagle3"], 5)
    assert curve == [(1e6, 1.5), (2e6, 1.9), (3e6, 2.1)]
    assert plot_ablation.held_out_curve(runs["eagle3"], 3)[-1] == (3e6, 1.05)
    warm = plot_ablation.held_out_curve(runs["warm"], 5)
    assert plot_ablation.tokens_to_reach(warm, curve[-1][1]) == 2e5  # 2.15 >= 2.1 at the second evaluation
    assert plot_ablation.tokens_to_reach(warm, 9.0) is None
    out = tmp_path / "a.png"
    plot_ablation.main(["--bench", str(tmp_path), "--out", str(out)])
    assert out.stat().st_size > 10_000


def test_summary_equal_tokens_and_warm_start(tmp_path, capsys):
    _write(tmp_path, "eagle3", [(0, 0, 1.0), (100, 1e6, 1.5), (200, 2e6, 1.9), (300, 3e6, 2.1)])
    _write(tmp_path, "eagle4", [(0, 0, 1.0), (100, 1e6, 1.6), (200, 2e6, 2.0), (400, 4e6, 2.5)])
    _write(tmp_path, "warm", [(0, 0, 1.2), (10, 2e5, 1.4), (20, 4e5, 1.8)])
    s = plot_ablation.summary(plot_ablation.read_runs(tmp_path), 5, "warm", "eagle3")
    assert s["last"]["eagle4"] == {"tokens": 4e6, "acceptance": 2.5}
    # equal tokens: the evaluations both runs have (not step 0, not eagle4's 4M)
    assert [(r["tokens"], r["ratio"]) for r in s["equal_tokens"]] == [(1e6, pytest.approx(1.6 / 1.5)),
                                                                       (2e6, pytest.approx(2.0 / 1.9))]
    w = s["warm_start"]
    assert (w["source_acceptance"], w["source_tokens"], w["converted_acceptance"]) == (2.1, 3e6, 1.2)
    assert w["tokens_to_reach"] is None and w["share_of_source_tokens"] is None
    assert w["acceptance_at_10pct"] == pytest.approx(1.4 + 0.4 * (3e5 - 2e5) / 2e5)  # between 2e5 and 4e5
    assert plot_ablation.interpolate([(0, 1.0), (1, 2.0)], 5) is None
    out = tmp_path / "s.json"
    plot_ablation.main(["--bench", str(tmp_path), "--out", str(tmp_path / "a.png"), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(s))
    assert "reaches it: never" in capsys.readouterr().out


def test_no_metrics_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="no ablation_smollm2_<run>_metrics.jsonl"):
        plot_ablation.main(["--bench", str(tmp_path)])


def test_split_rule_plot_reads_bench_attention_rows(tmp_path):
    """tools/plot_results.plot_split_rule: kernel and kernel_bw rows of a bench_attention_paged JSON, one bar
    pair per case; a case measured under one rule only is left out."""
    plot_results = load_tool("plot_results")
    rows = [{"mode": m, "batch": b, "ctx": c, "impl": i, "ms": ms} for m, b, c, i, ms in [
        ("tree16", 1, 512, "kernel", 0.008), ("tree16", 1, 512, "kernel_bw", 0.019),
        ("decode", 8, 2048, "kernel", 0.011), ("decode", 8, 2048, "kernel_bw", 0.011),
        ("decode", 64, 2048, "kernel", 0.047)]]
    src = tmp_path / "a.json"
    src.write_text(json.dumps({"rows": rows}))
    out = tmp_path / "split.png"
    plot_results.plot_split_rule({"tiny": src}, out)
    assert out.stat().st_size > 10_000


def test_round_parts_prefer_launch_hidden_times(tmp_path):
    """tools/plot_results.round_parts: a round's parts in plain steps from ``device_ms`` (launch hidden) when the
    profile has it -- a phase replayed alone on an idle GPU otherwise counts a launch wait the round has not --
    and from the event-timed ``plain_steps`` for older profiles; plot_round draws both kinds."""
    plot_results = load_tool("plot_results")
    timed = {"plain": (1.0, 1.0), "chain.round": (1.85, 1.80), "chain.draft": (0.5, 0.5),
             "chain.verify": (1.2, 1.0), "chain.catch_up": (0.1, 0.1)}  # phase: (events ms, device ms)
    new = [{"batch": 1, "phase": k, "plain_steps": ev, "device_ms": dev} for k, (ev, dev) in timed.items()]
    old = [{"batch": 1, "phase": k, "plain_steps": ev} for k, (ev, _) in timed.items()]
    parts = plot_results.round_parts(new, 1, "chain")
    assert parts["verify"] == pytest.approx(1.0) and parts["rest"] == pytest.approx(0.2)
    assert parts["round"] == pytest.approx(1.8)
    parts = plot_results.round_parts(old, 1, "chain")
    assert parts["verify"] == pytest.approx(1.2) and parts["rest"] == pytest.approx(0.05)
    assert plot_results.round_parts(new, 1, "tree") is None and plot_results.round_parts(new, 8, "chain") is None
    srcs = []
    for name, rows in (("new", new), ("old", old)):
        srcs.append((name, tmp_path / f"{name}.json"))
        srcs[-1][1].write_text(json.dumps({"rows": rows}))
    out = tmp_path / "round.png"
    plot_results.plot_round(srcs, out)
    assert out.stat().st_size > 10_000
