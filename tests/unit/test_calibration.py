"""torchspec.runtime.calibration: how far the drafter's confidence is borne out, kept on the device.

The decayed ratio and its drift back without evidence, a scale per rank bucket from that bucket's own
evidence, the exponent an underconfident drafter is read with, and the averaged plan tables the calibration
holds for ahead mode (one per drafted shape, at one address). The controller that reads it in the engine is
``test_controlled_drafting.py``'s.

    HF_HUB_OFFLINE=1 python -m pytest -q tests/unit/test_calibration.py
"""

from __future__ import annotations

import pytest
import torch

from torchspec.runtime.calibration import ALPHAS, Calibration
from torchspec.runtime.controller_policy import RANK_BUCKETS, SCALE_ONE


def _pending(per_exponent: list[float], bucket: int = 0) -> torch.Tensor:
    """A round's evidence [A, RANK_BUCKETS + 1]: each exponent's expectation, all of it in one rank bucket."""
    out = torch.zeros(len(ALPHAS), RANK_BUCKETS + 1, dtype=torch.float64)
    out[:, bucket] = out[:, -1] = torch.tensor(per_exponent, dtype=torch.float64)
    return out


def test_calibration_is_the_decayed_ratio_and_drifts_back_without_evidence():
    cal = Calibration(torch.device("cpu"), decay=0.5, prior=0.25)
    nowhere = torch.zeros(2, 4, dtype=torch.long)  # the accepted paths' ranks (nothing accepted: not read)
    alpha, scale = cal.choice()
    assert float(alpha) == 1.0 and scale.tolist() == [SCALE_ONE] * RANK_BUCKETS  # no evidence: the confidence as is
    cal.pending = _pending([3.0, 4.0, 5.0, 6.0])  # under each exponent, all of it at rank 0
    cal.observe(torch.tensor([0, 0]), nowhere, torch.tensor([True, True]))
    alpha, scale = cal.choice()  # nothing accepted: a = 1 expected least, so it is nearest
    overall = 0.25 / 3.25  # all nodes; rank 0's bucket its own evidence, its prior pulled to that; the rest: overall
    assert float(alpha) == 1.0 and scale.tolist() == ([round(0.25 * overall / 3.25 * SCALE_ONE)]
                                                      + [round(overall * SCALE_ONE)] * (RANK_BUCKETS - 1))
    scales = []
    for _ in range(8):  # rounds that verify nothing: the evidence decays, the scale returns toward 1
        cal.pending = _pending([0.0] * 4)
        cal.observe(torch.tensor([0, 0]), nowhere, torch.tensor([True, True]))
        scales.append(int(cal.choice()[1][0]))
    assert scales == sorted(scales) and scales[-1] > 0.9 * SCALE_ONE
    cal.pending = _pending([1.0] * 4)
    ranks = torch.tensor([[0, 1, 3, 7], [0, 2, 5, 9]])  # the accepted paths' nodes by rank: buckets 0, 1, 2, 3
    cal.observe(torch.tensor([4, 9]), ranks, torch.tensor([True, False]))  # a padded row's count is not evidence
    assert float(cal.accepted) == pytest.approx(4.0 + 0.0, abs=1e-2)
    assert cal.accepted_by_rank[:4].tolist() == pytest.approx([1.0 + 0.0] * 4, abs=1e-2)
    evidence = (float(cal.accepted), cal.expected.tolist(), cal.accepted_by_rank.tolist(), cal.expected_by_rank.tolist())
    cal.pending = _pending([0.0] * 4)
    cal.observe(torch.tensor([4, 9]), ranks, torch.tensor([False, False]))  # an idle run (a graph warm-up): no change
    assert (float(cal.accepted), cal.expected.tolist(), cal.accepted_by_rank.tolist(),
            cal.expected_by_rank.tolist()) == evidence


def test_each_rank_bucket_is_scaled_by_its_own_evidence():
    """A drafter overconfident along its best path accepts its lower-ranked nodes more than it expects them: the
    buckets that are borne out more are scaled up, those borne out less down, each by its own ratio."""
    cal = Calibration(torch.device("cpu"), decay=0.9)
    logp = torch.log(torch.tensor([[0.9, 0.05, 0.03, 0.01, 0.01, 0.005]]))  # ranks 0-5: buckets 0, 1, 1, 2, 2, 2
    for i in range(40):  # the best node accepted in a quarter of the rounds; a second path (ranks 2, 3) in half
        cal.pending = cal.evidence(logp, 6, torch.tensor([True]))
        ranks, got = (torch.tensor([[2, 3, 0, 0, 0]]), 2) if i % 2 else (torch.tensor([[0, 1, 0, 0, 0]]), int(i % 4 == 0))
        cal.observe(torch.tensor([got]), ranks, torch.tensor([True]))
    alpha, scale = cal.choice()
    at = ALPHAS.index(float(alpha))
    overall = (float(cal.accepted) + 0.25) / (float(cal.expected[at]) + 0.25)
    want = [round(min((acc + 0.25 * overall) / (exp + 0.25), 4.0) * SCALE_ONE)
            for acc, exp in zip(cal.accepted_by_rank.tolist(), cal.expected_by_rank[at].tolist())]
    assert scale.tolist() == want
    assert scale[1] > SCALE_ONE > scale[0] and scale[2] > SCALE_ONE  # the second path: under-read; the first: over
    assert scale[3:].tolist() == [round(min(overall, 4.0) * SCALE_ONE)] * (RANK_BUCKETS - 3)  # never verified: all


def test_an_underconfident_drafter_is_read_with_a_smaller_exponent():
    """Greedy verification accepts a drafter whose paths it gave 0.2^d: the exponent whose expectation is
    nearest the accepted tokens is chosen (not a scale capped at ``most``), and the scales are what remains."""
    cal = Calibration(torch.device("cpu"))
    logp = torch.log(torch.tensor([[0.2, 0.04, 0.008, 0.0016]]))  # one row, a chain of 4 (ranks 0-3: buckets 0, 1, 1, 2)
    cal.pending = cal.evidence(logp, 4, torch.tensor([True]))
    want = [[p ** a for p in (0.2, 0.04, 0.008, 0.0016)] for a in ALPHAS]
    by_bucket = [[w[0], w[1] + w[2], w[3], 0.0, 0.0, 0.0, sum(w)] for w in want]
    assert cal.pending.tolist() == [pytest.approx(row, rel=1e-5, abs=1e-6) for row in by_bucket]
    for _ in range(20):  # every round accepts 3 of the 4
        cal.pending = cal.evidence(logp, 4, torch.tensor([True]))
        cal.observe(torch.tensor([3]), torch.tensor([[0, 1, 2, 3]]), torch.tensor([True]))
    alpha, scale = cal.choice()
    ratios = [(float(cal.accepted) + 0.25) / (e + 0.25) for e in cal.expected.tolist()]  # per exponent
    assert ratios[0] > 4  # beyond the scale's cap: a = 1 alone could not say how good this drafter is
    assert float(alpha) == ALPHAS[min(range(len(ALPHAS)), key=lambda i: max(ratios[i], 1 / ratios[i]))] < 1
    assert 0.5 * SCALE_ONE < int(scale[0]) < 2 * SCALE_ONE
    assert cal.evidence(logp, 0, torch.tensor([True])).tolist() == [[0.0] * (RANK_BUCKETS + 1)] * len(ALPHAS)


def test_averaged_plan_tables_are_one_per_shape_unrated_and_kept():
    """``averages_for``: [depths, widths] int64, every entry -1 (never rated), the same tensor for the same shape
    (CUDA graphs capture its address), another for another shape or size."""
    cal = Calibration(torch.device("cpu"))
    tree = cal.averages_for("tree", 5, 33)
    assert tree.shape == (5, 33) and tree.dtype == torch.long and bool((tree == -1).all())
    tree[1, 2] = 7
    assert cal.averages_for("tree", 5, 33) is tree and int(cal.averages_for("tree", 5, 33)[1, 2]) == 7
    chain = cal.averages_for("chain", 5, 6)
    assert chain is not tree and chain.shape == (5, 6) and cal.averages_for("tree", 4, 33) is not tree
