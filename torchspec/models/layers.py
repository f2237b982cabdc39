"""Building blocks shared by the drafters: rotary embeddings, SwiGLU MLP and the grouped-query
attention module (RMSNorm and the RoPE rotation are the target's, ``torchspec/targets``).

The attention module computes q/k/v (projections, RoPE or NoPE) and hands them to an ``attend``
the CALLER chose (the contract of ``torchspec/attend.py``): the training unroll passes a
``torchspec.models.attention.TTTAttend`` (the K-step TTT pattern: step-0 keys in the sliding
window, the drafter's own earlier steps on the diagonal; ``torchspec/train/ttt.py``), serving passes
``torchspec.runtime.paged_kv.PagedAttend`` over the runtime's KV cache. The module itself knows
neither the window nor the backend, so the drafter step is the same code in both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchspec.attend import Attend
from torchspec.targets.rope import rotate_half


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE; ``cos_sin(positions)`` returns [..., T, head_dim] tables."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, D]
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D]."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kv_heads, T, D] -> [B, kv_heads * groups, T, D] for grouped-query attention."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


class Attention(nn.Module):
    """Grouped-query attention with RoPE (or none: NoPE) around a caller-chosen ``attend``."""

    def __init__(self, in_dim: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, in_dim] -> q [B, h, T, D], k/v [B, kv_h, T, D]; RoPE applied unless cos is None."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, attend: Attend,
                layer: int = 0) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin)
        out = attend(layer, q, k, v)  # [B, h, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
