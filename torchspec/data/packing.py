"""Sequence packing: several tokenized conversations per row, so micro-batches carry almost no padding.

``pack_examples`` turns the training examples (one conversation each, at most ``max_length``
tokens) into packed rows of at most ``max_length`` tokens by best-fit decreasing: conversations
longest first, each into the open row with the least room that still fits it, else a new row.
Each packed row is an ``Example`` whose ``document_lengths`` lists its conversations in order; its
``loss_mask`` is theirs, concatenated. ``collate`` turns that into the per-token ``position_ids``
(restarting at 0 in each document) and ``document_ids`` (0, 1, 2, ... in the row; -1 on padding)
that the target's forward and the drafter's TTT attention use to keep documents apart.

Packing happens once, before sampling, and is a pure function of the examples (ties broken by
their order), so ``ResumableBatchSampler`` samples packed rows exactly as it samples single
conversations: same seed -> same batches, and a resumed run sees what an uninterrupted one would.
The price is that a row's conversations stay together in every epoch (rows are reshuffled, their
contents are not).

Toy example, max_length 8, conversations of lengths [5, 3, 6, 2, 4]: sorted 6, 5, 4, 3, 2 ->
row 0 = [6, 2], row 1 = [5, 3], row 2 = [4] (the 4 fits nowhere else). Row 0's document_ids are
``0 0 0 0 0 0 1 1`` and its position_ids ``0 1 2 3 4 5 0 1``.
"""

from __future__ import annotations

import bisect

import torch

from torchspec.data.dataset import Example


def pack_examples(examples: list[Example], max_length: int) -> list[Example]:
    """Best-fit-decreasing packing of single-conversation ``examples`` into rows of <= ``max_length``.

    Every example lands in exactly one row, whole (truncation to ``max_length`` happened at
    tokenization). Rows come out in the order they were opened. O(n log n) plus list moves.
    """
    if max_length < 1:
        raise ValueError(f"max_length={max_length} must be >= 1")
    lengths = [len(e) for e in examples]
    too_long = [n for n in lengths if n > max_length]
    if too_long:
        raise ValueError(f"{len(too_long)} examples are longer than max_length={max_length} (longest "
                         f"{max(too_long)}); tokenize with the same max_length you pack with")
    if any(e.document_lengths is not None for e in examples):
        raise ValueError("pack_examples got already packed examples; pack the tokenized conversations once")
    order = sorted(range(len(examples)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row index) of every row, sorted: best fit = first that fits
    for i in order:
        slot = bisect.bisect_left(room, (lengths[i], -1))
        if slot == len(room):
            rows.append([i])
            free, row = max_length - lengths[i], len(rows) - 1
        else:
            free, row = room.pop(slot)
            rows[row].append(i)
            free -= lengths[i]
        if free > 0:
            bisect.insort(room, (free, row))
    return [_join([examples[i] for i in row]) for row in rows]


def _join(docs: list[Example]) -> Example:
    return Example(
        input_ids=torch.cat([d.input_ids for d in docs]),
        loss_mask=torch.cat([d.loss_mask for d in docs]),
        document_lengths=tuple(len(d) for d in docs),
    )


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> [B, T] position of each token inside its document (no host sync).

    A document starts wherever the id changes (and at t = 0), so padding (-1) after the last
    document counts as one more run, from 0; collate's own position_ids continue the last
    document's positions into padding instead, and both are fine: padding is masked everywhere.
    """
    b, t = document_ids.shape
    steps = torch.arange(t, device=document_ids.device).expand(b, t)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, steps, torch.zeros_like(steps)).cummax(dim=1).values  # [B, T] start of own run
    return steps - first
