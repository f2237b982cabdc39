"""Building blocks every target family shares: HF's RMSNorm and the row-parallel linear of TP.

Tensor parallelism is Megatron style and needs only one collective: a column-parallel linear
(its output features split over the tp ranks) is a plain ``nn.Linear`` holding this rank's rows,
and its output stays local; a row-parallel linear (input features split) produces partial sums
that `row_parallel` all-reduces over the tp group BEFORE adding the (replicated) bias, so the
bias is added once. Which weights are which is each family's ``TP_PLAN`` (readable data), and the
loader (`torchspec.targets.loader.load_weights`) reads exactly this rank's slice of each.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

# TP style -> {parameter name: the dim each rank holds 1/tp of}; parameters not listed are replicated.
TP_STYLES: dict[str, dict[str, int]] = {
    "colwise": {"weight": 0, "bias": 0},  # output features split: whole heads / an MLP slice per rank
    "rowwise": {"weight": 1},  # input features split: partial sums, all-reduced, then the whole bias
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # HF's exact op order: fp32 statistics, cast back, then scale (so fp32 results match bitwise).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def row_parallel(linear: nn.Linear, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``linear(x)`` for a weight sharded along its input dim: partial sums, all-reduce, then bias."""
    y = F.linear(x, linear.weight)
    if group is not None:
        dist.all_reduce(y, group=group)
    return y if linear.bias is None else y + linear.bias
