"""Drafter entries deferred through the draft controller's plain rounds, caught up in one forward at the next probe.

While the controller plans width 0 (``controlled_drafting``, ahead mode), most rounds are plain steps. The drafter
needs an entry for every committed position (its step-0 K/V, built from the target's aux-layer states at that
position and the token that follows), but nothing reads those entries until a round drafts again. So a plain
round (``steps.plain_step_deferring_drafter``) only keeps, per row, the committed token and the target's aux
states it captured (``PendingDrafter.push``: a few small writes, no drafter forward), and the next round that
drafts first catches the drafter up on all of them in one forward (``catch_up_pending``: positions ctx - count ..
ctx - 1, each row its own count), which on a launch-bound target costs about what one position's catch-up does.
The drafter's caches and state after that equal those a full round verifying nothing would have left after each
plain round (``tests/unit/test_controller_probes.py``).

Buffers live per engine slot, sized for ``capacity`` deferred positions (the controller probes before a streak
outgrows it); a slot's count is zeroed when it is prefilled. Every method is tensor code without host reads, so
the rounds that call it are captured in CUDA graphs like any other.
"""

from __future__ import annotations

import dataclasses
import functools

import torch


class PendingDrafter:
    """Per-slot deferred drafter inputs: ``tokens`` [S, C] (the token that follows each deferred position), ``aux``
    [A, S, C, H] (the target's aux-layer states there), ``count`` [S] (deferred positions of each slot)."""

    def __init__(self, slots: int, capacity: int, num_aux: int, hidden: int, dtype: torch.dtype,
                 device: torch.device):
        if capacity < 1:
            raise ValueError(f"PendingDrafter capacity={capacity} must be >= 1.")
        self.capacity = capacity
        self.tokens = torch.zeros(slots, capacity, dtype=torch.long, device=device)
        self.aux = torch.zeros(num_aux, slots, capacity, hidden, dtype=dtype, device=device)
        self.count = torch.zeros(slots, dtype=torch.long, device=device)

    def push(self, slots: torch.Tensor, tokens: torch.Tensor, aux: list[torch.Tensor], row_valid: torch.Tensor) -> None:
        """Defer one position a row: ``tokens`` [B] and ``aux`` A x [B, 1, H] at the rows' ``slots`` [B]; invalid
        rows write where their next entry would go and count nothing. One kernel on CUDA (``pending_push_triton``),
        else ``push_reference``; ``slots`` are distinct (the engine's rows are its slots)."""
        kernel = _push_kernel() if tokens.is_cuda and len(aux) else None
        if kernel is not None and len(aux) <= kernel.MOST_AUX:
            kernel.push_triton(slots, tokens, aux, row_valid, self.count, self.tokens, self.aux)
        else:
            self.push_reference(slots, tokens, aux, row_valid)

    def push_reference(self, slots: torch.Tensor, tokens: torch.Tensor, aux: list[torch.Tensor],
                       row_valid: torch.Tensor) -> None:
        """``push`` as tensor operations (~8 kernels on a GPU)."""
        at = self.count[slots].clamp(max=self.capacity - 1)  # the controller probes before a streak outgrows it
        self.tokens[slots, at] = tokens
        self.aux[:, slots, at] = torch.stack([states[:, 0] for states in aux]).to(self.aux.dtype)  # one write
        self.count[slots] = self.count[slots] + row_valid.long()

    def take(self, slots: torch.Tensor, row_valid: torch.Tensor
             ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The rows' deferred positions (tokens [B, C], aux A x [B, C, H], count [B]); the valid rows' counts become
        0 (an idle run, every row invalid, changes nothing: CUDA-graph warm-ups)."""
        count = self.count[slots].clone()
        self.count[slots] = torch.where(row_valid, 0, count)
        return self.tokens[slots], [a[slots] for a in self.aux], count

    def reset(self, slots: torch.Tensor) -> None:
        """Forget what the ``slots`` deferred (a new request's prefill writes its drafter entries itself)."""
        self.count[slots] = 0


@functools.cache
def _push_kernel():
    """The Triton push, or None where Triton is not installed (imported on first CUDA use only)."""
    try:
        from torchspec.runtime import pending_push_triton
    except ImportError:
        return None
    return pending_push_triton


def catch_up_pending(runner, caches, inp, slots: torch.Tensor):
    """``inp`` (``drafting.DraftInputs``) with the drafter caught up on every row's deferred positions: their step-0
    entries written at ctx - count .. ctx - 1 in one forward and the drafter state at the last of them; rows with
    nothing deferred keep theirs. Padding beyond a row's count writes uncommitted positions only (>= ctx), as a
    prefill chunk's padding does. An invalid row catches up on nothing and keeps its count: the engine captures a
    controller's rounds on idle rows at context 0 (``engine_forwards.capture_round_shapes``), where ctx - count
    would be a negative position, read from the block table at a negative column."""
    from torchspec.runtime.steps import catch_up_drafter

    tokens, aux, count = caches.pending.take(slots, inp.row_valid)
    count = torch.where(inp.row_valid, count, 0)  # an idle row catches up on nothing (its ctx may be 0: a capture)
    start = inp.ctx_len - count
    normed, feedback = catch_up_drafter(runner, caches, inp.block_table, start, tokens, aux, (count - 1).clamp(min=0),
                                        inp.row_valid)
    has = (count > 0)[:, None]
    return dataclasses.replace(inp, normed=torch.where(has, normed.to(inp.normed.dtype), inp.normed),
                               feedback=torch.where(has, feedback.to(inp.feedback.dtype), inp.feedback))


__all__ = ["PendingDrafter", "catch_up_pending"]
