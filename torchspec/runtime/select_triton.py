"""Top-k candidate selection over the vocabulary in two Triton launches (the serving drafter head).

``topk_indices_triton(scores [N, V], k) -> [N, k] int64`` returns the indices of the k largest
scores of every row; ``EfficientLMHead.candidates`` uses it in serving (``fast_select``, set by
``fuse_serving_layers``) where ``supports`` holds. Why: for the drafter head's shapes (N = batch x
frontier = 1..64 rows, V = 49K..248K) ``torch.topk``'s radix select launches ~10-12 kernels per
call (digit counts, scans, gathers, memsets), and a CUDA-graphed decode round is launch-bound.

**Keys.** Each score becomes one integer key whose signed order is (score, then lower index): the
float's bits with the non-sign bits flipped when negative (order-preserving), in the high half,
2^31 - 1 - index in the low half. So a key compare is the whole tie rule, the index
travels with the value through the selection, and the selection is deterministic: **among equal
scores the lower index wins**. -0.0 is read as +0.0 (they tie); -inf is an ordinary value (it
loses to every finite score, wins over padding); **NaN ranks above +inf** (as ``torch.topk``
ranks it), which is a rule, not a promise that NaN rows make sense. 16-bit scores (bf16, fp16) use
int32 keys (16 value bits + a 16-bit index within the block), half the work of the int64 keys of
fp32 scores (32 + 32 bits).

**Two launches** (``plan`` picks the sizes from shapes only, so a call captures in a CUDA graph;
scratch comes from ``torch.empty``, the graph's pool when captured):

    _block_topk   grid (N, ceil(V / BLOCK_V)): one block of BLOCK_V scores -> its KP best keys,
                  KP = k rounded up to a power of two, written as int64 (score, global index) keys
                  to scratch [N, blocks * KP]. A row's top k lies in the union of its blocks' top KP.
    _merge_topk   grid (N,): the row's blocks * KP keys (padded to a power of two) -> top KP ->
                  the first k indices.

When one block covers the row (V <= BLOCK_V), ``_block_topk`` writes the indices itself: one
launch. Both selections are ``tl.topk`` (Triton >= 3.4: a bitonic sort of KP-chunks, then halving
by elementwise max of bitonic pairs, Shanbhag et al. 2018), about log2(KP) (log2(KP) + 1) / 2
compare-swap stages per element whatever the block size. A block size therefore trades the
parallel pass's critical path (BLOCK_V elements per program) against the serial merge
(blocks * KP keys in one program): ``plan`` minimises that sum (the merge weighted 2x, int64
keys), which puts BLOCK_V near sqrt(V * KP): 4096 for SmolLM2's 49K at k=128, 8192 for 248K.
A torch.topk within chunks, then over the winners, was slower than one radix select: its
single-block select of each stage runs serially; here every block is one program with the whole
selection in registers.

**Order returned**: sorted, best first (score descending, ties by ascending index) -- a property of
the bitonic selection, not needed by the callers (``candidates`` treats its ids as a set).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 128  # the largest k tested; KP <= 128 keeps a block's selection in registers
MAX_MERGE = 16384  # the most keys one merge program holds (int64: 128 KB across 16 warps)
BLOCK_SIZES = (1024, 2048, 4096, 8192, 16384)  # candidate BLOCK_V; <= 65536 (16-bit in-block index)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
HAS_TOPK = hasattr(tl, "topk")  # Triton >= 3.4

_PAD32 = tl.constexpr(-0x7FFFFFFF)  # below every real int32 key (whose value half is >= ord(-inf) = -32641)
_PAD64 = tl.constexpr(-0x7FFFFFFFFFFFFFFF)  # below every real int64 key


@triton.jit
def _top(keys, KP: tl.constexpr):
    """[n] keys -> their KP largest [KP], best first (tl.topk; k = 1 reduces to a scalar there)."""
    if KP == 1:
        top = tl.max(keys, axis=0, keep_dims=True)
    else:
        top = tl.topk(keys, KP)
    return top


@triton.jit
def _block_topk_kernel(scores, keys_out, ids_out, num_cols, stride_row, k,
                       BLOCK_V: tl.constexpr, KP: tl.constexpr, KEY16: tl.constexpr, IS_BF16: tl.constexpr,
                       DIRECT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    local = tl.arange(0, BLOCK_V)
    col = blk * BLOCK_V + local
    in_row = col < num_cols
    x = tl.load(scores + row * stride_row + col, mask=in_row, other=0.0)  # [BLOCK_V]
    if KEY16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32)
        bits = tl.where(bits == -32768, 0, bits)  # -0.0 -> +0.0
        ordered = tl.where(bits < 0, bits ^ 0x7FFF, bits)
        nan_above = 0x7F80 if IS_BF16 else 0x7C00
        ordered = tl.where((bits & 0x7FFF) > nan_above, 0x7FFF, ordered)  # NaN of either sign -> top
        key = (ordered << 16) | (0xFFFF - local)  # [BLOCK_V] int32
        key = tl.where(in_row, key, _PAD32)
        top = _top(key, KP)  # [KP], best first
        value = top >> 16  # arithmetic: the signed ordered value back
        gcol = (blk * BLOCK_V + (0xFFFF - (top & 0xFFFF))).to(tl.int64)
        wide = (value.to(tl.int64) << 32) | (0x7FFFFFFF - gcol)
        wide = tl.where(top == _PAD32, _PAD64, wide)
    else:
        xf = x.to(tl.float32)
        bits = tl.where(xf == 0.0, 0, xf.to(tl.int32, bitcast=True))  # -0.0 -> +0.0
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        ordered = tl.where(xf != xf, 0x7FFFFFFF, ordered)  # NaN of either sign -> top
        gcol = col.to(tl.int64)
        wide = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - gcol)
        wide = tl.where(in_row, wide, _PAD64)
        wide = _top(wide, KP)  # [KP], best first
    slot = tl.arange(0, KP)
    if DIRECT:  # one block covers the row: these are the answer
        tl.store(ids_out + row * k + slot, 0x7FFFFFFF - (wide & 0x7FFFFFFF), mask=slot < k)
    else:
        tl.store(keys_out + (row * tl.num_programs(1) + blk) * KP + slot, wide)


@triton.jit
def _merge_topk_kernel(keys, ids_out, num_keys, k, MERGE: tl.constexpr, KP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, MERGE)
    key = tl.load(keys + row * num_keys + offs, mask=offs < num_keys, other=_PAD64)  # [MERGE]
    top = _top(key, KP)  # [KP], best first
    slot = tl.arange(0, KP)
    tl.store(ids_out + row * k + slot, 0x7FFFFFFF - (top & 0x7FFFFFFF), mask=slot < k)


def _warps(elements: int) -> int:
    return max(4, min(16, elements // 512))


def plan(num_cols: int, k: int, dtype: torch.dtype, block_v: int | None = None) -> dict:
    """Launch sizes for a [*, num_cols] selection of k (shapes and dtype only, never values).

    ``block_v`` forces BLOCK_V (benchmark sweeps); default: the candidate size minimising
    ``BLOCK_V * w + 2 * MERGE`` (w = 1 for int32 keys, 2 for int64), the larger on a tie.
    """
    kp = triton.next_power_of_2(k)
    key16 = dtype in SIXTEEN_BIT
    whole = max(kp, triton.next_power_of_2(num_cols))

    def sizes(b: int) -> dict:
        blocks = triton.cdiv(num_cols, b)
        return {"block_v": b, "kp": kp, "blocks": blocks, "merge": triton.next_power_of_2(blocks) * kp,
                "key16": key16}

    if block_v is not None:
        return sizes(block_v)
    options = [b for b in BLOCK_SIZES if b >= kp]
    if whole <= options[0]:
        return sizes(whole)  # one block (and one launch) covers the row
    def cost(p: dict) -> tuple[int, int]:  # one block's keys (int64: 2x) + the serial merge (int64), larger first
        return p["block_v"] * (1 if key16 else 2) + 2 * p["merge"] * (p["blocks"] > 1), -p["block_v"]

    return min(map(sizes, options), key=cost)


def supports(scores: torch.Tensor, k: int) -> bool:
    """Whether ``topk_indices_triton`` takes this call: a Triton with ``tl.topk``, CUDA, bf16/fp16/fp32
    with a unit stride last dim, 1 <= k <= min(MAX_K, V), and V small enough for one merge program
    (up to ~2M at k = 128)."""
    if not (HAS_TOPK and scores.is_cuda and scores.dtype in (*SIXTEEN_BIT, torch.float32) and scores.dim() >= 1
            and scores.numel() > 0 and scores.stride(-1) == 1):
        return False
    num_cols = scores.shape[-1]
    if not (1 <= k <= min(MAX_K, num_cols) and num_cols < 2**31):
        return False
    p = plan(num_cols, k, scores.dtype)
    return p["blocks"] == 1 or p["merge"] <= MAX_MERGE


def topk_indices_triton(scores: torch.Tensor, k: int, block_v: int | None = None) -> torch.Tensor:
    """[..., V] scores -> [..., k] int64 indices of the k largest per row, best first (equal scores:
    lower index first). Call where ``supports(scores, k)``; ``block_v`` is for benchmark sweeps."""
    num_cols = scores.shape[-1]
    rows = scores.reshape(-1, num_cols)  # a view for the contiguous scores the head produces
    n = rows.shape[0]
    p = plan(num_cols, k, scores.dtype, block_v)
    assert p["block_v"] >= p["kp"] and (p["blocks"] == 1 or p["merge"] <= MAX_MERGE), p
    ids = torch.empty(n, k, dtype=torch.int64, device=scores.device)
    direct = p["blocks"] == 1
    keys = ids if direct else torch.empty(n, p["blocks"] * p["kp"], dtype=torch.int64, device=scores.device)
    _block_topk_kernel[(n, p["blocks"])](
        rows, keys, ids, num_cols, rows.stride(0), k, BLOCK_V=p["block_v"], KP=p["kp"], KEY16=p["key16"],
        IS_BF16=scores.dtype == torch.bfloat16, DIRECT=direct, num_warps=_warps(p["block_v"]))
    if not direct:
        _merge_topk_kernel[(n,)](keys, ids, p["blocks"] * p["kp"], k, MERGE=p["merge"], KP=p["kp"],
                                 num_warps=_warps(p["merge"]))
    return ids.view(*scores.shape[:-1], k)
