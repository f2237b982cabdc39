"""`tools/bench_controller_decide.py` on CPU: the tensor decision timed eagerly, the fused column empty (no
Triton without CUDA), its JSON written; bad options are one-line errors. CPU times mean nothing."""

from __future__ import annotations

import json

import pytest

from tests.tool_loader import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_controller_decide")


def test_a_cpu_run_times_the_tensor_decision_and_writes_its_rows(tool, tmp_path):
    out = tmp_path / "decide.json"
    tool.main(["--batches", "1,4", "--depths", "1,2", "--topk", "4", "--verified", "3", "--sets", "2",
               "--replays", "3", "--repeats", "1", "--device", "cpu", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and [(r["batch"], r["depths"]) for r in data["rows"]] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    assert all(r["tensor_us"] > 0 and r["fused_us"] is None for r in data["rows"])


def test_a_round_decides_the_same_on_each_set(tool):
    """The inputs are a real decision's: the tensor version plans within the table, the evidence is finite."""
    import torch

    r = tool.random_round(torch.Generator().manual_seed(3), 4, 3, 4, torch.device("cpu"))
    go, widths, depth, width, drafted, pending = tool.outputs(tool.decide_tensor(r, 3), r["cal"])
    assert len(go) == len(widths) == 3 and 1 <= depth <= 4 and 0 <= width <= 24 and drafted >= 0  # the table: 24 nodes
    assert r["sizes"] == [4, 20, 36] and r["pool"].shape == (4, 36)  # a dynamic tree's pool: 4, then 16 a depth
    at = r["cal"].alphas.tolist().index(float(r["cal"].choice()[0]))  # the exponent the decision read
    assert len(pending) == 4 and pending[at][-1] == drafted / (1 << 20)  # its evidence: in all ...
    assert sum(pending[at][:-1]) == pytest.approx(pending[at][-1])  # ... and by rank bucket


@pytest.mark.parametrize("bad, message", [(["--depths", "0"], "--depths"), (["--batches", "x"], "--batches"),
                                          (["--sets", "0"], "--sets"), (["--verified", "40"], "--verified 40")])
def test_bad_options_are_one_line_errors(tool, tmp_path, capsys, bad, message):
    with pytest.raises(SystemExit) as exit_:
        tool.main([*bad, "--device", "cpu", "--out", str(tmp_path / "x.json")])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
