"""The exported drafter in serving: THE drafter step of training, over a paged KV cache.

``DrafterRunner.forward`` calls ``drafter.step`` -- the very function the training unroll
(``torchspec/train/ttt.py``) calls -- with a ``PagedAttend`` instead of the TTT attend. Only where
keys come from differs; what a drafter position means is training's:

* **step 0 (committed)**: position t holds (fused target states h_t, token x_{t+1}), RoPE position
  t, and attends the step-0 keys inside its sliding window (``torchspec.attend.in_window``). After
  the target commits tokens up to x_N, the drafter's cache holds step-0 keys for t = 0..N-1 (its
  ``ctx_len`` equals the target's).
* **depth d (draft)**: a draft node at depth d of the tree rooted after position n = N - 1 is the
  TTT step d at t = n: input (parent's feedback hidden, the node's token), RoPE position n + d,
  attends the step-0 keys in the window anchored at n (as in training) and the keys of its draft
  ancestors and itself (the TTT diagonal).

The callers encode those rules in ``AttentionMeta`` (``steps.catch_up_drafter`` for step 0,
``drafting._DraftWriter`` for depths >= 1; ``paged_kv.build_attention_meta``);
``tests/unit/test_drafter_step_parity.py`` checks them against the training unroll. Logits are
over the **target** vocabulary (``Drafter.target_logits``).
"""

from __future__ import annotations

import torch

from torchspec.models.base import Drafter
from torchspec.models.layers import fuse_serving_layers
from torchspec.models.lm_head import EfficientLMHead
from torchspec.runtime.paged_kv import AttentionMeta, PagedAttend, PagedKVCache
from torchspec.runtime.tree_select import log_top


class DrafterRunner:
    """Serving-side view of a drafter (any ``torchspec.models.base.Drafter``) over a ``PagedKVCache``."""

    def __init__(self, drafter: Drafter, target_vocab_size: int):
        if not isinstance(drafter, Drafter):
            raise TypeError(f"DrafterRunner serves a torchspec drafter (models.base.Drafter), got {type(drafter).__name__}.")
        if drafter.config.vocab_size != target_vocab_size:
            raise ValueError(f"the drafter was built for a vocabulary of {drafter.config.vocab_size} tokens but the "
                             f"target has {target_vocab_size}; export the drafter for this target.")
        self.model = drafter.eval()
        self.config = drafter.config
        self.vocab_size = target_vocab_size

    @property
    def window(self) -> int | None:
        return self.model.window

    @property
    def efficient_head(self) -> bool:
        """Whether the head is the low-rank + top-k one (its logits are -inf outside the top-k)."""
        return isinstance(self.model.lm_head, EfficientLMHead)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def make_kv_cache(self, num_pages: int, page_size: int) -> PagedKVCache:
        c = self.config
        return PagedKVCache(1, num_pages, page_size, c.num_key_value_heads, c.head_dim, self.dtype, self.device)

    def fuse_for_serving(self) -> None:
        """One GEMM for q|k|v and gate|up, elementwise chains as one kernel each on CUDA (in place,
        ``torchspec.models.layers.fuse_serving_layers``); the engine calls it with ``fuse=True``."""
        fuse_serving_layers(self.model)

    @torch.no_grad()
    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """3 x [B, T, H] captured target states -> step-0 hidden [B, T, H] in the drafter's dtype."""
        return self.model.fuse_target_states([a.to(self.dtype) for a in aux])

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: PagedKVCache, meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T], hidden [B, T, H], positions [B, T] (RoPE) -> (normed, feedback) [B, T, H]."""
        return self.model.step(tokens, hidden, positions, PagedAttend(cache, meta))

    @torch.no_grad()
    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., H] -> fp32 logits [..., V_target]; tokens the head cannot propose get -inf."""
        return self.model.target_logits(normed)

    @torch.no_grad()
    def best_candidate(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., H] -> target ids [...] of the draft argmax, with no log-softmax (a greedy chain keeps
        every node it drafts, so it needs no score). The token ``top_candidates(normed, 1)`` picks;
        on an exact tie of two logits argmax takes the lower candidate position, top-k may take the
        other -- either is a valid draft (verification decides what is emitted)."""
        head = self.model.lm_head
        if isinstance(head, EfficientLMHead):
            ids, logits = head.candidates(normed)
            return torch.gather(ids, -1, logits.argmax(-1, keepdim=True)).squeeze(-1)
        return self.logits(normed).argmax(-1)

    @torch.no_grad()
    def top_candidates(self, normed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H] -> (log-probabilities [..., k] descending, target ids [..., k]): the draft
        distribution's k most likely tokens, = ``log_softmax(logits(normed)).topk(k)`` without a
        vocabulary-wide log-softmax. An efficient head scores only its candidates (everything else is
        -inf, so their log-sum-exp is the whole one): nothing vocabulary-wide is materialised at all. The
        softmax and top-k are one fused region on CUDA (``tree_select.log_top``)."""
        head = self.model.lm_head
        if isinstance(head, EfficientLMHead) and k <= head.topk:
            ids, logits = head.candidates(normed)
            return log_top(logits, k, ids)
        return log_top(self.logits(normed), k)
