"""torchspec.runtime.controller_policy: the tensor decisions equal the plain-Python reference exactly
(random rounds and hand-built ones), and the policy does what the model says: an untrained drafter
decodes plainly, a confident one with cheap depths drafts deep and verifies wide, a dearer verify
narrows the width, ties pick the smaller width, padded rows count for nothing.

    HF_HUB_OFFLINE=1 python -m pytest -q tests/unit/test_controller_policy.py
"""

from __future__ import annotations

import math

import pytest
import torch

from torchspec.runtime.controller_policy import (
    INITIAL_SAMPLED_DEPTH,
    PROB_ONE,
    RANK_BUCKETS,
    SCALE_ONE,
    chain_depth_for_batch,
    check_costs,
    decide_after_depth,
    expected_tokens,
    next_sampled_depth,
    verify_width,
)
from torchspec.runtime.controller_reference import (
    reference_decide_after_depth,
    reference_expected_tokens,
    reference_next_plan,
    reference_next_sampled_depth,
    reference_verify_width,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def draft_scores(gen: torch.Generator, rows: int, k: int, depth: int, vocab: int, sharpness: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scores a dynamic tree round holds after depths 0..depth, drafted as drafting.py does from
    random draft distributions: (pool [B, k + depth*k*k], frontier [B, k], frontier's last edges [B, k])."""
    def top(shape: tuple[int, ...]) -> torch.Tensor:
        logits = torch.randn(*shape, vocab, generator=gen) * sharpness
        return torch.log_softmax(logits, -1).topk(k, -1).values

    cum = edge = top((rows,))  # [B, k]
    pool = [cum]
    for _ in range(depth):
        child = top((rows, k))  # [B, k, k]
        all_cum, all_edge = (cum[:, :, None] + child).reshape(rows, k * k), child.reshape(rows, k * k)
        pool.append(all_cum)
        pick = torch.sort(all_cum, dim=-1, descending=True, stable=True).indices[:, :k]  # the next frontier
        cum, edge = all_cum.gather(1, pick), all_edge.gather(1, pick)
    return torch.cat(pool, 1), cum, edge


def linear_costs(d_max: int, n_max: int, depth: float, plain: float, per_node: float) -> tuple[torch.Tensor, ...]:
    return torch.full((d_max,), depth), plain + per_node * torch.arange(n_max + 1, dtype=torch.float32)


def both(pool, front, edge, depth, depth_ms, verify_ms, row_valid=None, scale=None, ahead=False
         ) -> tuple[tuple, tuple]:
    """(tensor decision, reference decision) as (width, stop, go) Python values."""
    valid = torch.ones(pool.shape[0], dtype=torch.bool) if row_valid is None else row_valid
    got = decide_after_depth(pool, front, edge, depth, depth_ms, verify_ms, valid,
                             None if scale is None else torch.tensor(scale), ahead=ahead)
    want = reference_decide_after_depth(pool.tolist(), front.tolist(), edge.tolist(), depth, depth_ms.tolist(),
                                        verify_ms.tolist(), valid.tolist(), scale, ahead=ahead)
    return (int(got.width), bool(got.stop), bool(got.go)), want


def test_random_rounds_decide_like_the_reference():
    gen = torch.Generator().manual_seed(0)
    seen_go, widths = set(), set()
    for _ in range(400):  # noqa: B007 (the index picks the calibrated half)
        rows, k = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 7, (1,), generator=gen))
        d_max = int(torch.randint(1, 7, (1,), generator=gen))
        depth = int(torch.randint(0, d_max, (1,), generator=gen))
        n_max = int(torch.randint(0, 48, (1,), generator=gen))
        sharpness = float(torch.rand(1, generator=gen)) * 8
        pool, front, edge = draft_scores(gen, rows, k, depth, 50, sharpness)
        depth_ms = 0.02 + torch.rand(d_max, generator=gen) * 0.5
        verify_ms = 1 + torch.cumsum(torch.rand(n_max + 1, generator=gen) * 0.3, 0)
        valid = torch.rand(rows, generator=gen) < 0.85
        scale = (None if _ % 3 == 0 else int(torch.randint(0, 2 * SCALE_ONE, (1,), generator=gen)) if _ % 3 == 1
                 else torch.randint(0, 4 * SCALE_ONE, (RANK_BUCKETS,), generator=gen).tolist())  # per rank bucket
        ahead = _ % 4 < 2  # planned for the next round in half of them
        got, want = both(pool, front, edge, depth, depth_ms, verify_ms, valid, scale, ahead)
        assert got == want, (rows, k, depth, d_max, n_max, sharpness)
        scale_t = None if scale is None else torch.tensor(scale)
        tokens = expected_tokens(pool, n_max, valid, scale_t)
        assert tokens.tolist() == reference_expected_tokens(pool.tolist(), n_max, valid.tolist(), scale)
        assert int(verify_width(pool, depth, depth_ms, verify_ms, valid, scale_t, ahead)) == got[0]
        seen_go.add(got[2])
        widths.add(got[0])
    assert seen_go == {True, False} and len(widths) > 10  # the random rounds exercise every decision


def test_planned_ahead_width_0_is_a_plain_round():
    """Decided inside a round, the drafted depths are spent whatever the width; planned for the next round, width 0
    drafts nothing. With the H200 costs of SmolLM2 at batch 8 (a width-0 round 0.37 ms above a 1.03 ms plain step,
    one node 0.025 ms more) a barely confident drafter (top-1 at 5%) is worth one node only once its depth is spent."""
    rows, k = 8, 8
    pool = torch.full((rows, k), math.log(0.05 / k))
    pool[:, 0] = math.log(0.05)
    depth_ms, verify_ms = torch.tensor([0.374, 0.1825]), torch.tensor([1.026, 1.051, 1.046, 1.086])
    within, want = both(pool, pool, pool, 0, depth_ms, verify_ms)
    assert within == want and within[0] >= 1  # the round's depth 0 is spent: a node or two pay
    planned, want = both(pool, pool, pool, 0, depth_ms, verify_ms, ahead=True)
    assert planned == want and planned[0] == 0 and not planned[2]  # the next round: decode plainly
    sure = torch.full((rows, k), math.log(0.9 / k))
    sure[:, 0] = math.log(0.9)
    confident, want = both(sure, sure, sure, 0, depth_ms, verify_ms, ahead=True)
    assert confident == want and confident[0] >= 1  # a confident drafter still drafts


def test_expected_tokens_by_hand():
    pool = torch.tensor([[math.log(0.5), math.log(0.25), -math.inf], [math.log(0.75), 0.0, math.log(0.125)]])
    tokens = expected_tokens(pool, 8) / PROB_ONE
    assert tokens.tolist() == pytest.approx([2.0, 3.5, 4.5, 4.625], abs=4 / PROB_ONE)  # row 2 by 1, .75, .125
    masked = expected_tokens(pool, 1, torch.tensor([True, False])) / PROB_ONE  # a padded row adds nothing
    assert masked.tolist() == pytest.approx([1.0, 1.5], abs=2 / PROB_ONE)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_untrained_drafter_decodes_plainly(rows):
    k = 4
    flat = torch.full((rows, k), -math.log(32000.0))  # top-k of a flat 32k distribution
    depth_ms, verify_ms = linear_costs(6, 32, depth=0.3, plain=10.0, per_node=0.05)
    got, want = both(flat, flat, flat, 0, depth_ms, verify_ms)
    assert got == want == (0, True, False)
    # even a deeper flat pool verifies nothing
    pool, front, edge = draft_scores(torch.Generator().manual_seed(1), rows, k, 3, 32000, 0.0)
    got, want = both(pool, front, edge, 3, depth_ms, verify_ms)
    assert got == want and got[0] == 0 and not got[2]


def test_confident_drafter_with_cheap_depths_goes_deep_and_wide():
    d_max, n_max = 6, 24
    depth_ms, verify_ms = linear_costs(d_max, n_max, depth=0.05, plain=10.0, per_node=0.01)
    flags = []
    for depth in range(d_max):
        # the same seed each depth: depth d's tree is the prefix of depth d + 1's
        pool, front, edge = draft_scores(torch.Generator().manual_seed(2), 4, 4, depth, 50, 20.0)
        got, want = both(pool, front, edge, depth, depth_ms, verify_ms)
        assert got == want
        flags.append(got[2])
    assert flags == [True] * (d_max - 1) + [False]  # goes to the table's last depth
    assert got[0] == n_max and got[1] is False  # verifies as wide as allowed; the cap, not the criterion, ended it
    assert reference_next_sampled_depth(flags, d_max) == d_max


def test_dearer_verify_narrows_width():
    pool, front, edge = draft_scores(torch.Generator().manual_seed(3), 4, 4, 3, 50, 3.0)
    widths = []
    for per_node in (0.001, 0.02, 0.1, 0.5):
        depth_ms, verify_ms = linear_costs(6, 40, depth=0.1, plain=5.0, per_node=per_node)
        got, want = both(pool, front, edge, 3, depth_ms, verify_ms)
        assert got == want
        widths.append(got[0])
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]


def test_ties_pick_the_smaller_width():
    certain = torch.zeros(1, 1)  # one node of probability 1
    depth_ms = torch.tensor([1.0])
    # tokens 1 vs 2, cost 1 + 1 vs 1 + 3 ms: equal rates -> width 0
    for verify, width in (([1.0, 3.0], 0), ([1.0, 2.999], 1), ([1.0, 3.001], 0)):
        verify_ms = torch.tensor(verify)
        assert int(verify_width(certain, 0, depth_ms, verify_ms)) == width
        assert reference_verify_width([[0.0]], 0, [1.0], verify, [True]) == width


def test_width_never_exceeds_the_table():
    pool, front, edge = draft_scores(torch.Generator().manual_seed(4), 2, 4, 4, 50, 20.0)  # 52 confident nodes
    for n_max in (0, 1, 3):
        depth_ms, verify_ms = linear_costs(6, n_max, depth=0.05, plain=10.0, per_node=0.0001)
        got, want = both(pool, front, edge, 4, depth_ms, verify_ms)
        assert got == want and got[0] == n_max


def test_padded_rows_change_nothing():
    gen = torch.Generator().manual_seed(5)
    pool, front, edge = draft_scores(gen, 3, 4, 2, 50, 2.0)
    depth_ms, verify_ms = linear_costs(6, 32, depth=0.1, plain=5.0, per_node=0.05)
    alone = both(pool[:1], front[:1], edge[:1], 2, depth_ms, verify_ms)[0]
    pool[1:], front[1:], edge[1:] = 0.0, 0.0, 0.0  # garbage in the padded rows: certain nodes
    valid = torch.tensor([True, False, False])
    got, want = both(pool, front, edge, 2, depth_ms, verify_ms, valid)
    assert got == want == alone


def test_decisions_are_graph_friendly_tensors():
    """The tensor policy runs on the meta device, so it reads no value (no .item(), no host sync)."""
    pool, front = torch.empty(8, 20, device="meta"), torch.empty(8, 4, device="meta")
    depth_ms, verify_ms = torch.empty(5, device="meta"), torch.empty(33, device="meta")
    decision = decide_after_depth(pool, front, front, 1, depth_ms, verify_ms)
    assert decision.width.shape == () and decision.width.dtype == torch.int64
    assert decision.stop.dtype == decision.go.dtype == torch.bool and decision.go.shape == ()
    assert next_sampled_depth(torch.empty(3, dtype=torch.bool, device="meta"), 5).dtype == torch.int64
    cpu = decide_after_depth(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), 0, torch.ones(2), torch.ones(4))
    assert cpu.width.dtype == torch.int64 and cpu.stop.dtype == cpu.go.dtype == torch.bool


def test_next_sampled_depth():
    assert INITIAL_SAMPLED_DEPTH == 1
    cases = [([False], 5, 1), ([True, True, False], 5, 3), ([True, False, True], 5, 2),
             ([True, True], 5, 3), ([True] * 5, 5, 5), ([True, True, True], 2, 2)]
    for flags, d_max, want in cases:
        assert reference_next_sampled_depth(flags, d_max) == want
        assert int(next_sampled_depth(torch.tensor(flags), d_max)) == want
    gen = torch.Generator().manual_seed(6)
    for _ in range(100):
        flags = torch.rand(int(torch.randint(1, 8, (1,), generator=gen)), generator=gen) < 0.7
        assert int(next_sampled_depth(flags, 6)) == reference_next_sampled_depth(flags.tolist(), 6)


def test_chain_depth_for_batch():
    table = {1: 5, 8: 4, 64: 2}
    for batch, depth in ((1, 5), (2, 4), (8, 4), (9, 2), (64, 2), (500, 2)):
        assert chain_depth_for_batch(table, batch) == depth
    with pytest.raises(ValueError, match="table is empty"):
        chain_depth_for_batch({}, 1)
    with pytest.raises(ValueError, match="invalid"):
        chain_depth_for_batch({0: 3}, 1)
    with pytest.raises(ValueError, match="invalid"):
        chain_depth_for_batch({4: -1}, 1)
    with pytest.raises(ValueError, match="batch=0"):
        chain_depth_for_batch(table, 0)


def test_bad_inputs_name_the_argument():
    ok_depth, ok_verify = torch.ones(3), torch.ones(5)
    check_costs(ok_depth, ok_verify)
    with pytest.raises(ValueError, match="depth_ms.*negative"):
        check_costs(torch.tensor([0.1, -0.2]), ok_verify)
    with pytest.raises(ValueError, match="verify_ms.*non-empty"):
        check_costs(ok_depth, torch.ones(0))
    with pytest.raises(ValueError, match="verify_ms.*zero"):
        check_costs(ok_depth, torch.zeros(3))
    with pytest.raises(ValueError, match="depth_ms.*1-D"):
        check_costs(torch.ones(2, 2), ok_verify)
    pool = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="frontier_logp"):
        decide_after_depth(pool, torch.zeros(2, 3), torch.zeros(2, 2), 0, ok_depth, ok_verify)
    with pytest.raises(ValueError, match="depth=3"):
        decide_after_depth(pool, torch.zeros(2, 2), torch.zeros(2, 2), 3, ok_depth, ok_verify)
    with pytest.raises(ValueError, match="row_valid"):
        verify_width(pool, 0, ok_depth, ok_verify, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="pool_logp"):
        verify_width(torch.zeros(4), 0, ok_depth, ok_verify)
    with pytest.raises(ValueError, match="go_flags"):
        next_sampled_depth(torch.ones(0, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="max_depth"):
        next_sampled_depth(torch.ones(2, dtype=torch.bool), 0)


def test_a_drafter_whose_confidence_is_never_borne_out_decodes_plainly():
    """Calibration scale 0 (nothing it proposed was accepted): no width pays however sure the drafter is;
    scale 1 keeps the confident drafter's wide tree; a halved scale never verifies more."""
    gen = torch.Generator().manual_seed(3)
    pool, front, edge = draft_scores(gen, 4, 4, 3, 50, 8.0)
    depth_ms, verify_ms = linear_costs(5, 32, 0.05, 1.0, 0.01)
    widths = [both(pool, front, edge, 3, depth_ms, verify_ms, scale=s)[0][0] for s in (0, SCALE_ONE // 2, SCALE_ONE)]
    assert widths[0] == 0 and 0 < widths[1] <= widths[2]


def test_every_depth_at_once_decides_like_each_depth_alone():
    """Ahead mode evaluates the criterion after all of a round's depths at once (``decide_every_depth``): the same
    go flags and widths as ``decide_after_depth(ahead=True)`` after each depth, the next round's plan as
    ``reference_next_plan`` (the best-rated depth, drafted or one more), and the calibration's expected
    drafted tokens as ``expected_tokens``, bit for bit, on random rounds (trees and chains, padded rows,
    calibrated or not, tables deeper than the round or exactly as deep)."""
    from torchspec.runtime.controller_policy import decide_every_depth

    gen = torch.Generator().manual_seed(4)
    seen_go, seen_width, seen_plan = set(), set(), set()
    for i in range(300):
        rows, k = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        drafted = int(torch.randint(1, 6, (1,), generator=gen))
        d_max = drafted + int(torch.randint(0, 2, (1,), generator=gen))
        n_max = int(torch.randint(0, 40, (1,), generator=gen))
        depth_ms = 0.02 + torch.rand(d_max, generator=gen) * 0.5
        verify_ms = 1 + torch.cumsum(torch.rand(n_max + 1, generator=gen) * 0.3 - 0.05, 0).clamp(min=0.01)
        valid = torch.rand(rows, generator=gen) < 0.85
        scale = (None if i % 3 == 0 else torch.tensor(int(torch.randint(0, 2 * SCALE_ONE, (1,), generator=gen)))
                 if i % 6 < 3 else torch.randint(0, 4 * SCALE_ONE, (RANK_BUCKETS,), generator=gen))  # per rank bucket
        sharp = float(torch.rand(1, generator=gen)) * 8
        pools, children, sizes, want_go, want_width, each_pool = [], [], [], [], [], []
        for depth in range(drafted):  # depth d's tree is the prefix of the next one's (the same seed)
            pool, front, edge = draft_scores(torch.Generator().manual_seed(i), rows, k, depth, 50, sharp)
            got = decide_after_depth(pool, front, edge, depth, depth_ms, verify_ms, valid, scale, ahead=True)
            want_go.append(bool(got.go))
            want_width.append(int(got.width))
            each_pool.append(pool.tolist())
            children.append(front.double() + edge.double())
            sizes.append(pool.shape[1])
            pools = pool
        verified = int(torch.randint(0, min(pools.shape[1], n_max) + 1, (1,), generator=gen))
        plan = decide_every_depth(pools, sizes, torch.stack(children), depth_ms, verify_ms, valid, scale, verified)
        assert plan.go.tolist() == want_go and plan.width.tolist() == want_width, (i, rows, k, drafted, d_max, n_max)
        want_plan = reference_next_plan(each_pool, front.tolist(), edge.tolist(), depth_ms.tolist(), verify_ms.tolist(),
                                        valid.tolist(), None if scale is None else scale.tolist())
        assert (int(plan.next_depth), int(plan.next_width)) == want_plan
        seen_plan.add(want_plan)
        expect = int(expected_tokens(pools, verified, valid)[-1]) - int(valid.sum()) * PROB_ONE
        assert int(plan.drafted) == expect
        seen_go.update(want_go)
        seen_width.update(want_width)
    assert seen_go == {True, False} and len(seen_width) > 8
    assert len({d for d, _ in seen_plan}) >= 4 and len({w for _, w in seen_plan}) > 8  # every depth, one more too


def test_a_scale_per_rank_bucket_weighs_each_rank_by_its_bucket():
    """One scale in every bucket is the single scale; a bucket's scale moves only the widths that reach its ranks
    (ranks 1, 2-3, 4-7, ...), in the tensor version and the reference alike."""
    from torchspec.runtime.controller_policy import rank_bucket, rank_buckets

    assert [rank_bucket(r) for r in (0, 1, 2, 3, 6, 7, 14, 15, 30, 31, 500)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert rank_buckets(40, torch.device("cpu")).tolist() == [rank_bucket(r) for r in range(40)]
    gen = torch.Generator().manual_seed(5)
    pool, _, _ = draft_scores(gen, 3, 4, 2, 50, 2.0)  # 36 nodes a row
    valid = torch.tensor([True, False, True])
    one = expected_tokens(pool, 36, valid, torch.tensor(3 * SCALE_ONE // 2))
    assert one.tolist() == expected_tokens(pool, 36, valid, torch.full((RANK_BUCKETS,), 3 * SCALE_ONE // 2)).tolist()
    lifted = [SCALE_ONE] * RANK_BUCKETS
    lifted[3] = 4 * SCALE_ONE  # ranks 7-14
    plain, more = expected_tokens(pool, 36, valid).tolist(), expected_tokens(pool, 36, valid, torch.tensor(lifted)).tolist()
    assert more[:8] == plain[:8] and all(m > p for m, p in zip(more[8:], plain[8:]))  # widths 8+ reach rank 7
    assert more == reference_expected_tokens(pool.tolist(), 36, valid.tolist(), lifted)
