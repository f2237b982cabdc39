"""The drafter interface: everything training, the recipes and serving call on a drafter.

``Eagle3Drafter`` and ``Eagle4Drafter`` implement it; callers never ask which architecture they
hold (no attribute probing, no type checks). What differs between the architectures lives behind
these methods, in the model files:

    fuse_target_states(aux)        3 x [B, T, H] captured target states -> step-0 hidden [B, T, H]
    step(input_ids, hidden, positions, attend, token_mask=None, moe_stats=None)
                                   THE drafter step, the same code for the TTT unroll and for
                                   serving; -> (normed, feedback) [B, T, H]. The caller's ``attend``
                                   (``torchspec/attend.py``) decides where keys come from:
    ttt_attend(document_ids=None)  -> the training unroll's attend (this drafter's TTT backend and
                                   window); serving passes ``runtime.paged_kv.PagedAttend``
    window                         sliding window of the step-0 keys, None = full causal (EAGLE-3)
    compute_logits(normed)         [..., H] -> [..., Vd] over the head's own vocabulary (training)
    target_logits(normed)          [..., H] -> fp32 [..., V] over the TARGET vocabulary (serving);
                                   -inf where the head cannot propose: outside an efficient head's
                                   top-k, outside EAGLE-3's draft vocabulary (scattered through d2t)
    draft_to_target_ids(ids)       head ids -> target ids (identity over the full vocabulary)
    draft_vocab_ids()              [Vd] target id of every head row, or None (full vocabulary)
    init_from_target(embed, lm_head, init_lm_head=True)   copy the target's embedding (and head)
    fit_vocab(train_set)           vocabulary-mapping hook, before ``init_from_target``: EAGLE-3
                                   builds its pruned vocabulary from the training split, EAGLE-4
                                   does nothing; returns a line for the log or None
    vocab_mapping()                (d2t, t2d) that a checkpoint must carry, or None

Where the step's positions, window anchoring and feedback meet serving is pinned by
``tests/unit/test_drafter_step_parity.py``: the runtime's drafter at draft depth d equals the
training unroll at TTT step d.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Iterable

import torch
from transformers import PreTrainedModel

from torchspec.attend import Attend
from torchspec.models.attention import TTTAttend, select_ttt_attention


class Drafter(PreTrainedModel, metaclass=ABCMeta):
    """Base of every drafter architecture; ``attn_backend`` names the TTT attention backend
    (``torchspec.models.attention.TTT_ATTENTION``) that ``ttt_attend`` uses in training."""

    def __init__(self, config, attn_backend: str = "chunked"):
        super().__init__(config)
        self.ttt_backend = select_ttt_attention(attn_backend)

    def ttt_attend(self, document_ids: torch.Tensor | None = None,
                   kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> TTTAttend:
        """A fresh attend for one K-step training unroll (call ``step`` with it K times)."""
        return TTTAttend(self.ttt_backend, self.window, document_ids, kv)

    def fuse_target_states(self, aux_hidden_states: list[torch.Tensor]) -> torch.Tensor:
        """3 x [B, T, H] captured target states -> step-0 hidden [B, T, H]: fc-norm (each state
        RMS-normalised on its own, if ``fc_norms``), concat, ``fc`` 3H -> H, then ``fc_post_norm``
        (an RMSNorm for EAGLE-4 with ``fc_post_norm``, else the identity)."""
        if self.fc_norms is not None:
            aux_hidden_states = [norm(h) for norm, h in zip(self.fc_norms, aux_hidden_states)]
        return self.fc_post_norm(self.fc(torch.cat(aux_hidden_states, dim=-1)))

    @property
    @abstractmethod
    def window(self) -> int | None: ...

    @abstractmethod
    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend: Attend,
             token_mask: torch.Tensor | None = None, moe_stats: list | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def target_logits(self, normed: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def draft_vocab_ids(self) -> torch.Tensor | None: ...

    @abstractmethod
    def init_from_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                         init_lm_head: bool = True) -> None: ...

    @abstractmethod
    def fit_vocab(self, train_set: Iterable) -> str | None: ...

    @abstractmethod
    def vocab_mapping(self) -> tuple[torch.Tensor, torch.Tensor] | None: ...
