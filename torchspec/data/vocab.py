"""Pruned draft vocabularies for EAGLE-3: count the tokens the drafter must learn to propose and
keep the most frequent ones.

Only tokens under the loss mask are counted: the assistant tokens, which are exactly the tokens a
TTT step is scored on (contract 3: "mask of the predicted token") and the tokens the target
generates in serving. Prompt, system and chat-template tokens are read, never drafted, so counting
them would spend draft-vocabulary slots on tokens the drafter never has to propose. (SpecForge
counts the same way.)

Mapping format (contract 7, what ``Eagle3Drafter.set_vocab_mapping`` takes): the chosen target ids
in ascending order are draft ids 0..Vd-1; ``d2t[i] = target_id[i] - i`` is an offset (target id =
i + d2t[i]) and ``t2d`` a bool mask over the target vocabulary.

Build the mapping from the training split only (never the held-out split), over the whole split
on every rank: the count is deterministic, so every data-parallel rank gets the same mapping.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from torchspec.data.dataset import Example


def token_frequencies(examples: Iterable[Example], vocab_size: int) -> torch.Tensor:
    """Count each target token id under the loss mask of ``examples`` -> long [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for n, ex in enumerate(examples):
        ids = ex.input_ids[ex.loss_mask.bool()]
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(
                f"token_frequencies: example {n} holds token ids {int(ids.min())}..{int(ids.max())} outside "
                f"[0, {vocab_size}); pass the target's vocab_size (the embedding size, not len(tokenizer))."
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_vocab_mapping(freqs: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``draft_vocab_size`` most frequent target ids -> (d2t long [Vd], t2d bool [V]).

    Ties are broken by the smaller target id, so the mapping is a pure function of ``freqs``.
    If fewer than Vd ids ever occur, the remaining slots take the lowest unused ids (tokens never
    seen in training cost nothing to keep and make the head the requested size, which the config,
    the exported weights and the runtimes expect). The chosen ids, sorted ascending, are the draft
    ids 0..Vd-1.

    Worked example, V = 8, Vd = 4::

        freqs        = [0, 5, 2, 5, 0, 1, 9, 0]     id 6 (9), ids 1 and 3 (5 each), id 2 (2)
        chosen ids   = [1, 2, 3, 6]                 (sorted ascending: draft ids 0, 1, 2, 3)
        d2t          = [1, 1, 1, 3]                 draft id 3 -> target id 3 + 3 = 6
        t2d          = [F, T, T, T, F, F, T, F]

    With Vd = 6 only five ids occur (1, 2, 3, 5, 6); the sixth slot takes the lowest unused id 0:
    chosen ids [0, 1, 2, 3, 5, 6], d2t [0, 0, 0, 0, 1, 1].
    """
    if freqs.dim() != 1:
        raise ValueError(f"build_vocab_mapping: freqs must be 1-D [vocab_size], got shape {tuple(freqs.shape)}.")
    vocab_size = freqs.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"build_vocab_mapping: draft_vocab_size={draft_vocab_size} must lie in [1, {vocab_size}].")
    if bool((freqs < 0).any()):
        raise ValueError("build_vocab_mapping: freqs must be non-negative counts.")
    # A stable sort on -freq keeps ascending ids within a tie, and puts the never-seen ids (freq 0)
    # last in ascending order, which is the "lowest unused ids" fill.
    order = torch.sort(-freqs.long(), stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def vocab_coverage(freqs: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the counted (loss-masked) tokens that lie inside the draft vocabulary, i.e. that the
    pruned head can propose at all; worth logging next to the mapping."""
    total = int(freqs.sum())
    return float(freqs[t2d].sum()) / total if total else 1.0
