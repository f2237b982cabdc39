"""`tools/profile_engine_host.py` on CPU: its JSON has the keys it promises, its split adds up, and the
forward timer really catches the forwards (a forward made slower by a sleep lands in forward time,
and the host profile, paused inside forwards, never sees the sleep)."""

from __future__ import annotations

import json
import time

import pytest

from tests.tool_loader import load_tool
from torchspec.runtime import engine_forwards as forwards_module

pytestmark = pytest.mark.usefixtures("one_thread")

ROW_KEYS = {"mode", "concurrency", "steps", "wall_ms", "forward_ms", "prefill_ms", "decode_ms", "host_ms",
            "submit_ms", "loop_ms", "prefill_forwards", "decode_rounds", "tokens_per_step", "tokens_per_s",
            "step_ms_p50", "step_ms_max", "syncs_per_step", "top", "leaked_pages"}
SMALL = ["--concurrency", "1,4", "--warmup", "2", "--steps", "6", "--profile-steps", "2", "--max-context", "128",
         "--prompt-len", "4,40", "--max-new", "2,12", "--top", "5"]


@pytest.fixture(scope="module")
def tool():
    return load_tool("profile_engine_host")


def test_json_keys_and_split(tool, tmp_path):
    out = tmp_path / "host.json"
    data = tool.main(SMALL + ["--modes", "plain,chain,tree,controller", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    assert data["device"] == "cpu" and {"torch", "threads", "args", "rows"} <= set(data)
    assert [(r["mode"], r["concurrency"]) for r in data["rows"]] == [
        (m, c) for c in (1, 4) for m in ("plain", "chain", "tree", "controller")]
    for r in data["rows"]:
        assert ROW_KEYS <= set(r)
        assert r["steps"] == 6 and r["leaked_pages"] == 0 and r["syncs_per_step"] is None
        assert r["decode_rounds"] > 0 and r["tokens_per_step"] > 0
        assert r["forward_ms"] == pytest.approx(r["prefill_ms"] + r["decode_ms"])
        assert r["wall_ms"] == pytest.approx(r["forward_ms"] + r["host_ms"])
        assert 0 < r["forward_ms"] <= r["wall_ms"]
        # measured apart, around the whole loop: the steps and the submissions are all of it
        assert r["loop_ms"] == pytest.approx(r["wall_ms"] + r["submit_ms"], rel=0.05, abs=0.5)
        assert 0 < len(r["top"]) <= 5
        assert all({"function", "own_ms", "cum_ms", "calls"} <= set(t) for t in r["top"])
        owns = [t["own_ms"] for t in r["top"]]
        assert owns == sorted(owns, reverse=True)


def test_forward_time_catches_a_slow_forward(tool, monkeypatch, tmp_path):
    slow = 0.02
    plain_step = forwards_module.plain_step

    def sleepy(*args, **kwargs):
        time.sleep(slow)
        return plain_step(*args, **kwargs)

    monkeypatch.setattr(forwards_module, "plain_step", sleepy)
    args = tool.parse_args(SMALL + ["--modes", "plain", "--concurrency", "2"])
    engine = tool.build_engine("cpu", "auto", 2, 128, 4, str(tmp_path))
    row = tool.run_config(engine, "plain", 2, args)
    assert row["decode_ms"] >= 1e3 * slow * row["decode_rounds"]
    assert row["host_ms"] >= 0 and row["leaked_pages"] == 0
    assert not any("sleep" in t["function"] for t in row["top"])  # the profiler is paused inside forwards

