"""The cost model ``bench_lm_head`` times: one drafter decode step at batch 1 over a KV cache, and
the three LM heads it compares. A cost model, not the trainer's code:

    x = eh_proj(cat(norm(embed(token)), norm(hidden)))          2H -> H
    x = x + o_proj(attn(q_proj, k_proj, v_proj of norm(x), RoPE, KV cache of `context` tokens))
    x = x + down(silu(gate(norm(x))) * up(norm(x)))             SwiGLU
    y = norm(x);  draft = head(y)

with n new tokens per step: 1 (chain drafting) or 16 (tree drafting; the new tokens attend to the
whole cache and to each other under a mask, lower-triangular here, which costs what a tree mask
costs). Heads: (a) ``eagle3_pruned``: dense [32000, H] matmul + argmax (chain) / top-`branch`
(tree) + d2t offset; (b) ``eagle4_full``: the same over all V rows; (c) ``eagle4_efficient``:
``EfficientLMHead.candidates`` (the real inference path) + argmax / top-`branch` of the k exact
logits. Defaults are the flagship shapes: H 5120, V 248,320, 24 query / 4 KV heads of dim 256,
MLP 17,408, context 2048, rank 128, top-128, bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchspec.models.lm_head import EfficientLMHead


@dataclass(frozen=True)
class Shape:
    hidden: int = 5120
    vocab: int = 248_320
    heads: int = 24
    kv_heads: int = 4
    head_dim: int = 256
    intermediate: int = 17_408
    context: int = 2048
    pruned_vocab: int = 32_000
    rank: int = 128
    topk: int = 128
    tree_tokens: int = 16
    branch: int = 8  # tree drafting: children kept per node


SMALL = Shape(hidden=64, vocab=1000, heads=4, kv_heads=2, head_dim=16, intermediate=128, context=32,
              pruned_vocab=200, rank=8, topk=16, tree_tokens=4, branch=4)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class DraftStep(nn.Module):
    """The drafter body for one decode step of ``n`` new tokens at batch 1 (see module docstring)."""

    def __init__(self, s: Shape, n: int, device, dtype):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        h, qd, kvd = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.s, self.n = s, n
        self.embed = nn.Embedding(s.vocab, h, **f)  # the target's embedding (one row read per token)
        self.embed_norm, self.hidden_norm = RMSNorm(h, device, dtype), RMSNorm(h, device, dtype)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, **f)
        self.input_norm, self.post_attn_norm = RMSNorm(h, device, dtype), RMSNorm(h, device, dtype)
        self.q_proj = nn.Linear(h, qd, bias=False, **f)
        self.k_proj = nn.Linear(h, kvd, bias=False, **f)
        self.v_proj = nn.Linear(h, kvd, bias=False, **f)
        self.o_proj = nn.Linear(qd, h, bias=False, **f)
        self.gate = nn.Linear(h, s.intermediate, bias=False, **f)
        self.up = nn.Linear(h, s.intermediate, bias=False, **f)
        self.down = nn.Linear(s.intermediate, h, bias=False, **f)
        self.norm = RMSNorm(h, device, dtype)
        for lin in (self.eh_proj, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate, self.up, self.down):
            nn.init.normal_(lin.weight, std=lin.in_features**-0.5)
        total = s.context + n
        cache = (1, s.kv_heads, total, s.head_dim)
        self.register_buffer("k_cache", torch.randn(cache, **f))
        self.register_buffer("v_cache", torch.randn(cache, **f))
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, s.head_dim, 2, device=device).float() / s.head_dim))
        freqs = torch.arange(s.context, total, device=device).float()[:, None] * inv_freq
        emb = torch.cat([freqs, freqs], -1)  # [n, D]
        self.register_buffer("cos", emb.cos().to(dtype))
        self.register_buffer("sin", emb.sin().to(dtype))
        # GQA as plain MHA over the KV heads: the `groups` query heads sharing a KV head become
        # extra query rows, so every SDPA backend applies and no K/V is repeated.
        self.groups = s.heads // s.kv_heads
        if n > 1:
            mask = torch.ones(n, total, dtype=torch.bool, device=device)
            mask[:, s.context :] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            self.register_buffer("mask", mask.repeat(self.groups, 1))  # [groups * n, total]
        else:
            self.mask = None

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat([-x2, x1], dim=-1) * self.sin

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """tokens [1, n], hidden [1, n, H] -> normed [1, n, H]."""
        s, n = self.s, self.n
        x = self.eh_proj(torch.cat([self.embed_norm(self.embed(tokens)), self.hidden_norm(hidden)], -1))
        a = self.input_norm(x)
        q = self.rope(self.q_proj(a).view(1, n, s.heads, s.head_dim).transpose(1, 2))  # [1, h, n, D]
        k = self.rope(self.k_proj(a).view(1, n, s.kv_heads, s.head_dim).transpose(1, 2))
        v = self.v_proj(a).view(1, n, s.kv_heads, s.head_dim).transpose(1, 2)
        self.k_cache[:, :, s.context :] = k
        self.v_cache[:, :, s.context :] = v
        q = q.reshape(1, s.kv_heads, self.groups * n, s.head_dim)  # [1, kv_h, groups * n, D]
        o = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=self.mask)
        o = o.reshape(1, s.heads, n, s.head_dim).transpose(1, 2).reshape(1, n, -1)
        x = x + self.o_proj(o)
        b = self.post_attn_norm(x)
        x = x + self.down(F.silu(self.gate(b)) * self.up(b))
        return self.norm(x)

    def bytes_read(self) -> int:
        """Weights read per step (the embedding contributes n rows) plus the KV cache."""
        weights = sum(p.numel() * p.element_size() for name, p in self.named_parameters() if name != "embed.weight")
        rows = self.n * self.embed.weight.shape[1] * self.embed.weight.element_size()
        return weights + rows + 2 * self.k_cache.numel() * self.k_cache.element_size()


def build_heads(s: Shape, n: int, device, dtype, gen: torch.Generator
                ) -> tuple[dict[str, Callable[[torch.Tensor], torch.Tensor]], dict[str, int], EfficientLMHead]:
    """The three heads as functions normed [1, n, H] -> draft ids [1, n] (chain) / [1, n, branch]."""
    eff = EfficientLMHead(s.hidden, s.vocab, rank=s.rank, topk=s.topk, device=device, dtype=dtype)
    pruned = torch.randn(s.pruned_vocab, s.hidden, device=device, dtype=dtype, generator=gen) * 0.02
    d2t = torch.randint(0, s.vocab - s.pruned_vocab, (s.pruned_vocab,), device=device, generator=gen)
    el = torch.finfo(dtype).bits // 8

    def pick(logits: torch.Tensor) -> torch.Tensor:  # [.., m] -> positions in the last dim
        return logits.argmax(-1, keepdim=True) if n == 1 else logits.topk(s.branch, dim=-1).indices

    def eagle3_pruned(y):
        ids = pick(F.linear(y, pruned))
        return ids + d2t[ids]

    def eagle4_full(y):
        return pick(eff.full_logits(y))

    def eagle4_efficient(y):
        ids, logits = eff.candidates(y)
        return ids.gather(-1, pick(logits))

    heads = {"eagle3_pruned": eagle3_pruned, "eagle4_full": eagle4_full, "eagle4_efficient": eagle4_efficient}
    head_bytes = {"eagle3_pruned": s.pruned_vocab * s.hidden * el,
                  "eagle4_full": s.vocab * s.hidden * el,
                  "eagle4_efficient": (s.rank * s.hidden + s.vocab * s.rank + n * s.topk * s.hidden) * el}
    return heads, head_bytes, eff
