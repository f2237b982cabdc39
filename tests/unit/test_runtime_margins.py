"""`torchspec/runtime/margins.py`: bf16 ulps, top-2 margins on hand-built logits, the prefix recompute.

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline DS_ACCELERATOR=cpu \\
        python -m pytest -q tests/unit/test_runtime_margins.py

The margin helper decides whether a bf16 divergence is allowed (a near-tie) or a bug, so each piece
is pinned on numbers worked out by hand, and the recompute is checked to score the right position:
the argmax of ``prefix_logits(prompt + out[:j])`` must be the plain greedy decoder's token j (an
off-by-one there would measure the margin of the wrong token).
"""

from __future__ import annotations

import pytest
import torch

from tests.runtime_pair import build_pair
from torchspec.runtime.loading import load_engine
from torchspec.runtime.margins import bf16_ulp, divergence, first_difference, measure, prefix_logits

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bf16_ulp_by_hand():
    assert bf16_ulp(1.0) == 2.0**-7
    assert bf16_ulp(1.99) == 2.0**-7
    assert bf16_ulp(10.0) == 2.0**-4  # 8 <= 10 < 16
    assert bf16_ulp(-3.0) == 2.0**-6
    assert bf16_ulp(0.75) == 2.0**-8
    assert bf16_ulp(0.0) > 0
    # the spacing really is bf16's: x + ulp is the next bf16 number, x + ulp / 4 rounds back to x
    for x in (1.0, 10.0, 0.75, 37.5):
        up = torch.tensor(x + bf16_ulp(x)).bfloat16().float().item()
        assert up == x + bf16_ulp(x)
        assert torch.tensor(x + bf16_ulp(x) / 4).bfloat16().float().item() == x


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 2]) is None  # a prefix: no token differs
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([4], [5, 6]) == 0


def hand_logits(top: float, second: float, third: float = -5.0) -> torch.Tensor:
    logits = torch.full((10,), third - 1.0)
    logits[3], logits[7], logits[1] = top, second, third
    return logits


def test_measure_top2_near_tie_by_hand():
    m = measure(hand_logits(10.0, 10.0 - 0.125), (3, 7))  # ulp(10) = 1/16: the gap is 2 ulps exactly
    assert m.margin == pytest.approx(0.125) and m.margin_ulps == pytest.approx(2.0)
    assert m.top2 and m.top2_ids == [3, 7] and m.top1 == 10.0
    assert m.gap_ulps == pytest.approx(2.0) and m.lag_ulps == 0.0
    assert m.near_tie and not m.suspect
    assert not m.bf16_tie  # 10 and 9.875 are distinct bf16 numbers
    assert measure(hand_logits(10.0, 10.0 - 0.125), (7, 3)).near_tie  # order of the pair does not matter


def test_measure_suspect_by_hand():
    m = measure(hand_logits(10.0, 10.0 - 0.1875), (3, 7))  # 3 ulps: a bug, not rounding
    assert m.margin_ulps == pytest.approx(3.0) and m.suspect
    assert m.as_dict()["suspect"] is True
    # a diverging token that is not in the top 2: the pair's gap is what decides
    m = measure(hand_logits(10.0, 10.0 - 0.0625, third=9.0), (3, 1))
    assert not m.top2 and m.margin_ulps == pytest.approx(1.0) and m.gap_ulps == pytest.approx(16.0) and m.suspect
    # neither token is the argmax: they may tie with each other, but lag far behind the top-1
    logits = hand_logits(10.0, 9.0, third=9.0)
    m = measure(logits, (7, 1))
    assert m.gap_ulps == 0.0 and m.lag_ulps == pytest.approx(16.0) and m.suspect


def test_measure_bf16_tie():
    m = measure(hand_logits(10.0, 10.0 - 0.01), (3, 7))  # both round to bf16 10.0
    assert m.bf16_tie and m.near_tie and m.margin_ulps == pytest.approx(0.16, rel=1e-3)


def test_prefix_logits_score_the_next_token(tmp_path):
    target, drafter = build_pair(tmp_path, None)
    engine = load_engine(target, drafter, device="cpu", dtype="float32", max_batch=1, max_context=64, page_size=4)
    prompt = [5, 17, 99, 3, 250]
    out = engine.generate([prompt], max_new_tokens=8, ignore_eos=True)[0].token_ids
    for j in range(len(out)):
        logits = prefix_logits(engine.decoder, prompt + out[:j])
        assert logits.dtype == torch.float32 and logits.shape == (engine.decoder.vocab_size,)
        assert int(logits.argmax()) == out[j], j
    assert divergence(engine.decoder, prompt, out, out) is None
    assert divergence(engine.decoder, prompt, out, out[:3]) is None
    wrong = list(out)
    logits = prefix_logits(engine.decoder, prompt + out[:2])
    wrong[2] = int(logits.argmin())  # the worst token: far from a tie
    d = divergence(engine.decoder, prompt, out, wrong)
    assert d["position"] == 2 and d["tokens"] == [out[2], wrong[2]] and d["suspect"] and not d["top2"]
    assert d["margin"] == pytest.approx(float(logits.topk(2).values[0] - logits.topk(2).values[1]), rel=1e-5)
    second = int(logits.topk(2).indices[1])
    wrong[2] = second  # the runner-up: a near-tie exactly when the measured margin is <= 2 ulps
    d = divergence(engine.decoder, prompt, out, wrong)
    assert d["top2"] and d["near_tie"] == (d["margin_ulps"] <= 2.0)
