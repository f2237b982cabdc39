"""Triton attention over the paged KV cache whose cost follows each row's length, not max_context.

``paged_attention_triton(q, k_pool, v_pool, meta, scale)`` computes what the gather reference in
``paged_kv.py`` computes, with the compact description carried by ``AttentionMeta`` (block table,
committed lengths, anchors, window, tree mask) instead of a dense ``[B, 1, Tq, S]`` mask. The mask
rule is the one stated in ``paged_kv.py``'s docstring; ``tests/gpu/test_paged_attention_triton.py``
checks the kernels against the reference on random trees, windows, anchors and lengths.

One kernel, two modes, grid ``(query blocks, B * kv_heads, splits)``:

* Each program owns one KV head of one row and a block of BLOCK_M query rows of that head's group:
  row m is query ``m // G``, head ``kvh * G + m % G`` (G = heads / kv_heads), so GQA is in the
  kernel and the keys of a page are read once for all G heads and all Tq queries (several query
  blocks only when G * Tq > BLOCK_M; they run side by side, so the second read hits L2).
* Keys are read straight from the pool: position j of row b is slot ``block_table[b, j // page]
  * page + j % page``. No gather copy, no GQA expansion.
* **Committed prefix**: positions ``[lo, hi)`` with ``hi = min(ctx_len, max anchor + 1)`` and
  ``lo = max(0, min anchor - window + 1)`` over the block's queries, then the per-query rule
  ``anchor - window < j <= anchor``. Work is proportional to ``hi - lo`` -- the row's length (or
  its window), never the block table's width.
* **Uncommitted keys** (this round's R earlier tokens and this forward's Tq, positions ``ctx_len ..
  ctx_len + R + Tq - 1``): a loop over ``tree_mask[b, i, :]`` tiles; a tile no query of the block
  sees is skipped (the upper triangle of a causal prefill chunk).

*Split mode* (decode, tree verification, drafter forwards: Tq <= ``SPLIT_MAX_TQ``) is
flash-decoding: ``num_splits`` programs share a row's committed range (each a contiguous chunk of
at least ``min_chunk`` keys: one key tile when all partials fit in a quarter of L2, the small
latency-bound grids of verification and drafting, else enough that the fp32 partials stay small
against the KV they summarise; a chunk starting past the row's end does nothing), one more program takes the uncommitted keys, and
``_combine`` merges the partial (output, log-sum-exp) pairs. *Direct mode* (chunked prefill) has
one program per query block walk both parts and write the output. Grids and split counts depend
on shapes only, and lengths are read from GPU tensors: the kernels can be CUDA-graph captured.
Online softmax in fp32 with base-2 exponentials; fp32 inputs use 3xTF32 dot products (fp32-level
error on tensor cores; IEEE dot products spill registers at any useful tile), so fp32 serving stays
about as exact as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchspec.runtime.attention_plan import SPLIT_MAX_TQ, bandwidth_split_rule, plan

MAX_HEAD_DIM = 256
NO_WINDOW = 1 << 30


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_pool, v_pool, slot, key_ok, visible, k_head, v_head, sk_s, sv_s,
                 offs_d, d_ok, qk_scale, PREC: tl.constexpr):
    """One online-softmax step over BLOCK_N keys at flat pool slots ``slot``."""
    kt = tl.load(k_pool + slot[None, :] * sk_s + k_head + offs_d[:, None],
                 mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # [D, N]
    s = tl.dot(q, kt.to(q.dtype), input_precision=PREC) * qk_scale  # [M, N], log2 units
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_pool + slot[:, None] * sv_s + v_head + offs_d[None, :],
                mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    q, k_pool, v_pool, block_table, ctx_len, anchor, tree_mask, out, o_part, lse_part,
    sq_b, sq_h, sq_t, sk_s, sk_h, sv_s, sv_h, sbt_b, sbt_p, sc_b, sa_b, sa_t, stm_b, stm_i, stm_j, so_b, so_t, so_h,
    num_kv_heads, tq, width, max_keys, window, min_chunk, num_splits, qk_scale,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PREC: tl.constexpr,
):
    mb, bh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = bh // num_kv_heads
    kvh = bh % num_kv_heads
    rows = tq * GROUP
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < rows
    qi = offs_m // GROUP  # query index
    head = kvh * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    qt = tl.load(q + b * sq_b + head[:, None] * sq_h + qi[:, None] * sq_t + offs_d[None, :],
                 mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    ctx = tl.load(ctx_len + b * sc_b).to(tl.int32)
    anc = tl.load(anchor + b * sa_b + qi * sa_t, mask=m_ok, other=0).to(tl.int32)  # [M]
    k_head = kvh * sk_h
    v_head = kvh * sv_h
    bt_row = block_table + b * sbt_b
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    if split < num_splits:  # committed prefix: this split's chunk of [lo, hi)
        lo = tl.maximum(tl.min(tl.where(m_ok, anc, 1 << 30)) - window + 1, 0)
        hi = tl.minimum(tl.minimum(ctx, tl.max(tl.where(m_ok, anc, -1)) + 1), max_keys)
        span = tl.maximum(hi - lo, 0)
        chunk = tl.maximum((span + num_splits - 1) // num_splits, min_chunk)
        chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, hi)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            key_ok = pos < end
            page = tl.load(bt_row + (pos // PAGE) * sbt_p, mask=key_ok, other=0).to(tl.int64)
            slot = page * PAGE + pos % PAGE
            visible = (key_ok[None, :] & (pos[None, :] <= anc[:, None])
                       & (pos[None, :] > anc[:, None] - window))
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, qt, k_pool, v_pool, slot, key_ok, visible, k_head, v_head,
                                         sk_s, sv_s, offs_d, d_ok, qk_scale, PREC)

    if (not SPLIT) or (split == num_splits):  # uncommitted keys ctx .. ctx + width - 1, by the tree mask
        for n0 in range(0, width, BLOCK_N):
            jj = n0 + tl.arange(0, BLOCK_N)
            pos = ctx + jj
            key_ok = (jj < width) & (pos < max_keys)
            seen = tl.load(tree_mask + b * stm_b + qi[:, None] * stm_i + jj[None, :] * stm_j,
                           mask=m_ok[:, None] & key_ok[None, :], other=0)
            visible = seen != 0
            if tl.max(visible.to(tl.int32)) > 0:
                page = tl.load(bt_row + (pos // PAGE) * sbt_p, mask=key_ok, other=0).to(tl.int64)
                slot = page * PAGE + pos % PAGE
                acc, m_i, l_i = _attend_tile(acc, m_i, l_i, qt, k_pool, v_pool, slot, key_ok, visible, k_head,
                                             v_head, sk_s, sv_s, offs_d, d_ok, qk_scale, PREC)

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        part = (bh * rows + offs_m) * (num_splits + 1) + split
        tl.store(lse_part + part, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=m_ok)
        tl.store(o_part + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=m_ok[:, None] & d_ok[None, :] & has[:, None])
    else:
        tl.store(out + b * so_b + qi[:, None] * so_t + head[:, None] * so_h + offs_d[None, :],
                 o.to(out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine(o_part, lse_part, out, num_kv_heads, tq, num_parts, so_b, so_t, so_h,
             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the ``num_parts`` (output, log2-sum-exp) partials of one query row of one head."""
    r = tl.program_id(0)  # over B * kv_heads * Tq * G
    rows = tq * GROUP
    bh = r // rows
    m = r % rows
    b = bh // num_kv_heads
    head = (bh % num_kv_heads) * GROUP + m % GROUP
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(lse_part + r * num_parts + offs_s, mask=offs_s < num_parts, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # 0 for empty parts
    used = w > 0  # parts that saw no key never wrote their output
    o = tl.load(o_part + (r * num_parts + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                mask=used[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + b * so_b + (m // GROUP) * so_t + head * so_h + offs_d, res.to(out.dtype.element_ty), mask=d_ok)


def supports(q: torch.Tensor) -> bool:
    """Whether the kernels take this head size (16..256, any; padded to a power of two)."""
    return 16 <= q.shape[-1] <= MAX_HEAD_DIM


def paged_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta,
                           scale: float, num_splits: int | None = None) -> torch.Tensor:
    """q [B, heads, Tq, D] over one layer's pools k/v [slots, kv_heads, D] as ``meta`` (an
    ``AttentionMeta``, this forward's K/V already written) says -> [B, heads, Tq, D] in q's dtype."""
    b, heads, tq, d = q.shape
    kvh = k_pool.shape[1]
    assert heads % kvh == 0 and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = heads // kvh
    bt, tree = meta.block_table, meta.tree_mask.view(torch.uint8)  # same bytes, no copy
    max_keys = bt.shape[1] * meta.page_size
    cfg = plan(b, kvh, tq, group, d, max_keys, q.dtype, q.device, num_splits)
    out = torch.empty(b, tq, heads, d, dtype=q.dtype, device=q.device)  # o_proj wants [B, Tq, heads * D]
    ns = cfg["num_splits"]
    if cfg["split"]:
        o_part = torch.empty(b * kvh * tq * group * (ns + 1), d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(b * kvh * tq * group * (ns + 1), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # unused
    grid = (cfg["m_blocks"], b * kvh, ns + 1 if cfg["split"] else 1)
    _paged_attention_kernel[grid](
        q, k_pool, v_pool, bt, meta.ctx_len, meta.anchor, tree, out, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        bt.stride(0), bt.stride(1), meta.ctx_len.stride(0), meta.anchor.stride(0), meta.anchor.stride(1),
        tree.stride(0), tree.stride(1), tree.stride(2), out.stride(0), out.stride(1), out.stride(2),
        kvh, tq, tree.shape[-1], max_keys, NO_WINDOW if meta.window is None else meta.window, cfg["min_chunk"], ns,
        scale * 1.4426950408889634,  # log2(e): softmax in base 2
        GROUP=group, PAGE=meta.page_size, HEAD_DIM=d, BLOCK_D=cfg["block_d"], BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"], SPLIT=cfg["split"],
        PREC=cfg["precision"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if cfg["split"]:
        _combine[(b * kvh * tq * group,)](
            o_part, lse_part, out, kvh, tq, ns + 1, out.stride(0), out.stride(1), out.stride(2),
            GROUP=group, HEAD_DIM=d, BLOCK_D=cfg["block_d"],
            BLOCK_S=triton.next_power_of_2(ns + 1), num_warps=4 if d <= 128 else 8,
        )
    return out.transpose(1, 2)


__all__ = ["paged_attention_triton", "plan", "supports", "bandwidth_split_rule", "SPLIT_MAX_TQ"]
