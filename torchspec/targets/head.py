"""The target's lm_head in serving: fp32 logits, split over the vocabulary under TP (`TargetDecoder.logits/argmax`).

Greedy verification needs one thing per tree node: the target's argmax. Under tensor parallelism
nothing requires any rank to hold all ``[N, V]`` logits: rank r scores only its contiguous slice of
the vocabulary, rows ``[r * Vr, (r + 1) * Vr)`` of the lm_head weight (the last slice may be
shorter), takes its local (max, argmax) and ONE all-gather of ``[tp, N, 2]`` float64 values
(16 bytes per node and rank) picks the global winner::

    local  = h @ W[r].T                      fp32 output, bf16 operands accumulated in fp32
    (m, i) = local.max(-1)                   i + r * Vr = global id
    gather (m, id) over ranks -> the first rank whose m is the largest wins

Ties resolve to the lowest token id, as ``torch.argmax`` on the full logits does (shards are in
vocabulary order and each shard's argmax returns its first maximum), so the result is the full
argmax exactly. Sampled verification needs the whole distribution at every node: its logits are
all-gathered slice by slice (``logits``), which is what it needs and no more.

The logits are never rounded to bf16: bf16 rounding of the lm_head output creates exact ties
(about half of the speculative-vs-plain divergences measured on SmolLM2 in bf16) that the fp32
output resolves. On CUDA the product is one bf16 GEMM with fp32 output (``out_dtype``); elsewhere
the operands are upcast (CPU is the reference, not a serving path).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def fp32_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """[..., H] @ [V, H].T -> fp32 [..., V], accumulated and returned in fp32 (never rounded to bf16)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.is_cuda and weight.dtype in (torch.bfloat16, torch.float16):
        out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
    else:
        out = flat.float() @ weight.float().t()
    return out.view(*hidden.shape[:-1], weight.shape[0])


class VocabParallelHead:
    """``weight`` [V, H] (the full lm_head, or embed_tokens when tied); this rank scores its slice."""

    def __init__(self, weight: Tensor, group: dist.ProcessGroup | None = None):
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.tp = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.vocab_size = weight.shape[0]
        self.slice_size = -(-self.vocab_size // self.tp)
        self.start = min(self.rank * self.slice_size, self.vocab_size)
        self.weight = weight[self.start: min(self.start + self.slice_size, self.vocab_size)]  # a view

    def local_logits(self, hidden: Tensor) -> Tensor:
        """[..., H] -> fp32 [..., Vr]: this rank's slice of the vocabulary."""
        return fp32_logits(hidden, self.weight)

    def argmax(self, hidden: Tensor) -> Tensor:
        """[..., H] -> [...] long: the argmax of the full logits (lowest id on ties), one small all-gather."""
        local = self.local_logits(hidden)
        if local.shape[-1] == 0:  # more ranks than vocabulary rows: this rank never wins
            best = torch.full(local.shape[:-1], float("-inf"), device=hidden.device)
            index = torch.zeros(local.shape[:-1], dtype=torch.long, device=hidden.device)
        else:
            best, index = local.max(dim=-1)
        if self.group is None:
            return index
        mine = torch.stack([best.double(), (index + self.start).double()], dim=-1)  # exact: ids < 2^53
        parts = [torch.empty_like(mine) for _ in range(self.tp)]
        dist.all_gather(parts, mine.contiguous(), group=self.group)
        stacked = torch.stack(parts)  # [tp, ..., 2] in vocabulary order
        winner = stacked[..., 0].argmax(dim=0, keepdim=True)  # first rank holding the maximum
        return stacked[..., 1].gather(0, winner).squeeze(0).long()

    def logits(self, hidden: Tensor) -> Tensor:
        """[..., H] -> fp32 [..., V]: the full logits (sampled verification), slices all-gathered."""
        local = self.local_logits(hidden)
        if self.group is None:
            return local
        padded = torch.nn.functional.pad(local, (0, self.slice_size - local.shape[-1]), value=float("-inf"))
        parts = [torch.empty_like(padded) for _ in range(self.tp)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


__all__ = ["VocabParallelHead", "fp32_logits"]
