"""The launch plan of the paged-attention kernels (``paged_attention_triton.py``), in plain Python.

``plan(batch, kv_heads, tq, group, head_dim, max_keys, dtype, device)`` picks the tiles, the mode (split for
Tq <= ``SPLIT_MAX_TQ`` queries a row, else direct) and the split count from shapes only (never a length: one
CUDA graph serves every replay). ``max_keys`` is the block table's width as the forward gets it: the engine
passes its longest row's bucket (``paged_kv.table_columns``), not ``max_context``. It lives apart from the
kernels so that the rule is tested on any machine and replayed against measured sweeps
(``tools/replay_split_rule.py``).
"""

from __future__ import annotations

import contextlib
import functools

import torch

SPLIT_MAX_TQ = 64  # above this many queries per row: direct (prefill) mode


def _next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: any value exercises the same code


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    return 50 << 20  # the interpreter: an H200's L2


_SMALL_GRID_SPLITS = [True]  # False inside ``bandwidth_split_rule``


@contextlib.contextmanager
def bandwidth_split_rule():
    """Plan (and so capture) attention inside this block with the large-grid chunk rule only -- splits of
    >= 8 x rows keys, the rule before small grids took one-tile splits -- to measure both rules in one run
    (``tools/bench_attention_paged.py --impls kernel_bw``, ``tools/profile_round.py --attn-chunk-rule``)."""
    _SMALL_GRID_SPLITS[0] = False
    try:
        yield
    finally:
        _SMALL_GRID_SPLITS[0] = True


LONG_ROW_SPLIT_KEYS = 1024  # the fewest keys a split of one long row gets


def plan(batch: int, kv_heads: int, tq: int, group: int, head_dim: int, max_keys: int, dtype: torch.dtype,
         device: torch.device, num_splits: int | None = None, sms: int | None = None,
         l2_bytes: int | None = None) -> dict:
    """Static launch parameters for a shape (never a length: they must not change between graph replays).

    Tile sizes keep every variant free of register spills on sm_90 (checked with ptxas through
    ``triton.compile``): bf16/fp16 take 16..128 query rows and 32..64 keys per step; fp32, whose
    3xTF32 dot products need three operand copies, takes 16 x 32. ``sms`` / ``l2_bytes`` default to the
    device's (``tools/replay_split_rule.py`` plans for the GPU a sweep ran on)."""
    sms = _num_sms(device) if sms is None else sms
    l2_bytes = _l2_bytes(device) if l2_bytes is None else l2_bytes
    block_d = _next_power_of_2(head_dim)
    rows = tq * group
    split = tq <= SPLIT_MAX_TQ
    if dtype == torch.float32:
        block_m, block_n = 16, 32
    elif split:
        block_m = min(128 if block_d <= 128 else 64, max(16, _next_power_of_2(rows)))
        block_n = 64 if block_d <= 128 and block_m <= 64 else 32
    else:
        block_m, block_n = (128, 64) if block_d <= 128 else (64, 32)
    m_blocks = _cdiv(rows, block_m)
    if split and num_splits is None:
        programs = batch * kv_heads * m_blocks
        # a long row alone still fills the machine, in at most two waves of programs per SM: rounding up
        # measured 12% slower at Qwen3-8B's 64 programs (batch 8 tree verify: 5 splits spill a third wave)
        num_splits = max(1, 2 * sms // programs)
        # ... and one long row among short ones fills it by itself: its kv_heads x m_blocks tiles take enough
        # splits to cover the SMs, down to LONG_ROW_SPLIT_KEYS keys a split. max_keys is the engine's bucket of
        # the longest row (paged_kv.table_columns), not max_context. On the seventh session's H200 sweeps (78
        # cases, uniform and one-long-row batches) this plans within 1.08x of the best split count (geomean,
        # worst 1.48x; tools/replay_split_rule.py) where the rule before it (one split per 4,096 table keys over
        # the whole table) was at 1.13x (worst 2.06x).
        long_row = min(sms // (kv_heads * m_blocks), _cdiv(max_keys, LONG_ROW_SPLIT_KEYS))
        num_splits = max(num_splits, long_row)
        num_splits = min(num_splits, _cdiv(max_keys, block_n), 128)
    # A split writes rows x D fp32 partials that _combine reads back. When every split's partials fit in
    # a quarter of L2 they never reach HBM: the grid is small and latency-bound (tree and chain verify,
    # drafter forwards at low batch), so a split may be one key tile and a short row still spreads over
    # the machine. Otherwise partials stay <= 1/4 of the KV bytes a chunk reads.
    partial_bytes = batch * kv_heads * rows * ((num_splits or 1) + 1) * head_dim * 4
    if split and _SMALL_GRID_SPLITS[0] and partial_bytes <= l2_bytes // 4:
        min_chunk = block_n
    else:
        min_chunk = _cdiv(max(block_n, 8 * rows), block_n) * block_n
    return dict(split=split, num_splits=num_splits if split else 1, block_m=block_m, block_n=block_n,
                block_d=block_d, m_blocks=m_blocks, min_chunk=min_chunk,
                num_warps=4 if block_m <= 32 else 8, num_stages=3 if split else 2,
                precision="tf32x3" if dtype == torch.float32 else "tf32")  # fp32: ~fp32 accuracy on tensor cores


__all__ = ["LONG_ROW_SPLIT_KEYS", "SPLIT_MAX_TQ", "bandwidth_split_rule", "plan"]
