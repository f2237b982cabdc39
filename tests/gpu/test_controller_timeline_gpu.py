"""The host never waits inside a round, on CUDA (skipped without a GPU): ``tools/controller_timeline.py`` traces the
tiny controlled pair served with CUDA graphs -- plain decoding, a fixed tree and the draft controller (ahead mode)
-- and every replayed round syncs the host exactly once, after its last launch (the committed tokens, and the
controller's plan for the next round, in one read). The trace analysis itself, with a host-chained positive
control, is tested on the CPU (``tests/unit/test_controller_timeline.py``).

    python -m pytest -q tests/gpu/test_controller_timeline_gpu.py
"""

from __future__ import annotations

import pytest

from tests.tool_loader import load_tool
from tests.unit.test_controller_timeline import run_tiny

pytestmark = pytest.mark.gpu


def test_every_graphed_round_syncs_once_after_its_launches(tmp_path):
    tool = load_tool("controller_timeline")
    out, _, _ = run_tiny(tool, tmp_path, "cuda", 16, 40)
    assert out["cuda_graphs"] is True
    for row in out["rows"]:
        assert row["rounds"] >= 5, row
        assert row["syncs_before_last_launch"] == 0 and row["syncs_per_round"] == 1, row
        assert row["launches_per_round"] >= 1 and row["gpu_ms"] > 0 and row["gap_ms"] is not None, row
    for row in out["controller_by_kind"]:  # a kind's rounds replay one graph: the same sync, once, at the end
        assert row["syncs_before_last_launch"] == 0 and row["syncs_per_round"] == 1 and row["gpu_ms"] > 0, row
