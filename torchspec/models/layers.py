"""Building blocks shared by the drafters: rotary embeddings, SwiGLU MLP, the grouped-query
attention module and the step's input (RMSNorm and the RoPE rotation are the target's, ``torchspec/targets``).

Serving fuses them once (``fuse_serving_layers``, called by ``DrafterRunner.fuse_for_serving``):
one GEMM for q|k|v and for gate|up, and the elementwise chains compiled to one kernel each on CUDA
(``torchspec.targets.fused_ops``) -- the target decoder's serving fusion, applied to the drafter's one
layer. A drafter step runs at every draft depth of every round, so its small kernels weigh on a small
target's round (SmolLM2: ~2.5 us each, ~32 a step before these regions); each region is the eager chain
it replaces, op for op:

    rope_tables        positions -> cos, sin (5 kernels -> 1)
    rope_qk            RoPE of q and k (2 -> 1, a combo kernel: ``ONE_LAUNCH``)
    embed_hidden       the token's embedding row and its RMSNorm, the hidden's RMSNorm, their concatenation:
                       the step's input (4 -> 1, a combo kernel)
    RMSNorm.add_norm   the residual adds with the norms after them (post-attention; the final norm, through
                       the layer's ``forward``, which leaves its last add to the caller) (2 x 2 -> 2 x 1)

Training never fuses (its parameter names are the checkpoint's); neither does the CPU.

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
from torchspec.targets.fused_ops import ONE_LAUNCH, fused
from torchspec.targets.layers import RMSNorm, fuse_linears, rms_norm, silu_mul_fused
from torchspec.targets.rope import rotate_half


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, D] (fp32)."""
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, D]
    return emb.cos(), emb.sin()


rope_tables_fused = fused(rope_tables)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE; ``cos_sin(positions)`` returns [..., T, head_dim] tables."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.fused = False  # serving on CUDA: one kernel (``fuse_serving_layers``)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (rope_tables_fused if self.fused else rope_tables)(positions, self.inv_freq)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D]."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope`` of q and of k."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


rope_qk_fused = fused(rope_qk, ONE_LAUNCH)


def embed_hidden(embed_weight: torch.Tensor, input_ids: torch.Tensor, hidden: torch.Tensor, embed_norm_weight: torch.Tensor,
                 embed_eps: float, hidden_norm_weight: torch.Tensor, hidden_eps: float) -> torch.Tensor:
    """A drafter step's input: cat(RMSNorm(embedding of the token), RMSNorm(hidden)) [B, T, 2H], the
    embedding row cast to the hidden's dtype first."""
    emb = F.embedding(input_ids, embed_weight).to(hidden.dtype)
    return torch.cat([rms_norm(emb, embed_norm_weight, embed_eps), rms_norm(hidden, hidden_norm_weight, hidden_eps)],
                     dim=-1)


embed_hidden_fused = fused(embed_hidden, ONE_LAUNCH)


def step_input(embedding: nn.Embedding, input_ids: torch.Tensor, hidden: torch.Tensor, embed_norm: RMSNorm,
               hidden_norm: RMSNorm) -> torch.Tensor:
    """``embed_hidden`` with a drafter's modules (one kernel when they are fused for serving)."""
    region = embed_hidden_fused if embed_norm.fused else embed_hidden
    return region(embedding.weight, input_ids, hidden, embed_norm.weight, embed_norm.eps, hidden_norm.weight,
                  hidden_norm.eps)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # serving: one GEMM (``fuse``)

    def fuse(self) -> None:
        """Serving: gate|up as one GEMM, SwiGLU's elementwise part as one kernel on CUDA."""
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(silu_mul_fused(gate, up))


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
        self.qkv_proj: nn.Linear | None = None  # serving: one GEMM (``fuse``)

    def fuse(self) -> None:
        """Serving: q|k|v as one GEMM, RoPE as one kernel on CUDA."""
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, in_dim] -> q [B, h, T, D], k/v [B, kv_h, T, D]; RoPE applied unless cos is None."""
        b, t, _ = x.shape
        if self.qkv_proj is not None:
            kv = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv, kv], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cos is not None:
            q, k = (rope_qk if self.qkv_proj is None else rope_qk_fused)(q, k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, attend: Attend,
                layer: int = 0) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin)
        out = attend(layer, q, k, v)  # [B, h, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def fuse_serving_layers(model: nn.Module) -> None:
    """Serving fusion of every drafter layer in ``model`` (in place; see the module docstring)."""
    for module in list(model.modules()):
        if isinstance(module, Attention) and module.qkv_proj is None \
                or isinstance(module, SwiGLU) and module.gate_up_proj is None:
            module.fuse()  # once: a second call finds the fused projection
        elif isinstance(module, RMSNorm | RotaryEmbedding):
            module.fused = True
