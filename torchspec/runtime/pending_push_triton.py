"""One Triton kernel defers a plain round's drafter entry (``PendingDrafter.push`` on CUDA).

The draft controller's plain rounds (``steps.plain_step_deferring_drafter``) keep, per row, the committed token
and the target's aux-layer states for the next drafting round to catch up on. As tensor operations that is
about eight kernels (the count gathered and clamped, three index writes, a stack, the count updated); inside a
plain round's CUDA graph they cost ~25 us a round, 2-3 % of a SmolLM2-sized plain step -- what an untrained
drafter's controller pays on top of plain decoding (docs/results.md, twenty-third session). Here program
``b`` owns row ``b``: it reads its slot's count, writes the token and each aux state ``[H]`` at the clamped
position, and bumps the count when the row is live. Rows own distinct slots (the engine's rows are its
slots), so no two programs touch one count. Every index is read on the device: the write can be captured.
``tests/gpu/test_pending_push_gpu.py`` checks it against the tensor version.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MOST_AUX = 4  # aux layers one launch writes (EAGLE-3/4 drafters read 3); more fall back to tensor operations


@triton.jit
def _copy_state(src, s_b, s_h, dst, b, hidden, BLOCK: tl.constexpr):
    for h0 in range(0, hidden, BLOCK):
        h = h0 + tl.arange(0, BLOCK)
        ok = h < hidden
        x = tl.load(src + b * s_b + h * s_h, mask=ok)
        tl.store(dst + h, x.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _push_kernel(slots, tokens_new, row_valid, count, tokens, pool, a0, a1, a2, a3,
                 s0_b, s0_h, s1_b, s1_h, s2_b, s2_h, s3_b, s3_h,
                 capacity, hidden, st_s, sp_a, sp_s, sp_c,
                 NUM_AUX: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    slot = tl.load(slots + b).to(tl.int64)
    n = tl.load(count + slot)
    at = tl.minimum(n, capacity - 1)  # the controller probes before a streak outgrows the buffer
    tl.store(tokens + slot * st_s + at, tl.load(tokens_new + b))
    base = pool + slot * sp_s + at * sp_c
    _copy_state(a0, s0_b, s0_h, base, b, hidden, BLOCK)
    if NUM_AUX > 1:
        _copy_state(a1, s1_b, s1_h, base + sp_a, b, hidden, BLOCK)
    if NUM_AUX > 2:
        _copy_state(a2, s2_b, s2_h, base + 2 * sp_a, b, hidden, BLOCK)
    if NUM_AUX > 3:
        _copy_state(a3, s3_b, s3_h, base + 3 * sp_a, b, hidden, BLOCK)
    tl.store(count + slot, n + tl.load(row_valid + b).to(n.dtype))


def push_triton(slots: torch.Tensor, tokens_new: torch.Tensor, aux: list[torch.Tensor], row_valid: torch.Tensor,
                count: torch.Tensor, tokens: torch.Tensor, pool: torch.Tensor) -> None:
    """``PendingDrafter.push`` in one launch: ``tokens_new`` [B] and ``aux`` A x [B, 1, H] into ``tokens`` [S, C] and
    ``pool`` [A, S, C, H] at each row's slot and count (``count`` [S] int64, bumped for live rows)."""
    b, hidden = tokens_new.shape[0], pool.shape[-1]
    assert 1 <= len(aux) <= MOST_AUX and pool.stride(-1) == 1 and tokens.stride(-1) == 1
    if b == 0:
        return
    states = [a[:, 0] for a in aux] + [aux[0][:, 0]] * (MOST_AUX - len(aux))  # unused pointers: never read
    strides = [s for x in states for s in x.stride()]
    block = min(1024, triton.next_power_of_2(hidden))
    _push_kernel[(b,)](slots, tokens_new, row_valid, count, tokens, pool, *states, *strides,
                       pool.shape[2], hidden, tokens.stride(0), pool.stride(0), pool.stride(1), pool.stride(2),
                       NUM_AUX=len(aux), BLOCK=block, num_warps=4)


__all__ = ["MOST_AUX", "push_triton"]
