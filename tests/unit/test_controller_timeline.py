"""`tools/controller_timeline.py`: the per-round trace analysis on hand-built traces (a wait inside a round
is caught, the ahead design's one sync after the launch is not), and the tool end to end on CPU (the tiny
controlled pair, a hand-built cost table): rows, JSON, the figure. CPU traces hold no CUDA activity, so no
timing or sync count is asserted there."""

from __future__ import annotations

import json

import pytest

from tests.cost_tables import linear_table
from tests.tool_loader import load_tool

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tool():
    return load_tool("controller_timeline")


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def _round(t0, mid_sync: bool):
    """A round at ``t0`` (us): launch, [a sync, a second launch,] the end-of-round sync; its kernels."""
    ev = [_x("user_annotation", "decode_round", t0, 100), _x("cuda_runtime", "cudaGraphLaunch", t0 + 10, 5)]
    if mid_sync:
        ev += [_x("cuda_runtime", "cudaStreamSynchronize", t0 + 20, 20), _x("cuda_runtime", "cudaGraphLaunch", t0 + 45, 5)]
    ev += [_x("cuda_runtime", "cudaMemcpyAsync", t0 + 55, 2), _x("cuda_runtime", "cudaStreamSynchronize", t0 + 60, 30),
           _x("kernel", "gemm", t0 + 12, 40), _x("kernel", "argmax", t0 + 50, 30), _x("gpu_memcpy", "DtoH", t0 + 85, 2)]
    return ev


def test_round_stats_count_waits_inside_and_at_the_end(tool):
    ahead = tool.round_stats(_round(0, False) + _round(200, False))
    assert [r["launches"] for r in ahead] == [1, 1] and [r["syncs"] for r in ahead] == [1, 1]
    assert sum(r["syncs_before_last_launch"] for r in ahead) == 0  # the one sync follows the one launch
    assert ahead[0]["host_wait_ms"] == pytest.approx(0.030)
    assert ahead[0]["gpu_ms"] == pytest.approx(0.070)  # kernels 12..52 and 50..80 overlap, then 85..87: 68 + 2 us
    assert ahead[0]["gap_ms"] == pytest.approx((212 - 87) / 1e3) and ahead[1]["gap_ms"] is None
    chained = tool.round_stats(_round(0, True) + _round(200, True))  # positive control: a host-chained round
    assert [r["syncs_before_last_launch"] for r in chained] == [1, 1] and chained[0]["host_wait_ms"] == pytest.approx(0.05)
    row = tool.summarize("chained", chained)
    assert row["syncs_before_last_launch"] == 2 and row["syncs_per_round"] == 2 and row["launches_per_round"] == 2
    capturing = _round(400, True) + [_x("cuda_runtime", "cudaStreamBeginCapture", 420, 1)]  # a shape first seen
    row = tool.summarize("ahead", tool.round_stats(_round(0, False) + _round(200, False) + capturing))
    assert row["rounds"] == 2 and row["captured_rounds"] == 1 and row["syncs_before_last_launch"] == 0


def test_rounds_split_by_kind_compare_a_deciding_round_with_the_held_round_of_its_plan(tool):
    """Rows per round kind: labels in the order the rounds ran; a kind of fewer than 3 replayed rounds, and a round
    that captured a graph, are left out; a trace whose round count differs from the labels' gets no kinds."""
    rounds = tool.round_stats([e for i in range(7) for e in _round(200 * i, False)])
    kinds = ["d2w16", "held d2w16", "held d2w16", "d2w16", "held d2w16", "d2w16", "plain-deferring"]
    rows = tool.by_kind("controller", tool.label_rounds(rounds, kinds))
    assert [(r["mode"], r["rounds"]) for r in rows] == [("controller d2w16", 3), ("controller held d2w16", 3)]
    assert all(r["round_ms"] == pytest.approx(0.1) for r in rows)
    captured = tool.round_stats([e for i in range(3) for e in _round(200 * i, False)]
                                + [_x("cuda_runtime", "cudaStreamBeginCapture", 20, 1)])
    assert tool.by_kind("c", tool.label_rounds(captured, ["d1w8"] * 3)) == []  # 2 replayed rounds: too few
    lost = tool.round_stats(_round(0, False) + _round(200, False))
    assert tool.by_kind("c", tool.label_rounds(lost, ["d1w8"] * 3)) == [] and "kind" not in lost[0]


def run_tiny(tool, tmp_path, device: str, prompt_len: int, new: int) -> tuple[dict, object, object]:
    """The tool on the tiny controlled pair with a hand-built table -> (result, its JSON path, its PNG path)."""
    base = ["--shape", "tiny", "--device", device, "--concurrency", "2", "--tree", "3x2x4", "--prompt-len",
            str(prompt_len), "--max-new-tokens", str(new)]
    args = tool.build_parser().parse_args([*base, "--out", str(tmp_path / "unused.json")])
    args.controller_mode = "ahead"
    _, engine = next(tool.engines(args, {"noise": ["0.0"]}, 2, prompt_len + new + 160))
    costs = tmp_path / "costs.json"
    linear_table(engine, 0.02, 0.1, widths=[1, 2], nodes=list(range(5))).save(costs)
    out, png = tmp_path / "timeline.json", tmp_path / "timeline.png"
    return tool.main([*base, "--costs", str(costs), "--out", str(out), "--plot", str(png)]), out, png


def test_the_tool_on_cpu_writes_rows_and_the_figure(tool, tmp_path):
    result, out, png = run_tiny(tool, tmp_path, "cpu", 8, 10)
    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"] and [r["mode"] for r in saved["rows"]] == ["plain", "fixed tree3x2x4", "controller"]
    for r in saved["rows"]:
        assert set(tool.FIELDS) <= set(r) and r["rounds"] >= 1 and r["round_ms"] > 0
    assert saved["rows"][0]["rounds"] >= saved["rows"][1]["rounds"]  # a plain step a token; the tree commits more
    kinds = saved["controller_by_kind"]  # the controller's rounds by kind, each kind's rounds counted apart
    assert kinds and all(r["mode"].startswith("controller ") and r["rounds"] >= 3 for r in kinds)
    assert sum(r["rounds"] for r in kinds) <= saved["rows"][2]["rounds"]
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bad_input_is_one_line(tool, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        tool.main(["--shape", "tiny", "--device", "cpu", "--tree", "3x2", "--out", str(tmp_path / "x.json")])
    assert err.value.code == 2 and "--tree '3x2'" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
