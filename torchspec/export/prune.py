"""Post-hoc vocabulary pruning of a trained EAGLE-3 drafter, for exports.

A smaller draft vocabulary makes the drafter's LM head cheaper in serving. A trained head can be
pruned without retraining only to a SUBSET of its current draft vocabulary: a kept token keeps its
trained row; a token outside it has no trained row. Rows are selected by target id, never by draft id
or offset: after pruning, draft ids are renumbered (the kept target ids in ascending order, contract 7),
so new draft id j is old draft id ``old_draft_of[new_target_id[j]]``, whose offset d2t generally differs.

Worked example, V = 10, old draft ids -> target ids [1, 3, 4, 7, 9] (d2t [1, 2, 2, 4, 5]); keeping
target ids [3, 7, 9] gives new d2t [3, 6, 7] and new lm_head rows = old rows [1, 3, 4]. (Taking old rows
[0, 1, 2] -- the new draft ids -- would score target ids 1, 3, 4 under the labels 3, 7, 9.)

Since the new logits are a subset of the old ones, the drafter's argmax target id is unchanged on every
position whose old argmax is a kept token; the tokens dropped are never proposed.
"""

from __future__ import annotations

import torch

from torchspec.data.vocab import build_vocab_mapping
from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter


def prune_vocab(drafter: Eagle3Drafter, freqs: torch.Tensor, new_draft_vocab_size: int,
                restrict_to_current: bool = False) -> Eagle3Drafter:
    """A new drafter with a ``new_draft_vocab_size`` draft vocabulary picked from ``freqs`` [V] (token
    counts under the loss mask, ``torchspec.data.vocab.token_frequencies``) and its LM head rows selected
    by target id. Every other tensor is copied unchanged; the input drafter is not modified.

    ``restrict_to_current=False``: the new vocabulary is exactly ``build_vocab_mapping(freqs, n)``, and it
    is refused unless it lies inside the current draft vocabulary (the refusal names the ids outside).
    ``restrict_to_current=True``: rank only the current draft vocabulary's target ids by ``freqs`` (same
    tie rule: smaller target id first) and keep the top n.
    """
    cfg = drafter.config
    if tuple(freqs.shape) != (cfg.vocab_size,):
        raise ValueError(f"prune_vocab: freqs must have shape [{cfg.vocab_size}] (vocab_size), got {tuple(freqs.shape)}.")
    if not 1 <= new_draft_vocab_size <= cfg.draft_vocab_size:
        raise ValueError(f"prune_vocab: new_draft_vocab_size={new_draft_vocab_size} must lie in [1, current "
                         f"draft_vocab_size={cfg.draft_vocab_size}]; a trained head cannot grow rows it never had.")
    t2d_old = drafter.t2d.cpu()
    freqs = freqs.cpu().long()
    if restrict_to_current:
        # +1 lifts every current id above every other id while keeping their order and ties.
        freqs = torch.where(t2d_old, freqs.clamp_min(0) + 1, torch.zeros_like(freqs))
    d2t, t2d = build_vocab_mapping(freqs, new_draft_vocab_size)
    new_ids = torch.arange(new_draft_vocab_size) + d2t  # [n] target ids, ascending
    outside = new_ids[~t2d_old[new_ids]]
    if outside.numel():
        raise ValueError(
            f"prune_vocab: the {new_draft_vocab_size} most frequent tokens include target ids "
            f"{outside[:20].tolist()}{' ...' if outside.numel() > 20 else ''} ({outside.numel()} in all) outside "
            f"the drafter's current draft vocabulary, which have no trained LM head row. Pass "
            f"restrict_to_current=True to rank only the current vocabulary."
        )
    old_draft_of = torch.cumsum(t2d_old.long(), 0) - 1  # [V] old draft id of each target id in t2d_old
    rows = old_draft_of[new_ids]  # [n] old draft ids, selected by target id
    assert torch.equal(drafter.draft_target_ids().cpu()[rows], new_ids)

    fields = {name: getattr(cfg, name) for name in Eagle3Config.ARCH_FIELDS}
    pruned = Eagle3Drafter(Eagle3Config(**{**fields, "draft_vocab_size": new_draft_vocab_size}))
    state = dict(drafter.state_dict())
    head = state["lm_head.weight"]
    state["lm_head.weight"] = head.index_select(0, rows.to(head.device))
    state["d2t"], state["t2d"] = d2t.to(drafter.d2t.device), t2d.to(drafter.t2d.device)
    pruned.to(device=head.device, dtype=head.dtype)
    pruned.load_state_dict(state)  # checks and locks the new mapping
    return pruned.train(drafter.training)
