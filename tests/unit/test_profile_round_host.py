"""`tools/profile_round_host.py` on CPU at the tiny shape: both runs profiled (their rounds by kind, host time by
function per round), the differences sorted largest first, one-line errors. CPU times mean nothing: no host time
is asserted beyond being counted."""

from __future__ import annotations

import json

import pytest

from tests.tool_loader import load_tool

ARGS = ["--shape", "tiny", "--tree", "2x2x3", "--max-new-tokens", "10", "--prompt-len", "8", "--num-prompts", "2",
        "--device", "cpu", "--top", "5"]


@pytest.fixture(scope="module")
def tool():
    return load_tool("profile_round_host")


def test_both_runs_are_profiled_and_compared(tool, tmp_path, capsys):
    out = tmp_path / "host.json"
    tool.main([*ARGS, "--out", str(out)])
    data = json.loads(out.read_text())
    fixed, ctl, again = data["runs"]["fixed"], data["runs"]["controller"], data["runs"]["fixed again"]
    assert set(fixed["round_kinds"]) == set(again["round_kinds"]) == {"spec"}  # the fixed tree's rounds, twice
    assert set(ctl["round_kinds"]) <= {"plain-deferring"} | {k for k in ctl["round_kinds"]
                                                              if k.startswith(("d", "held d"))}
    for run in (fixed, ctl, again):
        assert run["round_ms"] > 0 and run["host"] and run["round_host_us"] > 0
        assert all(v["cum_us"] >= v["own_us"] >= 0 for v in run["host"].values())
    assert any("decode_round" in k for k in ctl["host"])  # the engine's round is among what the profile sees
    diffs = [abs(r["controller_minus_fixed_us"]) for r in data["own_us_difference"]]
    assert diffs == sorted(diffs, reverse=True) and len(diffs) > 5
    printed = capsys.readouterr().out.splitlines()  # each run's rounds, then the top 5 functions
    assert printed[0].startswith("fixed ") and printed[1].startswith("controller") and printed[2].startswith("fixed again")
    assert "diff us" in printed[3] and len(printed) == 4 + 5
    assert all("us a round in decode_round" in line for line in printed[:3])


def test_bad_input_is_one_line(tool, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main([*ARGS, "--tree", "5x8", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--tree" in err and "DEPTHxTOPKxNODES" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.json").exists()
