"""Pruned draft vocabulary: frequency counting under the loss mask and the d2t/t2d mapping (contract 7)."""

from __future__ import annotations

import pytest
import torch

from torchspec.data.dataset import Example
from torchspec.data.vocab import build_vocab_mapping, token_frequencies, vocab_coverage
from torchspec.models.eagle3 import check_vocab_mapping


def example(ids, mask):
    return Example(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long))


def test_hand_example_of_the_docstring():
    freqs = torch.tensor([0, 5, 2, 5, 0, 1, 9, 0])
    d2t, t2d = build_vocab_mapping(freqs, 4)
    assert d2t.tolist() == [1, 1, 1, 3]
    assert t2d.tolist() == [False, True, True, True, False, False, True, False]
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    check_vocab_mapping(d2t, t2d, 8, 4)


def test_offsets_map_draft_ids_to_the_chosen_target_ids():
    g = torch.Generator().manual_seed(0)
    freqs = torch.randint(0, 1000, (500,), generator=g)
    d2t, t2d = build_vocab_mapping(freqs, 64)
    target_ids = torch.arange(64) + d2t
    assert target_ids.tolist() == t2d.nonzero().flatten().tolist()  # ascending, exactly the t2d ids
    top = set(torch.sort(freqs, descending=True, stable=True).indices[:64].tolist())
    assert set(target_ids.tolist()) == top
    # every kept id is at least as frequent as every dropped one
    assert int(freqs[t2d].min()) >= int(freqs[~t2d].max())
    check_vocab_mapping(d2t, t2d, 500, 64)


def test_ties_are_broken_by_smaller_id():
    freqs = torch.tensor([3, 7, 3, 3, 7, 3])
    d2t, t2d = build_vocab_mapping(freqs, 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 4]  # both 7s, then the smallest of the 3s
    d2t_b, _ = build_vocab_mapping(freqs.clone(), 3)
    assert torch.equal(d2t, d2t_b)
    assert (torch.arange(2) + build_vocab_mapping(torch.full((5,), 4), 2)[0]).tolist() == [0, 1]


def test_fill_with_lowest_unused_ids_when_too_few_tokens_occur():
    freqs = torch.tensor([0, 5, 2, 5, 0, 1, 9, 0])
    d2t, t2d = build_vocab_mapping(freqs, 6)
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 2, 3, 5, 6]
    assert d2t.tolist() == [0, 0, 0, 0, 1, 1]
    d2t, t2d = build_vocab_mapping(torch.tensor([0, 0, 0, 4, 0]), 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 3]
    check_vocab_mapping(d2t, t2d, 5, 3)


def test_full_size_draft_vocab_is_the_identity():
    d2t, t2d = build_vocab_mapping(torch.tensor([1, 0, 3, 2]), 4)
    assert d2t.tolist() == [0, 0, 0, 0] and bool(t2d.all())


def test_counts_only_loss_masked_tokens():
    examples = [
        example([1, 2, 3, 3, 4], [0, 0, 1, 1, 1]),
        example([2, 2, 5, 0], [1, 0, 1, 0]),
        example([4, 4], [0, 0]),  # prompt only: contributes nothing
    ]
    freqs = token_frequencies(examples, 7)
    assert freqs.tolist() == [0, 0, 1, 2, 1, 1, 0]
    assert freqs.dtype == torch.long


def test_counting_rejects_ids_beyond_the_vocab():
    with pytest.raises(ValueError, match=r"example 0 holds token ids 1\.\.9 outside \[0, 8\)"):
        token_frequencies([example([1, 9], [1, 1])], 8)


@pytest.mark.parametrize("size", [0, 9])
def test_draft_vocab_size_out_of_range_refused(size):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_mapping(torch.ones(8, dtype=torch.long), size)


def test_coverage():
    freqs = torch.tensor([0, 5, 2, 5, 0, 1, 9, 0])
    _, t2d = build_vocab_mapping(freqs, 4)
    assert vocab_coverage(freqs, t2d) == pytest.approx(21 / 22)


def test_frequencies_over_more_tokens_than_one_count_batch():
    """Five 300K-token examples (1.5M tokens): every masked token is counted exactly once."""
    g = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(0, 500, (300_000,), generator=g), torch.randint(0, 2, (300_000,), generator=g))
                for _ in range(5)]
    expected = torch.bincount(torch.cat([e.input_ids[e.loss_mask.bool()] for e in examples]), minlength=500)
    assert torch.equal(token_frequencies(examples, 500), expected)
