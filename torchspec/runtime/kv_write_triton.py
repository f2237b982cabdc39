"""One Triton kernel writes a forward's new keys AND values into one layer's paged pools.

The reference (``paged_kv.write_kv_reference``) is two ``index_copy_`` calls, i.e. two kernel
launches per attention layer; at batch 1 each moves a few KB, so the launches, not the bytes, are
the cost (36 layers x 2 x ~2 us in a Qwen3-8B plain decode step on an H200). ``write_kv_triton``
does both in one launch: program ``n`` owns token ``n`` of the flattened ``[B, Tq]`` and copies
its ``[kv_heads, D]`` key and value tiles to flat pool slot ``slots[n]`` (the layout of
``paged_kv.py``'s docstring), casting to the pool's dtype as ``index_copy_`` after ``.to`` does.

Several tokens may share a slot (padding rows all write the trash page): as with ``index_copy_``,
one of them wins and nobody reads it. The grid is the token count and every index is read on the
device, so the write can be CUDA-graph captured. ``tests/unit/test_target_fused_regions.py``
checks it against the reference on CUDA and under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_new, v_new, k_pool, v_pool, slots,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, spk_s, spk_h, spv_s, spv_h,
    tq, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0)  # token b * tq + t
    b, t = n // tq, n % tq
    slot = tl.load(slots + n).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < num_kv_heads) & (d < HEAD_DIM)
    k = tl.load(k_new + b * sk_b + t * sk_t + h * sk_h + d * sk_d, mask=ok)
    tl.store(k_pool + slot * spk_s + h * spk_h + d, k.to(k_pool.dtype.element_ty), mask=ok)
    v = tl.load(v_new + b * sv_b + t * sv_t + h * sv_h + d * sv_d, mask=ok)
    tl.store(v_pool + slot * spv_s + h * spv_h + d, v.to(v_pool.dtype.element_ty), mask=ok)


def write_kv_triton(k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    slots: torch.Tensor) -> None:
    """k_new, v_new [B, kv_heads, Tq, D] (any strides) into pools [slots, kv_heads, D] at ``slots`` [B, Tq]."""
    b, kvh, tq, d = k_new.shape
    assert v_new.shape == k_new.shape and k_pool.shape[1:] == v_pool.shape[1:] == (kvh, d)
    assert k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1 and slots.shape == (b, tq)
    if b * tq == 0:
        return
    slots = slots.reshape(-1)  # [B * Tq], token b * Tq + t
    block_d = triton.next_power_of_2(d)
    block_h = triton.next_power_of_2(kvh)
    _write_kv_kernel[(b * tq,)](
        k_new, v_new, k_pool, v_pool, slots,
        *k_new.stride(), *v_new.stride(), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        tq, kvh, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )


__all__ = ["write_kv_triton"]
