"""tools/replay_split_rule.py: the planner's choice per swept case, its measured time against the best swept
count, and the summary the sweep's own planner had; a sweep without explicit split counts is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tool_loader import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("replay_split_rule")


def sweep(path: Path, rows: list[dict]) -> Path:
    setup = {"gpu": "NVIDIA H200", "heads": 32, "kv_heads": 8, "head_dim": 128, "page_size": 16,
             "max_context": 8448, "dtype": "bfloat16"}
    path.write_text(json.dumps({"setup": setup, "rows": rows}))
    return path


def case(mode, tq, batch, ctx, times: dict) -> list[dict]:
    return [dict(mode=mode, tq=tq, batch=batch, ctx=ctx, lengths="one_long", impl=impl, ms=ms) for impl, ms in times.items()]


def test_replays_the_planners_choice_against_the_best(tool, tmp_path, capsys):
    """Batch 8 with one 8K row in an 8,448-key table: the planner takes 9 splits (8,448 / 1,024 keys), looked up
    at the nearest swept count, 16 (the best here); batch 64 with 512-key rows takes 1 (here 2 is best): ratios
    1.0 and 2.0, geomean sqrt(2); the sweep's own planner had 4.0 and 1.5."""
    rows = case("chain6", 6, 8, 8192, {"kernel": 4.0, "kernel_s1": 9.0, "kernel_s4": 3.0, "kernel_s16": 1.0}) + \
        case("chain6", 6, 64, 512, {"kernel": 3.0, "kernel_s1": 4.0, "kernel_s2": 2.0, "kernel_s16": 8.0})
    out = tmp_path / "replay.json"
    tool.main([str(sweep(tmp_path / "s.json", rows)), "--json", str(out)])
    got = json.loads(out.read_text())
    assert [(r["planned"], r["chosen"], r["best"], r["ratio"]) for r in got["rows"]] == [(9, 16, 16, 1.0), (1, 1, 2, 2.0)]
    assert got["geomean"] == pytest.approx(2 ** 0.5) and got["worst"] == 2.0
    assert got["geomean_at_sweep"] == pytest.approx((4.0 * 1.5) ** 0.5) and got["worst_at_sweep"] == 4.0
    assert "| all | 2 | 1.414 | 2.00 |" in capsys.readouterr().out


def test_the_whole_table_plans_the_short_batch_as_a_long_one(tool, tmp_path):
    """--table full: the planner sees 8,448 keys for 512-key rows and splits them (the behaviour buckets fix)."""
    rows = case("chain6", 6, 64, 512, {"kernel_s1": 1.0, "kernel_s8": 3.0})
    got = tool.replay_file(sweep(tmp_path / "s.json", rows), "full")
    assert got[0]["planned"] > 1 and got[0]["chosen"] == 8


def test_a_sweep_without_split_counts_is_refused(tool, tmp_path):
    rows = case("decode", 1, 8, 512, {"kernel": 1.0})
    with pytest.raises(SystemExit, match="no kernel_s<N> rows"):
        tool.main([str(sweep(tmp_path / "s.json", rows))])
