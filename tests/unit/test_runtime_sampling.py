"""Logits processing against hand-computed distributions, parameter validation, and the samplers'
exact frequencies (chi-square against the sequential without-replacement probabilities, with a
biased sampler as the positive control)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.stats import chi2_pvalue
from torchspec.runtime.sampling import (
    RowSampling,
    SamplingParams,
    process_logits,
    remove_and_renormalise,
    sample,
    sample_without_replacement,
)

INF = float("inf")
P5 = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])  # dyadic: every prefix mass is exact


def probs_of(logits: torch.Tensor, **kw) -> torch.Tensor:
    return process_logits(logits, SamplingParams(**kw))


def norm(x: list[float]) -> torch.Tensor:
    t = torch.tensor(x)
    return t / t.sum()


# ---------------------------------------------------------------- process_logits


@pytest.mark.parametrize("kw, expected", [
    ({"temperature": 1.0}, P5.tolist()),
    ({"temperature": 1.0, "top_k": 2}, [2 / 3, 1 / 3, 0, 0, 0]),
    ({"temperature": 1.0, "top_k": 9}, P5.tolist()),  # k > V keeps everything
    ({"temperature": 1.0, "top_p": 0.7}, [2 / 3, 1 / 3, 0, 0, 0]),  # 0.5 < 0.7 <= 0.75
    ({"temperature": 1.0, "top_p": 0.8}, (P5[:3] / 0.875).tolist() + [0, 0]),
    ({"temperature": 1.0, "top_p": 0.3}, [1, 0, 0, 0, 0]),  # top-1 alone exceeds top_p: kept anyway
    ({"temperature": 1.0, "top_p": 1e-6}, [1, 0, 0, 0, 0]),
    # top-k first, then the nucleus of the RENORMALISED top-k: [2/3, 1/3] -> 2/3 >= 0.6 alone
    ({"temperature": 1.0, "top_k": 2, "top_p": 0.6}, [1, 0, 0, 0, 0]),
    ({"temperature": 2.0}, (P5.sqrt() / P5.sqrt().sum()).tolist()),
    ({"temperature": 0.5, "top_k": 3}, (P5[:3] ** 2 / (P5[:3] ** 2).sum()).tolist() + [0, 0]),
    ({"temperature": 0.0}, [1, 0, 0, 0, 0]),
])
def test_process_logits_hand_computed(kw, expected):
    # shuffle the vocabulary so that order in the vocabulary is not order by probability
    perm = torch.tensor([3, 0, 4, 2, 1])
    out = probs_of(P5.log()[perm], **kw)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32)[perm], atol=1e-6, rtol=0)


def test_process_logits_ties_break_to_lower_token_id():
    logits = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    e = math.e
    cases = {
        (1.0, 1.0, 1): [0, 1, 0, 0, 0],
        (1.0, 1.0, 2): [0, 1, 1, 0, 0],
        (1.0, 1.0, 4): [1, e, e, 0, e],  # of the two tied zeros, the lower id is kept
        # each tied top token holds e / (3e + 2) = 0.26: top_p 0.2 keeps one, 0.3 two, 0.6 three
        (1.0, 0.2, 0): [0, 1, 0, 0, 0],
        (1.0, 0.3, 0): [0, 1, 1, 0, 0],
        (1.0, 0.6, 0): [0, 1, 1, 0, 1],
        (0.0, 1.0, 0): [0, 1, 0, 0, 0],
    }
    for (t, top_p, top_k), expected in cases.items():
        out = probs_of(logits, temperature=t, top_p=top_p, top_k=top_k)
        torch.testing.assert_close(out, norm(expected), atol=1e-6, rtol=0)


def test_process_logits_with_neg_inf_logits():
    # an efficient LM head scores a candidate subset; everything else is -inf
    logits = torch.tensor([-INF, 2.0, -INF, 1.0, -INF, 0.0])
    e = math.e
    cases = {
        (1.0, 1.0, 0): norm([0, e * e, 0, e, 0, 1]),
        (1.0, 1.0, 2): norm([0, e * e, 0, e, 0, 0]),
        (1.0, 1.0, 5): norm([0, e * e, 0, e, 0, 1]),  # k beyond the finite candidates
        (1.0, 0.5, 0): torch.tensor([0.0, 1, 0, 0, 0, 0]),  # p(top-1) = 0.665 >= 0.5
        (1.0, 0.9, 4): norm([0, e * e, 0, e, 0, 0]),  # 0.665 < 0.9 <= 0.91
        (0.0, 1.0, 0): torch.tensor([0.0, 1, 0, 0, 0, 0]),
        (2.0, 1.0, 0): norm([0, e, 0, e**0.5, 0, 1]),
    }
    for (t, top_p, top_k), expected in cases.items():
        out = probs_of(logits, temperature=t, top_p=top_p, top_k=top_k)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_process_logits_batched_fp32_and_rowwise():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g).to(torch.bfloat16)
    params = SamplingParams(temperature=0.8, top_p=0.7, top_k=6)
    out = process_logits(logits, params)
    assert out.shape == (2, 3, 11) and out.dtype == torch.float32
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 3))
    for i, j in itertools.product(range(2), range(3)):
        torch.testing.assert_close(out[i, j], process_logits(logits[i, j], params))
    assert ((out > 0).sum(-1) <= 6).all()


def test_row_sampling_filters_only_when_a_sampled_row_asks():
    t1, greedy = SamplingParams(temperature=1.0), SamplingParams()
    assert not RowSampling.of([t1, greedy, SamplingParams(temperature=0.5)], "cpu").filtered
    assert not RowSampling.of([t1, SamplingParams(top_p=0.5, top_k=3)], "cpu").filtered  # a greedy row's filter is moot
    assert RowSampling.of([t1, SamplingParams(temperature=0.7, top_p=0.9)], "cpu").filtered
    assert RowSampling.of([SamplingParams(temperature=1.0, top_k=4), greedy], "cpu").filtered


def test_unfiltered_rows_give_the_filtered_paths_probabilities_exactly():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 50, generator=g)
    logits[1, :, 7:20] = -INF  # an efficient head's sparse logits
    rows = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.6)]
    fast = RowSampling.of(rows, "cpu")
    assert not fast.filtered
    slow = RowSampling(fast.temperature, fast.top_p, fast.top_k, greedy=False, filtered=True)
    assert torch.equal(process_logits(logits, fast), process_logits(logits, slow))  # bit for bit
    # positive control: where a row does ask for top-p, skipping the filter would change its distribution
    nucleus = RowSampling.of([SamplingParams(temperature=1.0, top_p=0.5)] * 3, "cpu")
    skipped = RowSampling(nucleus.temperature, nucleus.top_p, nucleus.top_k, filtered=False)
    assert not torch.equal(process_logits(logits, nucleus), process_logits(logits, skipped))


@pytest.mark.parametrize("kw, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
])
def test_params_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw).validate()


def test_params_valid_and_greedy():
    SamplingParams().validate()
    SamplingParams(temperature=0.7, top_p=1.0, top_k=0).validate()
    SamplingParams(temperature=1.5, top_p=1e-3, top_k=1).validate()
    assert SamplingParams().greedy and not SamplingParams(temperature=0.1).greedy


# ---------------------------------------------------------------- samplers


def pair_counts(ids: torch.Tensor, v: int) -> torch.Tensor:
    return torch.bincount(ids[:, 0] * v + ids[:, 1], minlength=v * v).reshape(v, v)


def exact_pairs(p: torch.Tensor) -> torch.Tensor:
    """P(first draw a, second draw b) without replacement: p_a p_b / (1 - p_a), 0 on the diagonal."""
    pairs = p[:, None] * p[None, :] / (1 - p[:, None])
    return pairs.fill_diagonal_(0.0)


Q5 = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05], dtype=torch.float64)
ROWS = 200_000


def test_sample_without_replacement_first_two_draws_are_exact():
    g = torch.Generator().manual_seed(1)
    ids, valid = sample_without_replacement(Q5.float().expand(ROWS, 5), 3, g)
    assert ids.shape == valid.shape == (ROWS, 3) and valid.all()
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # three distinct tokens per row
    pv = chi2_pvalue(pair_counts(ids, 5), exact_pairs(Q5))
    print(f"w/o replacement, first two draws: p = {pv:.3g}")
    assert pv > 1e-3
    pv1 = chi2_pvalue(torch.bincount(ids[:, 0], minlength=5), Q5)
    assert pv1 > 1e-3


def test_chi_square_rejects_a_biased_sampler():
    # Positive control: the Gumbel race on probabilities instead of log-probabilities is a
    # plausible bug; the same test at the same size must reject it.
    g = torch.Generator().manual_seed(1)
    probs = Q5.float().expand(ROWS, 5)
    u = torch.rand(probs.shape, generator=g).clamp_min(1e-30)
    ids = (probs - torch.log(-torch.log(u))).topk(2, dim=-1).indices
    pv = chi2_pvalue(pair_counts(ids, 5), exact_pairs(Q5))
    print(f"biased sampler: p = {pv:.3g}")
    assert pv < 1e-6


def test_sample_frequencies_and_generator_determinism():
    g = torch.Generator().manual_seed(2)
    ids = sample(Q5.float().expand(ROWS, 5), g)
    assert ids.shape == (ROWS,)
    assert chi2_pvalue(torch.bincount(ids, minlength=5), Q5) > 1e-3
    a = sample_without_replacement(Q5.float().expand(7, 5), 2, torch.Generator().manual_seed(3))[0]
    b = sample_without_replacement(Q5.float().expand(7, 5), 2, torch.Generator().manual_seed(3))[0]
    assert torch.equal(a, b)


def test_zero_probability_tokens_are_never_drawn():
    g = torch.Generator().manual_seed(4)
    p = torch.tensor([0.0, 0.5, 0.0, 0.5 - 1e-30, 0.0, 1e-30])  # three tokens with p > 0, one tiny
    ids, valid = sample_without_replacement(p.expand(50_000, 6), 5, g)
    assert valid[:, :3].all() and not valid[:, 3:].any()
    assert (ids[:, 3:] == 0).all()  # documented fill: token 0
    drawn = ids[:, :3].sort(-1).values
    assert (drawn == torch.tensor([1, 3, 5])).all()
    one = sample(p.expand(50_000, 6), g)
    assert ((one == 1) | (one == 3) | (one == 5)).all()
    # -inf logits through process_logits: the unscored tokens are never drawn either
    logits = torch.tensor([-INF, 0.3, -INF, -INF, 1.0, -INF]).expand(50_000, 6)
    ids, valid = sample_without_replacement(process_logits(logits, SamplingParams(temperature=1.3)), 3, g)
    assert valid[:, :2].all() and not valid[:, 2].any()
    assert ((ids[:, :2] == 1) | (ids[:, :2] == 4)).all()


def test_remove_and_renormalise():
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    out = remove_and_renormalise(q, torch.tensor([[0, 2], [3, 3]]))
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.75, 0.0, 0.25], [1 / 3, 1 / 3, 1 / 3, 0.0]]))
    empty = remove_and_renormalise(q[:1], torch.tensor([[0, 1, 2, 3]]))
    assert torch.equal(empty, torch.zeros(1, 4))  # nothing left: zeros, not NaN
    # the next draw without replacement after ids is a draw from the renormalised remainder
    q3 = q[None].expand(5, 2, 4)
    assert remove_and_renormalise(q3, torch.zeros(5, 2, 1, dtype=torch.long)).shape == (5, 2, 4)
