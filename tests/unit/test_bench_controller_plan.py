"""tools/bench_controller_plan.py: both rows come out and the JSON is written (the times are the tool's claim,
docs/bench/controller_plan_cpu.json, not this test's).

    python -m pytest -q tests/unit/test_bench_controller_plan.py
"""

from __future__ import annotations

import json

from tests.tool_loader import load_tool


def test_both_plans_are_timed_and_the_json_is_written(tmp_path):
    tool = load_tool("bench_controller_plan")
    out = tool.main(["--plans", "200", "--repeats", "2", "--out", str(tmp_path / "plan.json")])
    rows = {r["lookup"]: r["plan_us"] for r in out["rows"]}
    assert set(rows) == {"every round", "cached"} and all(t > 0 for t in rows.values())
    assert json.loads((tmp_path / "plan.json").read_text())["rows"] == out["rows"]
