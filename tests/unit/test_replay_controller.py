"""`tools/replay_controller.py` on the CPU: the tiny pair served with a hand-built table, each round priced from it.
Checks the pricing rules by hand, the rows (fixed shapes and the controller, greedy outputs equal to plain), the
host time a round taken from ``--overhead``, and one-line errors."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tests.cost_tables import linear_table
from tests.runtime_pair import build_pair
from tests.tool_loader import load_tool
from torchspec.runtime.loading import load_engine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tool():
    return load_tool("replay_controller")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("replay")
    target, drafter = build_pair(root, tiny_tokenizer)
    engine = load_engine(target, drafter, device="cpu", dtype="float32", max_batch=2, max_context=128)
    costs = root / "costs.json"
    linear_table(engine, 0.05, 0.02, widths=[1, 2, 4], nodes=list(range(9))).save(costs)
    return root, target, drafter, costs


def test_pricing_follows_the_table(tool, setup):
    from torchspec.runtime.cost_table import CostTable

    table = CostTable.load(setup[3], None)
    table.overhead = table.overhead + 0.5
    price = tool.Pricer(table, 2, 100)  # linear_table: plain 1 ms, a node 0.02 ms more, a depth 0.05 ms
    assert price.plain() == pytest.approx(1.5)
    assert price.round(0, 4, 0) == price.plain()  # a plain round
    assert price.round(3, 4, 6) == pytest.approx(0.05 + 2 * 0.05 + 1.12 + 0.5, abs=1e-6)
    assert price.depth_ms(3) == pytest.approx(0.05, abs=1e-6)  # between measured widths 2 and 4
    undecided = tool.Pricer(table, 2, 100, decide_ms=0.03)
    assert undecided.round(3, 4, 6) == pytest.approx(price.round(3, 4, 6))  # a deciding round pays it all
    assert undecided.round(3, 4, 6, decided=False) == pytest.approx(price.round(3, 4, 6) - 0.03)  # fixed or held
    assert undecided.round(0, 4, 0, decided=False) == price.plain()  # a plain round decides nothing either way
    table.round_extra = torch.full((len(table.batches),), 0.25, dtype=torch.float64)  # depth 0 as served: a fixed round's
    served = tool.Pricer(table, 2, 100, decide_ms=0.03)
    assert served.round(3, 4, 6, decided=False) == pytest.approx(0.25 + 2 * 0.05 + 1.12 + 0.5, abs=1e-6)
    assert served.round(3, 4, 6) == pytest.approx(served.round(3, 4, 6, decided=False) + 0.03)  # deciding adds it


def test_each_way_of_planning_is_a_row_and_held_rounds_skip_the_decision(tool, setup):
    """``--plans average,held``: a controller row each, from its own calibration; the held row counts its held
    rounds and prices them ``--decide-ms`` lower, as it prices the fixed shapes."""
    args = ["--shape", "tiny", "--noise", "0.0", "--costs", str(setup[3]), "--num-prompts", "2", "--prompt-len", "16",
            "--max-new-tokens", "24", "--chains", "1", "--trees", "2x2x4", "--plans", "average,held"]
    rows = {r["mode"]: r for r in tool.main([*args, "--decide-ms", "0.1"])["rows"]}
    assert list(rows) == ["chain1", "tree2x2x4", "controller (average)", "controller"]  # the default: held
    assert rows["controller (average)"]["held_rounds"] == 0 and rows["controller"]["held_rounds"] > 0
    free = {r["mode"]: r for r in tool.main([*args, "--decide-ms", "0"])["rows"]}
    for mode in ("tree2x2x4", "controller"):  # the same runs, cheaper by the decision they skip
        assert rows[mode]["acceptance"] == free[mode]["acceptance"] and rows[mode]["speedup"] > free[mode]["speedup"]
    assert rows["controller (average)"]["speedup"] == pytest.approx(free["controller (average)"]["speedup"])  # decided


def test_rows_and_outputs(tool, setup, tmp_path):
    root, target, drafter, costs = setup
    out = tmp_path / "replay.json"
    result = tool.main(["--target", target, "--drafter", drafter, "--costs", str(costs), "--num-prompts", "3",
                        "--prompt-len", "24", "--max-new-tokens", "12", "--concurrency", "2", "--chains", "1,2",
                        "--trees", "2x2x3,3x2x6", "--overhead", "1=0.3,4=0.4,512=0.5", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"] and saved["host_ms"] == pytest.approx(0.3 + 0.1 / 3)  # batch 2: 1/3 from 1 to 4
    assert [r["mode"] for r in saved["rows"]] == ["chain1", "chain2", "tree2x2x3", "tree3x2x6", "controller"]
    for r in saved["rows"]:
        assert r["acceptance"] >= 1 and r["speedup"] > 0
    # every speedup is plain decoding's modeled time over the run's, each summed over the rounds it took
    plain_ms = saved["plain_rounds"] * saved["plain_round_ms"]
    price = tool.Pricer(tool.read_table(argparse.Namespace(**saved["args"])), 2, saved["args"]["ctx"])
    fixed = {"chain1": (1, 1, 1), "chain2": (2, 1, 2), "tree2x2x3": (2, 2, 3), "tree3x2x6": (3, 2, 6)}
    for r in saved["rows"]:
        assert r["speedup"] == pytest.approx(plain_ms / r["modeled_ms"])
        if r["mode"] in fixed:  # a fixed shape: its rounds at its price, the batch's idle rows included
            assert r["modeled_ms"] == pytest.approx(r["rounds"] * price.round(*fixed[r["mode"]], decided=False))
    assert saved["rows"][-1]["rounds"] == sum(n for _, _, n in saved["rows"][-1]["plans"])  # one plan a round
    assert max(r["acceptance"] for r in saved["rows"][:-1]) > 1.2  # the pair agrees: drafts are accepted
    assert sum(n for _, _, n in saved["rows"][-1]["plans"]) > 0
    by_depth = saved["rows"][-1]["calibration_by_depth"]  # depths 1..3 of the 3x2x6 bound
    assert [r["depth"] for r in by_depth] == list(range(1, len(by_depth) + 1)) and len(by_depth) <= 3
    accepted = [r["accepted"] for r in by_depth]
    assert accepted[0] > 0 and accepted == sorted(accepted, reverse=True)  # depth d is accepted after d - 1
    assert all(r["expected"] >= 0 and 0 <= r["expected_raw"] for r in by_depth) and by_depth[0]["expected_raw"] > 0


def test_the_controlled_pair_replays_without_a_target(tool, setup, tmp_path):
    out = tmp_path / "pair.json"
    result = tool.main(["--shape", "tiny", "--noise", "0.0", "--costs", str(setup[3]), "--num-prompts", "2",
                        "--prompt-len", "16", "--max-new-tokens", "8", "--chains", "1", "--trees", "2x2x4",
                        "--out", str(out)])
    assert [r["mode"] for r in result["rows"]] == ["chain1", "tree2x2x4", "controller"]
    assert result["rows"][1]["acceptance"] > 1.2  # noise 0: the controlled drafter agrees with its target


def test_later_runs_go_on_from_the_last_ones_state(tool, setup):
    """``--runs 2``: the controller serves the prompts twice on one table and calibration, each run priced; the row
    is the second run's (its own rounds and plans), and the first run's speedup is the one-run replay's."""
    args = ["--shape", "tiny", "--noise", "0.0", "--costs", str(setup[3]), "--num-prompts", "2", "--prompt-len", "16",
            "--max-new-tokens", "16", "--chains", "1", "--trees", "2x2x4"]
    one = tool.main(args)["rows"][-1]
    two = tool.main([*args, "--runs", "2"])["rows"][-1]
    assert len(one["speedup_by_run"]) == 1 and len(two["speedup_by_run"]) == 2
    assert two["speedup_by_run"][0] == pytest.approx(one["speedup"]) and two["speedup"] == two["speedup_by_run"][1]
    assert two["rounds"] == sum(n for _, _, n in two["plans"]) and two["plain_rounds"] >= 0
    assert two["plans"] != one["plans"] or two["calibration_at_end"] != one["calibration_at_end"]  # went on


@pytest.mark.parametrize("change, text", [(["--overhead", "1=0.3"], "lacks the table's batches"),
                                          (["--overhead", "1:0.3"], "BATCH=MS"),
                                          (["--trees", "3x2"], "--trees entry"),
                                          (["--shape", "tiny"], "not both or neither"),
                                          (["--plans", "average,avg"], "--plans entry 'avg'"),
                                          (["--decide-ms", "-1"], "--decide-ms -1.0 must be >= 0"),
                                          (["--runs", "0"], "--runs")])
def test_bad_input_is_one_line(tool, setup, capsys, change, text):
    root, target, drafter, costs = setup
    with pytest.raises(SystemExit) as err:
        tool.main(["--target", target, "--drafter", drafter, "--costs", str(costs), *change])
    assert err.value.code == 2 and text in capsys.readouterr().err
