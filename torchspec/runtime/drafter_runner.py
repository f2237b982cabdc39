"""The exported drafter in serving: the training step's numerics over a paged, windowed KV cache.

Training (``torchspec/train/ttt.py``) defines what a drafter position means; serving keeps it:

* **step 0 (committed)**: position t holds (fused target states h_t, token x_{t+1}), RoPE position
  t, and attends step-0 keys at t - window < s <= t. After the target commits tokens up to x_N,
  the drafter's cache holds step-0 keys for t = 0..N-1 (its ``ctx_len`` equals the target's).
* **depth d (draft)**: a draft node at depth d of the tree rooted after position n = N - 1 is the
  TTT step d at t = n: input (parent's feedback hidden, the node's token), RoPE position n + d,
  attends step-0 keys at n - window < s <= n (the window is anchored at n, as in training) and the
  keys of its draft ancestors and itself (the TTT diagonal).

``DrafterRunner.forward`` runs one drafter step for either case; the attention rule is encoded in
``AttentionMeta`` (``torchspec/runtime/paged_kv.py``). Logits are returned over the **target**
vocabulary: an efficient LM head scores only its top-k candidates (-inf elsewhere), an EAGLE-3
pruned head is scattered through its d2t map.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchspec.models.eagle3 import Eagle3Drafter
from torchspec.models.eagle4 import Eagle4Drafter
from torchspec.models.layers import apply_rope
from torchspec.models.lm_head import EfficientLMHead
from torchspec.runtime.paged_kv import AttentionMeta, PagedKVCache, paged_attention


class DrafterRunner:
    """Serving-side step of an ``Eagle4Drafter`` or ``Eagle3Drafter`` over a ``PagedKVCache``."""

    def __init__(self, drafter: nn.Module, target_vocab_size: int):
        if not isinstance(drafter, (Eagle4Drafter, Eagle3Drafter)):
            raise TypeError(f"DrafterRunner serves Eagle4Drafter or Eagle3Drafter, got {type(drafter).__name__}.")
        self.model = drafter.eval()
        self.config = drafter.config
        self.is_eagle3 = isinstance(drafter, Eagle3Drafter)
        self.vocab_size = target_vocab_size
        self.window = None if self.is_eagle3 else self.config.sliding_window
        self.efficient_head = isinstance(drafter.lm_head, EfficientLMHead)
        attn = drafter.layer.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        if self.is_eagle3:
            self.draft_to_target = drafter.draft_target_ids().long()

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
        return PagedKVCache(1, num_pages, page_size, self.num_kv_heads, self.head_dim, self.dtype, self.device)

    @torch.no_grad()
    def fuse(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """3 x [B, T, H] captured target states -> step-0 hidden [B, T, H] in the drafter's dtype."""
        return self.model.fuse_target_states([a.to(self.dtype) for a in aux])

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: PagedKVCache, meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T], hidden [B, T, H], positions [B, T] (RoPE) -> (normed, feedback) [B, T, H]."""
        m = self.model
        layer, attn = m.layer, m.layer.self_attn
        emb = m.embed_tokens(tokens).to(hidden.dtype)
        if self.is_eagle3:
            attn_in = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
            residual = hidden
        else:
            residual = m.eh_proj(torch.cat([m.embed_norm(emb), m.hidden_norm(hidden)], dim=-1))
            attn_in = layer.input_layernorm(residual)
        b, t, _ = attn_in.shape
        q = attn.q_proj(attn_in).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(attn_in).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(attn_in).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if not getattr(self.config, "nope", False):
            cos, sin = m.rotary.cos_sin(positions)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, cache.k[0], cache.v[0], meta, self.head_dim**-0.5)
        x = residual + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        h = layer.post_attention_layernorm(x)
        if getattr(layer, "moe", False):
            mlp_out, _ = layer.mlp(h, None)
        else:
            mlp_out = layer.mlp(h)
        x = x + mlp_out
        normed = m.norm(x)
        return normed, (normed if self.config.norm_output else x)

    @torch.no_grad()
    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., H] -> fp32 logits [..., V_target]; tokens the head cannot propose get -inf."""
        head = self.model.lm_head
        if self.efficient_head:
            ids, vals = head.candidates(normed)
            out = vals.new_full((*vals.shape[:-1], self.vocab_size), float("-inf"), dtype=torch.float32)
            return out.scatter_(-1, ids, vals.float())
        draft = F.linear(normed, head.weight).float()
        if not self.is_eagle3:
            return draft
        out = draft.new_full((*draft.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_to_target.to(draft.device), draft)
