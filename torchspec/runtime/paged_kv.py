"""Paged KV cache: a pool of fixed-size pages shared by all sequences, a block table per sequence.

Layout. Keys and values of every layer live in one flat slot pool per layer,
``k[layer] : [num_pages * page_size, kv_heads, head_dim]``; slot ``page * page_size + offset``.
A sequence's logical position ``j`` is stored at slot ``block_table[j // page_size] * page_size
+ j % page_size`` (a hybrid target has pools for its attention layers only: ``PagedKVCache.pool``).
Page 0 is the **trash page**: never handed to a sequence, it receives the writes of padding
rows/tokens so every forward has a static shape (what CUDA graphs need).

A forward's new K/V go into the pools first (``write_kv``: keys and values in one Triton kernel on
CUDA, ``kv_write_triton.py``; two ``index_copy_`` elsewhere). Attention over the cache
(``paged_attention``) follows a compact description built once per forward by
``build_attention_meta`` (block table, committed lengths, anchors, window, tree mask). On CUDA the
Triton kernels (``paged_attention_triton.py``) read each row's pages in place up to its length;
the reference (CPU) gathers a row's pages into a contiguous ``[S = pages_per_row * page_size]``
key range and applies the same rule as a dense boolean mask. One mask rule serves
prefill, plain decode, tree verification and the drafter's windowed attention:

    key j of row b is visible to query i  iff
        j <  ctx_len[b]  and  anchor[b, i] - window < j <= anchor[b, i]      (committed prefix)
     or ctx_len[b] <= j < ctx_len[b] + R + Tq  and  tree_mask[b, i, j - ctx_len[b]]   (uncommitted tokens)

where this forward's Tq tokens are written at logical positions ctx_len + R .. ctx_len + R + Tq - 1
after R uncommitted tokens of earlier forwards of the same round (the drafter writes a tree one
depth per forward; R = 0 everywhere else, so tree_mask is [B, Tq, Tq]), and
``anchor`` is the last committed position a query may see (ctx_len - 1 for the target; the
drafter's step-0 queries anchor at their own position so its sliding window applies).

Host bookkeeping (``PageAllocator``) hands out and takes back pages; ``free_pages`` after a batch
equals the pool size minus the trash page (a test checks no page leaks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchspec.attend import in_window
from torchspec.targets.fused_ops import fused

TRASH_PAGE = 0


class PageAllocator:
    """Host-side free list over pages 1..num_pages-1 (page 0 is the trash page).

    ``reclaim(n)`` (optional; the engine's prefix cache, ``prefix_cache.PrefixCache.evict``) is asked
    for up to n pages it can give back before ``alloc`` reports the pool out of pages."""

    def __init__(self, num_pages: int, reclaim: Callable[[int], list[int]] | None = None):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: the pool needs the trash page plus at least one page.")
        self.num_pages = num_pages
        self.reclaim = reclaim
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free) and self.reclaim is not None:
            self.free(self.reclaim(n - len(self._free)))
        if n > len(self._free):
            raise MemoryError(
                f"KV cache out of pages: {n} needed, {len(self._free)} free of {self.capacity}; raise "
                f"num_pages (or lower max_batch / max_context).")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        if any(p == TRASH_PAGE for p in pages):
            raise ValueError("the trash page cannot be freed")
        self._free.extend(pages)


class PagedKVCache:
    """Per-layer flat slot pools ``k[i], v[i] : [num_pages * page_size, kv_heads, head_dim]``.

    ``layer_ids``: the model's (global) ids of the attention layers the pools hold, in pool order;
    None = every layer, pool i = layer i. A hybrid target keeps KV for its attention layers only
    (its Gated DeltaNet layers keep recurrent state: ``torchspec/runtime/recurrent_state.py``)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, layer_ids: list[int] | None = None):
        if layer_ids is not None and len(layer_ids) != num_layers:
            raise ValueError(f"PagedKVCache: {len(layer_ids)} layer_ids for num_layers={num_layers} pools.")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.layer_index = None if layer_ids is None else {int(g): i for i, g in enumerate(layer_ids)}
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_target(cls, decoder, num_pages: int, page_size: int, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None) -> PagedKVCache:
        """An empty cache for a ``TargetDecoder``'s attention layers and this rank's KV heads (default:
        the decoder's dtype and device): every layer of a Llama-family target, only
        ``decoder.attention_layer_ids`` of a hybrid one."""
        a, w = decoder.args, decoder.embed_tokens.weight
        ids = None if a.recurrent is None else list(decoder.attention_layer_ids)
        n = a.num_layers if ids is None else len(ids)
        return cls(n, num_pages, page_size, a.num_kv_heads, a.head_dim, dtype or w.dtype, device or w.device, ids)

    def pool(self, layer: int) -> int:
        """The pool index of model layer ``layer``."""
        return layer if self.layer_index is None else self.layer_index[layer]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V of every layer from flat slots ``src`` to ``dst`` (same shape; gather first, so
        overlapping src/dst sets are safe). Used for accepted-path compaction."""
        src, dst = src.reshape(-1), dst.reshape(-1)
        for pool in (self.k, self.v):
            pool[:, dst] = pool[:, src]


@dataclass
class AttentionMeta:
    """Static-shape description of one forward over the paged cache (shared by all layers).

    The compact fields are what the Triton kernels read; ``key_slots`` and ``mask`` (the gather
    reference's dense view, ``[B, S]`` and ``[B, 1, Tq, S]`` with S = P * page_size) are built on
    first use, so a forward on the kernels never materialises them."""

    write_slots: torch.Tensor  # [B, Tq] flat slot each new token's K/V is written to
    block_table: torch.Tensor  # [B, P]
    ctx_len: torch.Tensor  # [B] committed keys of the row
    anchor: torch.Tensor  # [B, Tq] last committed position each query may see
    tree_mask: torch.Tensor  # [B, Tq, R + Tq] bool, over the uncommitted positions ctx_len .. ctx_len + R + Tq - 1
    page_size: int
    window: int | None = None

    @property
    def offset(self) -> int:
        """R: uncommitted tokens of earlier forwards of this round that precede this forward's."""
        return self.tree_mask.shape[-1] - self.tree_mask.shape[-2]

    @functools.cached_property
    def key_slots(self) -> torch.Tensor:
        """[B, S] flat slot of every logical key position 0..S-1 of the row."""
        b, p = self.block_table.shape
        offsets = torch.arange(self.page_size, device=self.block_table.device)
        return (self.block_table[:, :, None] * self.page_size + offsets).reshape(b, p * self.page_size)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, Tq, S] bool, True = attend: the rule of the module docstring, spelled out densely."""
        b, p = self.block_table.shape
        tq, width = self.tree_mask.shape[-2], self.tree_mask.shape[-1]
        s = p * self.page_size
        j = torch.arange(s, device=self.block_table.device)[None, None, :]  # [1, 1, S]
        ctx = self.ctx_len[:, None, None]
        committed = (j < ctx) & in_window(self.anchor[:, :, None], j, self.window)  # THE window rule
        rel = j - ctx  # [B, 1, S]
        in_new = (rel >= 0) & (rel < width)
        tree_ok = torch.gather(self.tree_mask, 2, rel.clamp(0, width - 1).expand(b, tq, s))
        return (committed | (in_new & tree_ok))[:, None]


# A forward reads the block table's first columns only: up to its longest row's keys, rounded up to a power of two
# and at least this many. The attention plan (its split count) then follows the batch's lengths, not max_context.
MIN_TABLE_KEYS = 1024


def table_columns(keys: int, page_size: int, max_columns: int) -> int:
    """Block-table columns a forward over rows of at most ``keys`` keys (committed + this forward's) reads:
    ``keys`` rounded up to a power of two, at least ``MIN_TABLE_KEYS``, at most the table."""
    bucket = max(MIN_TABLE_KEYS, 1 << max(0, keys - 1).bit_length())
    return min(max_columns, -(-bucket // page_size))


def slots_for_positions(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Logical positions [B, T] -> flat slots [B, T] through the rows' block tables [B, P].

    Positions beyond the table map to the trash page (never onto another position's slot)."""
    index = positions // page_size
    inside = index < block_table.shape[1]
    page = torch.gather(block_table, 1, index.clamp(max=block_table.shape[1] - 1))
    page = torch.where(inside, page, torch.full_like(page, TRASH_PAGE))
    return page * page_size + positions % page_size


def build_attention_meta(
    block_table: torch.Tensor,
    ctx_len: torch.Tensor,
    tree_mask: torch.Tensor,
    page_size: int,
    anchor: torch.Tensor | None = None,
    window: int | None = None,
    row_valid: torch.Tensor | None = None,
) -> AttentionMeta:
    """Metadata for a forward of Tq new tokens per row written after ``ctx_len`` committed ones.

    block_table [B, P] (unused entries = trash page), ctx_len [B], tree_mask [B, Tq, Tq] bool
    (which of this forward's tokens each query sees: causal for prefill, ancestors-or-self for a
    tree; [B, Tq, R + Tq] when R uncommitted tokens of this round precede them), anchor [B, Tq] (default ctx_len - 1), window (None = unbounded), row_valid [B] (False
    rows write to the trash page).
    """
    tq, width = tree_mask.shape[-2], tree_mask.shape[-1]  # width = R + Tq
    write_slots = _write_slots(block_table, ctx_len, row_valid, width - tq, tq, page_size)
    if anchor is None:
        anchor = (ctx_len - 1)[:, None].expand(block_table.shape[0], tq)
    return AttentionMeta(write_slots=write_slots, block_table=block_table, ctx_len=ctx_len, anchor=anchor,
                         tree_mask=tree_mask, page_size=page_size, window=window)


@fused
def _write_slots(block_table: torch.Tensor, ctx_len: torch.Tensor, row_valid: torch.Tensor | None, start: int,
                 tq: int, page_size: int) -> torch.Tensor:
    """Flat write slots [B, Tq] of logical positions ctx_len + start .. + Tq - 1, invalid rows on the trash
    page: one fused region on CUDA."""
    offsets = torch.arange(start, start + tq, device=block_table.device)
    write_slots = slots_for_positions(block_table, ctx_len[:, None] + offsets, page_size)  # [B, Tq]
    if row_valid is not None:
        write_slots = torch.where(row_valid[:, None], write_slots, torch.full_like(write_slots, TRASH_PAGE * page_size))
    return write_slots


class PagedAttend:
    """The `torchspec.attend.Attend` of serving: ``attend(layer, q, k, v)`` writes this forward's K/V
    into ``cache``'s pools of ``layer`` and attends over the rows' pages as ``meta`` says."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMeta):
        self.cache, self.meta = cache, meta

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        i = self.cache.pool(layer)
        return paged_attention(q, k, v, self.cache.k[i], self.cache.v[i], self.meta, q.shape[-1] ** -0.5)


def paged_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
    meta: AttentionMeta, scale: float,
) -> torch.Tensor:
    """Write this forward's K/V into the pool, then attend over the row's keys as ``meta`` says.

    q [B, heads, Tq, D]; k_new/v_new [B, kv_heads, Tq, D]; k_pool/v_pool [slots, kv_heads, D] (one
    layer). Returns [B, heads, Tq, D]. On CUDA with Triton the kernels of
    ``paged_attention_triton.py`` read pages in place up to each row's length; elsewhere (and for
    head sizes they do not take) the gather reference below.
    """
    write_kv(k_new, v_new, k_pool, v_pool, meta.write_slots)
    kernel = _triton_kernel() if q.is_cuda else None
    if kernel is not None and kernel.supports(q):
        return kernel.paged_attention_triton(q, k_pool, v_pool, meta, scale)
    return paged_attention_reference(q, k_pool, v_pool, meta, scale)


def write_kv(k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k_new/v_new [B, kv_heads, Tq, D] into one layer's pools [slots, kv_heads, D] at flat ``slots`` [B, Tq]:
    keys and values in one kernel on CUDA (``kv_write_triton.py``), else `write_kv_reference`."""
    kernel = _kv_write_kernel() if k_new.is_cuda else None
    if kernel is not None:
        kernel.write_kv_triton(k_new, v_new, k_pool, v_pool, slots)
    else:
        write_kv_reference(k_new, v_new, k_pool, v_pool, slots)


def write_kv_reference(k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       slots: torch.Tensor) -> None:
    """`write_kv` as two ``index_copy_`` (two kernels on a GPU)."""
    b, kvh, tq, d = k_new.shape
    flat = slots.reshape(-1)
    k_pool.index_copy_(0, flat, k_new.transpose(1, 2).reshape(-1, kvh, d).to(k_pool.dtype))
    v_pool.index_copy_(0, flat, v_new.transpose(1, 2).reshape(-1, kvh, d).to(v_pool.dtype))


def paged_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMeta,
                              scale: float) -> torch.Tensor:
    """Gather every page of each row's block table ([B, kv_heads, S, D]) and apply the dense mask."""
    kvh, d = k_pool.shape[1], k_pool.shape[2]
    b, s = meta.key_slots.shape
    flat_keys = meta.key_slots.reshape(-1)  # index_select: far cheaper than advanced indexing
    keys = k_pool.index_select(0, flat_keys).view(b, s, kvh, d).transpose(1, 2).to(q.dtype)  # [B, kv_h, S, D]
    values = v_pool.index_select(0, flat_keys).view(b, s, kvh, d).transpose(1, 2).to(q.dtype)
    if q.device.type == "cpu":  # CPU SDPA on strided operands takes a path ~300x slower; CUDA kernels don't care
        q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.mask, scale=scale,
                                          enable_gqa=q.shape[1] != kvh)


@functools.cache
def _triton_kernel():
    """The Triton module, or None where Triton is not installed (imported on first CUDA use only)."""
    try:
        from torchspec.runtime import paged_attention_triton
    except ImportError:
        return None
    return paged_attention_triton


@functools.cache
def _kv_write_kernel():
    """The Triton KV write, or None where Triton is not installed (imported on first CUDA use only)."""
    try:
        from torchspec.runtime import kv_write_triton
    except ImportError:
        return None
    return kv_write_triton
