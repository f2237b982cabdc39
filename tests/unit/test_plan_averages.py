"""torchspec.runtime.plan_averages: ahead-mode plans from an average of recent rounds' estimates.

The tensor versions (``RoundPlan.estimates`` of ``decide_every_depth``, ``fold``, ``plan_from``) equal the
plain-Python references bit for bit over sequences of random rounds; the fold keeps each entry's first
estimate, halves towards later ones and leaves unrated entries alone; the plan rates only entries ever rated,
width 0 as a plain round, ties to the shallower then the narrower; and the point of it: one unconfident round
among confident ones leaves the plan deep where the last round alone plans a plain round.

    HF_HUB_OFFLINE=1 python -m pytest -q tests/unit/test_plan_averages.py
"""

from __future__ import annotations

import pytest
import torch
from test_controller_policy import draft_scores, linear_costs

from torchspec.runtime.controller_policy import PROB_ONE, RANK_BUCKETS, SCALE_ONE, decide_every_depth
from torchspec.runtime.plan_averages import (
    PLANS_ENV,
    SHIFT,
    fold,
    plan_from,
    plans_how,
    reference_fold,
    reference_plan_from,
    reference_round_estimates,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _round(seed: int, rows: int, k: int, drafted: int, sharp: float):
    """A round's pools depth by depth (each the prefix of the next), as ``decide_every_depth`` takes them."""
    children, sizes, each_pool = [], [], []
    for depth in range(drafted):
        pool, front, edge = draft_scores(torch.Generator().manual_seed(seed), rows, k, depth, 50, sharp)
        each_pool.append(pool.tolist())
        children.append(front.double() + edge.double())
        sizes.append(pool.shape[1])
    return pool, sizes, torch.stack(children), each_pool, front, edge


def test_random_round_sequences_fold_and_plan_like_the_reference():
    """Sequences of rounds (trees and chains, each round its own depth, padded and all-dead rows, calibrated or
    not): the estimates, the folded table and the plan equal the references bit for bit after every round."""
    gen = torch.Generator().manual_seed(11)
    seen_plan, seen_rated = set(), 0
    for seq in range(12):
        rows, k = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        d_max, n_max = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(0, 40, (1,), generator=gen))
        depth_ms = 0.02 + torch.rand(d_max, generator=gen) * 0.5
        verify_ms = 1 + torch.cumsum(torch.rand(n_max + 1, generator=gen) * 0.3 - 0.05, 0).clamp(min=0.01)
        averages = torch.full((d_max, n_max + 1), -1, dtype=torch.long)
        reference = averages.tolist()
        for r in range(10):
            drafted = int(torch.randint(1, d_max + 1, (1,), generator=gen))
            valid = torch.rand(rows, generator=gen) < (0.85 if r != 3 else 0.0)  # round 3: every row dead
            scale = (None if seq % 3 == 0 else torch.tensor(int(torch.randint(0, 2 * SCALE_ONE, (1,), generator=gen)))
                     if seq % 3 == 1 else torch.randint(0, 4 * SCALE_ONE, (RANK_BUCKETS,), generator=gen))
            sharp = float(torch.rand(1, generator=gen)) * 8
            pool, sizes, children, each_pool, front, edge = _round(100 * seq + r, rows, k, drafted, sharp)
            plan = decide_every_depth(pool, sizes, children, depth_ms, verify_ms, valid, scale, 0)
            want = reference_round_estimates(each_pool, front.tolist(), edge.tolist(), depth_ms.tolist(),
                                             verify_ms.tolist(), valid.tolist(), None if scale is None else scale.tolist())
            assert plan.estimates.tolist() == want, (seq, r)
            seen_rated += sum(x >= 0 for row in want for x in row)
            averages = fold(averages, plan.estimates)
            reference = reference_fold(reference, want)
            assert averages.tolist() == reference
            got = tuple(int(x) for x in plan_from(averages, depth_ms, verify_ms))
            assert got == reference_plan_from(reference, depth_ms.tolist(), verify_ms.tolist())
            seen_plan.add(got)
    assert seen_rated > 1000 and len({p[0] for p in seen_plan}) >= 4 and len({p[1] for p in seen_plan}) > 6
    assert any(p[1] == 0 and p[3] > 0 for p in seen_plan)  # plain plans with a probe that verifies


def test_estimates_rate_the_depths_drafted_and_one_more_per_live_row():
    pool, sizes, children, _, _, _ = _round(0, 4, 2, 2, 3.0)  # depths 0, 1 of a k=2 tree: 2 and 6 nodes
    depth_ms, verify_ms = linear_costs(4, 8, 0.1, 1.0, 0.01)
    valid = torch.tensor([True, True, False, True])
    est = decide_every_depth(pool, sizes, children, depth_ms, verify_ms, valid, None, 0).estimates
    assert est.shape == (4, 9) and est.dtype == torch.long
    assert est[0, :3].ge(0).all() and est[0, 3:].eq(-1).all()  # depth 0: widths 0..2 (its 2 nodes)
    assert est[1, :7].ge(0).all() and est[1, 7:].eq(-1).all()  # depths 0..1: 6 nodes
    assert est[2].ge(0).all() and est[3].eq(-1).all()  # one more (its 2 predicted children: 8 nodes), not two
    assert est[:3, 0].tolist() == [PROB_ONE] * 3  # width 0: the target's token alone, a live row
    dead = decide_every_depth(pool, sizes, children, depth_ms, verify_ms, torch.zeros(4, dtype=torch.bool), None, 0)
    assert dead.estimates.eq(-1).all()  # a warm-up on idle rows rates nothing


def test_fold_keeps_first_estimates_halves_towards_later_ones_and_leaves_unrated_entries():
    averages = torch.tensor([[-1, 8, 100], [6, -1, 7]])
    estimates = torch.tensor([[5, 4, -1], [10, -1, -1]])
    assert fold(averages, estimates).tolist() == [[5, 8 - 4 + 2, 100], [6 - 3 + 5, -1, 7]]
    assert reference_fold(averages.tolist(), estimates.tolist()) == fold(averages, estimates).tolist()
    assert SHIFT == 1
    assert fold(averages, estimates, shift=0).tolist() == [[5, 4, 100], [10, -1, 7]]  # the newest alone
    with pytest.raises(ValueError, match="int64 of one shape"):
        fold(averages, estimates[:, :2])


def test_plan_rates_only_rated_entries_width_0_as_plain_ties_shallower_then_narrower():
    depth_ms, verify_ms = torch.tensor([0.5, 0.5]), torch.tensor([1.0, 1.0, 1.0])
    one = PROB_ONE
    unrated = torch.full((2, 3), -1)
    assert tuple(int(x) for x in plan_from(unrated, depth_ms, verify_ms)) == (1, 0, 1, 0) == reference_plan_from(
        unrated.tolist(), depth_ms.tolist(), verify_ms.tolist())
    # width 0 costs the plain step alone (1 ms): 1 token/ms; (1, 1) 1.4 tokens / 1.5 ms < 1: plain
    table = torch.tensor([[one, one * 14 // 10, -1], [one, -1, -1]])
    assert tuple(int(x) for x in plan_from(table, depth_ms, verify_ms)) == (1, 0, 1, 1)  # the probe: (1, 1)
    # (1, 2) and (2, 1) at the same rate: 3 tokens / 1.5 ms and 4 tokens / 2 ms -> the shallower
    table = torch.tensor([[one, one, 3 * one], [one, 4 * one, -1]])
    assert tuple(int(x) for x in plan_from(table, depth_ms, verify_ms)) == (1, 2, 1, 2) == reference_plan_from(
        table.tolist(), depth_ms.tolist(), verify_ms.tolist())
    table = torch.tensor([[one, 3 * one, 3 * one], [one, -1, -1]])  # equal tokens and costs: the narrower
    assert tuple(int(x) for x in plan_from(table, depth_ms, verify_ms))[:2] == (1, 1)
    with pytest.raises(ValueError, match="need depth_ms"):
        plan_from(table, depth_ms[:1], verify_ms)


def test_one_unconfident_round_among_confident_ones_keeps_the_plan_deep():
    """Confident rounds, then one whose drafter is unsure: the round alone plans a plain round; the averaged
    table still plans the deep round the confident ones rated (what cost the trained drafter its speedup)."""
    depth_ms, verify_ms = linear_costs(5, 32, 0.08, 1.0, 0.005)
    valid = torch.ones(1, dtype=torch.bool)
    averages = torch.full((5, 33), -1, dtype=torch.long)
    for r in range(4):  # sharp draft distributions: confident paths
        pool, sizes, children, _, _, _ = _round(r, 1, 4, 5, 12.0)
        plan = decide_every_depth(pool, sizes, children, depth_ms, verify_ms, valid, None, 0)
        averages = fold(averages, plan.estimates)
    deep = tuple(int(x) for x in plan_from(averages, depth_ms, verify_ms))[:2]
    assert deep[0] >= 4 and deep[1] >= 4, deep
    pool, sizes, children, _, _, _ = _round(99, 1, 4, 5, 0.01)  # flat: the drafter knows nothing this round
    unsure = decide_every_depth(pool, sizes, children, depth_ms, verify_ms, valid, None, 0)
    assert int(unsure.next_width) == 0  # planned from this round alone: plain
    averages = fold(averages, unsure.estimates)
    kept = tuple(int(x) for x in plan_from(averages, depth_ms, verify_ms))[:2]
    assert kept[0] >= 3 and kept[1] >= 4, kept


def test_plans_how_reads_the_environment(monkeypatch):
    monkeypatch.delenv(PLANS_ENV, raising=False)
    assert plans_how() == "held"  # the default since the thirty-first session
    for how in ("last", "average", "held"):
        monkeypatch.setenv(PLANS_ENV, how)
        assert plans_how() == how
    monkeypatch.setenv(PLANS_ENV, "smooth")
    with pytest.raises(ValueError, match="TORCHSPEC_CONTROLLER_PLANS='smooth'"):
        plans_how()
