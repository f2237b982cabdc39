"""`tools/replay_smoothed_plans.py`: the averaged plan by hand (entries a round did not estimate keep what earlier
rounds said; ties to the shallower and narrower; width 0 priced as a plain step), and one replay of the tiny pair
whose greedy output still equals plain decoding with the plan replaced."""

from __future__ import annotations

import math

import pytest
import torch

from tests.cost_tables import linear_table
from tests.runtime_pair import build_pair
from tests.tool_loader import load_tool
from torchspec.runtime import controlled_drafting
from torchspec.runtime.loading import load_engine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tool():
    return load_tool("replay_smoothed_plans")


def one_row(*probs: float) -> list[torch.Tensor]:
    """A single live row's pools: depth 1 holds the first node, depth 2 all of them."""
    logp = torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)
    return [logp[:, :1], logp]


def test_the_average_weighs_the_newest_round_and_keeps_unseen_entries(tool):
    plans = tool.SmoothedPlans(0.5)
    valid = torch.ones(1, dtype=torch.bool)
    plans.observe(one_row(0.8, 0.6), valid, None, n_max=2)
    assert plans.tokens[1, 1] == pytest.approx(1.8, abs=1e-5) and plans.tokens[2, 2] == pytest.approx(2.4, abs=1e-5)
    plans.observe(one_row(0.2, 0.1)[:1], valid, None, n_max=2)  # a round that estimated depth 1 alone
    assert plans.tokens[1, 1] == pytest.approx(1.5, abs=1e-5)  # (1.8 + 1.2) / 2
    assert plans.tokens[2, 2] == pytest.approx(2.4, abs=1e-5)  # depth 2: what the first round said
    assert plans.tokens[1, 0] == pytest.approx(1.0)  # width 0: the bonus token alone


def test_the_plan_is_the_best_rate_with_width_zero_a_plain_step(tool):
    plans = tool.SmoothedPlans(1.0)
    plans.observe(one_row(0.9, 0.9), torch.ones(1, dtype=torch.bool), None, n_max=2)
    depth_ms, verify_ms = torch.tensor([0.5, 0.2]), torch.tensor([1.0, 1.1, 1.2])
    # rates: plain 1/1.0; (1,1) 1.9/1.6; (2,2) 2.8/1.9 -- the deepest wins
    assert plans.plan(depth_ms, verify_ms) == (2, 2)
    assert plans.plan(torch.tensor([5.0, 5.0]), verify_ms) == (1, 0)  # drafting too dear: a plain round
    with pytest.raises(ValueError, match="--smooth"):
        tool.SmoothedPlans(0.0)


def test_a_replay_with_averaged_plans_decodes_as_plain(tool, tmp_path, tiny_tokenizer, monkeypatch):
    target, drafter = build_pair(tmp_path, tiny_tokenizer)
    engine = load_engine(target, drafter, device="cpu", dtype="float32", max_batch=2, max_context=128)
    costs = tmp_path / "costs.json"
    linear_table(engine, 0.05, 0.02, widths=[1, 2, 4], nodes=list(range(9))).save(costs)
    monkeypatch.setattr(controlled_drafting, "decide_every_depth_calibrated",
                        controlled_drafting.decide_every_depth_calibrated)  # undone after the test
    result = tool.main(["--smooth", "0.5", "--target", target, "--drafter", drafter, "--costs", str(costs),
                        "--num-prompts", "2", "--prompt-len", "16", "--max-new-tokens", "10", "--chains", "1",
                        "--trees", "3x2x6", "--out", str(tmp_path / "replay.json")])
    row = result["rows"][-1]  # replay_controller asserts the controller's output equals plain decoding
    assert row["mode"] == "controller" and sum(n for _, _, n in row["plans"]) > 0
