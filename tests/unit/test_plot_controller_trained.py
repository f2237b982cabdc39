"""`tools/plot_controller_trained.py`: the measured and modeled panels from a JSON of that shape, and the committed
twenty-fourth-session file still plots; the plans comparison from the twenty-fifth session's bench files, and by
concurrency from the twenty-sixth's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tool_loader import load_tool

REPO = Path(__file__).resolve().parents[2]


def test_both_panels_plot_from_a_small_file(tmp_path):
    tool = load_tool("plot_controller_trained")
    row = {"label": "controller (runtime)", "speedup": 1.2, "acceptance": 1.7}
    src = tmp_path / "trained.json"
    src.write_text(json.dumps({"title": "t", "measured": {"device": "GPU", "rows": [row]},
                               "modeled": {"device": "CPU", "rows": [dict(row, label="tree5x8x32")]}}))
    out = tmp_path / "trained.png"
    tool.plot_controller_trained(src, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_committed_results_plot(tmp_path):
    tool = load_tool("plot_controller_trained")
    src = REPO / "docs" / "bench" / "controller_trained_smollm2_s24.json"
    data = json.loads(src.read_text())
    assert {"label", "speedup", "acceptance"} <= set(data["measured"]["rows"][0])
    tool.plot_controller_trained(src, tmp_path / "s24.png")
    assert (tmp_path / "s24.png").stat().st_size > 10_000


def test_the_plans_comparison_plots_from_the_committed_bench_files(tmp_path):
    tool = load_tool("plot_controller_trained")
    runs = {kind: REPO / "docs" / "bench" / "controller_s25" / f"controller_eagle4_{kind}_h100.json"
            for kind in ("tensor", "fused")}
    labels = [label for label, *_ in tool._plans_runs(json.loads(runs["fused"].read_text())["rows"][0])]
    assert labels == ["plans: average", "plans: last"]
    tool.plot_controller_plans(runs, tmp_path / "plans.png")
    assert (tmp_path / "plans.png").stat().st_size > 10_000


def test_the_concurrency_comparison_plots_from_the_committed_bench_files(tmp_path):
    tool = load_tool("plot_controller_trained")
    runs = {f"{name} drafter": REPO / "docs" / "bench" / "controller_s26" / f"controller_{name}_h100.json"
            for name in ("eagle4", "untrained")}
    rows = json.loads(runs["eagle4 drafter"].read_text())["rows"]
    assert sorted(r["concurrency"] for r in rows) == [1, 8, 64]
    assert sorted(label for label, *_ in tool._plans_runs(rows[0])) == ["plans: average", "plans: last"]
    tool.plot_controller_concurrency(runs, tmp_path / "by_concurrency.png")
    assert (tmp_path / "by_concurrency.png").stat().st_size > 10_000


def test_progress_averages_a_sessions_runs_and_skips_other_drafters():
    tool = load_tool("plot_controller_trained")
    row = {"mode": "controller", "drafter": "eagle4_725_s36", "concurrency": 1, "session": "s36",
           "sweep": {"chain1": {}, "tree2x8x16": {}}}
    rows = [dict(row, controller_vs_best_fixed=0.98), dict(row, controller_vs_best_fixed=1.0),
            dict(row, session="s35", controller_vs_best_fixed=0.94, sweep={"tree5x8x32": {}}),
            dict(row, drafter="untrained", controller_vs_best_fixed=1.2),
            dict(row, session=None, controller_vs_best_fixed=0.5)]
    points = tool.progress_points(rows)
    assert list(points) == [1]
    assert [(s, round(r, 3), n, shallow) for s, r, n, shallow in points[1]] == [(35, 0.94, 1, False),
                                                                                (36, 0.99, 2, True)]


def test_the_progress_plot_from_the_committed_rows(tmp_path):
    tool = load_tool("plot_controller_trained")
    src = REPO / "docs" / "bench" / "controller_h200.json"
    points = tool.progress_points(json.loads(src.read_text())["rows"])
    assert {1, 8, 64} <= set(points)
    tool.plot_controller_progress(src, tmp_path / "progress.png")
    assert (tmp_path / "progress.png").stat().st_size > 10_000
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"device": "GPU", "rows": []}))
    with pytest.raises(ValueError, match="empty.json"):
        tool.plot_controller_progress(empty, tmp_path / "none.png")
