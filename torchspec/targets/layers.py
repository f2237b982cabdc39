"""Building blocks every target family shares: HF's RMSNorms, the serving regions built on them
(the residual add with the norm after it, the q/k norm with RoPE; one kernel each on CUDA:
`torchspec.targets.fused_ops`) and the row-parallel linear of TP.

Tensor parallelism is Megatron style and needs only one collective: a column-parallel linear
(its output features split over the tp ranks) is a plain ``nn.Linear`` holding this rank's rows,
and its output stays local; a row-parallel linear (input features split) produces partial sums
that `row_parallel` all-reduces over the tp group BEFORE adding the (replicated) bias, so the
bias is added once. Which weights are which is each family's ``TP_PLAN`` (readable data), and the
loader (`torchspec.targets.loader.load_weights`) reads exactly this rank's slice of each.

Two styles exist for Gated DeltaNet layers (`torchspec.targets.hybrid`): ``colwise_segments``, a
column-parallel weight whose output features are several concatenated segments (q | k | v of a
GDN's conv and in-projection), each split over the ranks separately -- the module holding it lists
this rank's segment sizes in its ``tp_segments`` attribute; and ``heads``, the GDN's per-head
parameters (``A_log``, ``dt_bias``), split with the value heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from torchspec.targets.fused_ops import ONE_LAUNCH, fused
from torchspec.targets.rope import apply_rope

# TP style -> {parameter name: the dim each rank holds 1/tp of}; parameters not listed are replicated.
TP_STYLES: dict[str, dict[str, int]] = {
    "colwise": {"weight": 0, "bias": 0},  # output features split: whole heads / an MLP slice per rank
    "rowwise": {"weight": 1},  # input features split: partial sums, all-reduced, then the whole bias
    "colwise_segments": {"weight": 0},  # colwise per segment; sizes: the module's `tp_segments`
    "heads": {"A_log": 0, "dt_bias": 0},  # a GDN's per-value-head parameters
}
SEGMENTED_STYLES = frozenset({"colwise_segments"})


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's exact op order: fp32 statistics, cast back, then scale (so fp32 results match bitwise)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def offset_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3-Next / Qwen3.5's op order: normalise and scale by ``1 + weight`` in fp32, cast back last."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's elementwise part."""
    return F.silu(gate) * up


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """A residual add and the RMSNorm after it: ``(x + delta, rms_norm(x + delta))``, the same ops as apart."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def add_offset_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`add_rms_norm` with Qwen3-Next / Qwen3.5's ``1 + weight`` norm."""
    x = x + delta
    return x, offset_rms_norm(x, weight, eps)


def qk_norm_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None = None,
                 k_weight: Tensor | None = None, eps: float = 0.0, offset: bool = False) -> tuple[Tensor, Tensor]:
    """Attention's q/k chain: per-head RMSNorm when weights are given (Qwen3's q_norm / k_norm; ``offset``:
    the ``1 + weight`` norm of the hybrid family), then RoPE (partial when cos/sin cover fewer dims).

    q [B, T, heads, D], k [B, T, kv_heads, D]; cos, sin [B, 1, T, rotary_dim] -> q, k as [B, heads, T, D]."""
    if q_weight is not None:
        norm = offset_rms_norm if offset else rms_norm
        q, k = norm(q, q_weight, eps), norm(k, k_weight, eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


rms_norm_fused, offset_rms_norm_fused, silu_mul_fused = fused(rms_norm), fused(offset_rms_norm), fused(silu_mul)
add_rms_norm_fused, add_offset_rms_norm_fused = fused(add_rms_norm), fused(add_offset_rms_norm)
qk_norm_rope_fused = fused(qk_norm_rope, ONE_LAUNCH)  # q and k: one combo kernel (see fused_ops)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # serving on CUDA: one kernel (`torchspec.targets.fused_ops`)

    def forward(self, x: Tensor) -> Tensor:
        return (rms_norm_fused if self.fused else rms_norm)(x, self.weight, self.eps)

    def add_norm(self, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
        """``(x + delta, self(x + delta))``: a residual add inside this norm (serving); delta None: ``(x, self(x))``."""
        if delta is None:
            return x, self(x)
        return (add_rms_norm_fused if self.fused else add_rms_norm)(x, delta, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """Qwen3-Next / Qwen3.5's RMSNorm: weights stored centred on 0, the scale is ``1 + weight``.

    HF's op order (so fp32 matches bitwise): normalise and scale in fp32, cast back last.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.fused = False  # serving on CUDA: one kernel (`torchspec.targets.fused_ops`)

    def forward(self, x: Tensor) -> Tensor:
        return (offset_rms_norm_fused if self.fused else offset_rms_norm)(x, self.weight, self.eps)

    def add_norm(self, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
        """``(x + delta, self(x + delta))``: a residual add inside this norm (serving); delta None: ``(x, self(x))``."""
        if delta is None:
            return x, self(x)
        region = add_offset_rms_norm_fused if self.fused else add_offset_rms_norm
        return region(x, delta, self.weight, self.eps)


def row_parallel(linear: nn.Linear, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``linear(x)`` for a weight sharded along its input dim: partial sums, all-reduce, then bias."""
    y = F.linear(x, linear.weight)
    if group is not None:
        dist.all_reduce(y, group=group)
    return y if linear.bias is None else y + linear.bias


class MLP(nn.Module):
    """SwiGLU, ``down(silu(gate(x)) * up(x))``; gate/up column-parallel, down row-parallel
    (``group=None`` inside a MoE block leaves the partial sums to the block's one all-reduce)."""

    def __init__(self, hidden: int, intermediate: int, group: dist.ProcessGroup | None, bias: bool = False):
        super().__init__()
        self.group = group
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up_proj: nn.Linear | None = None  # set by `fuse` (serving)
        self.fused = False  # serving on CUDA: SwiGLU's elementwise part as one kernel

    def fuse(self) -> None:
        """One gate|up GEMM instead of two (serving)."""
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return row_parallel(self.down_proj, (silu_mul_fused if self.fused else silu_mul)(gate, up), self.group)


def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of ``linears``' outputs (same input, same dtype).

    Serving calls it once after loading (`TargetDecoder.fuse_for_serving`): one GEMM per group reads
    the same bytes as the separate ones but launches once and fills the GPU better at small batch.
    Training capture keeps the separate projections (bit-identical to the transformers oracle). The
    pieces are column-parallel shards of the same rank, so the fused weight is this rank's too."""
    weight = torch.cat([lin.weight for lin in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return fused
