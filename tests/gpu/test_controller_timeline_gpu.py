"""The host never waits inside a round, on CUDA (skipped without a GPU): ``tools/controller_timeline.py`` traces the
tiny controlled pair served with CUDA graphs -- plain decoding, a fixed tree and the draft controller (ahead mode)
-- and every replayed round syncs the host exactly once, after its last launch (the committed tokens, and the
controller's plan for the next round, in one read). The trace analysis itself, with a host-chained positive
control, is tested on the CPU (``tests/unit/test_controller_timeline.py``).

    python -m pytest -q tests/gpu/test_controller_timeline_gpu.py
"""

from __future__ import annotations

import pytest

from tests.cost_tables import linear_table
from tests.tool_loader import load_tool

pytestmark = pytest.mark.gpu


def test_every_graphed_round_syncs_once_after_its_launches(tmp_path):
    tool = load_tool("controller_timeline")
    base = ["--shape", "tiny", "--device", "cuda", "--concurrency", "2", "--tree", "3x2x4", "--prompt-len", "16",
            "--max-new-tokens", "40"]
    args = tool.build_parser().parse_args([*base, "--out", str(tmp_path / "unused.json")])
    args.controller_mode = "ahead"
    _, engine = next(tool.engines(args, {"noise": ["0.0"]}, 2, 256))
    costs = tmp_path / "costs.json"
    linear_table(engine, 0.02, 0.1, widths=[1, 2], nodes=list(range(5))).save(costs)
    out = tool.main([*base, "--costs", str(costs), "--out", str(tmp_path / "timeline.json"),
                     "--plot", str(tmp_path / "timeline.png")])
    assert out["cuda_graphs"] is True
    for row in out["rows"]:
        assert row["rounds"] >= 5, row
        assert row["syncs_before_last_launch"] == 0 and row["syncs_per_round"] == 1, row
        assert row["launches_per_round"] >= 1 and row["gpu_ms"] > 0 and row["gap_ms"] is not None, row
