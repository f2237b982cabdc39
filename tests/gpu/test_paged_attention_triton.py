"""The Triton paged-attention kernels equal the gather reference (``paged_kv.paged_attention_reference``).

Runs on CUDA, or on CPU under Triton's interpreter (``TRITON_INTERPRET=1`` with triton importable;
small shapes); skipped otherwise. On CPU pass ``--noconftest`` (tests/conftest.py skips all of
tests/gpu/ without CUDA):

    TRITON_INTERPRET=1 python -m pytest --noconftest tests/gpu/test_paged_attention_triton.py

Cases: plain decode, tree verification with random trees, drafter forwards with R > 0 earlier
uncommitted tokens, sliding window with per-query anchors (drafter step 0 and depths), GQA 1/4/8,
head_dim 64/128 (and 16, 80), pages of 16/64, rows of very different lengths (one shorter than a
page, one empty), forced split counts, keys past a row's block table, chunked prefill (direct mode,
with and without a committed prefix), fp16 (and bf16 on CUDA: the interpreter's tl.dot multiplies
bf16 bit patterns). Pools are random everywhere, so a key the rule hides but the kernel reads
would show.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from torchspec.runtime.paged_kv import build_attention_meta, paged_attention
from torchspec.runtime.steps import causal_mask
from torchspec.runtime.tree import tree_attention_mask

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA, or TRITON_INTERPRET=1 with triton")
DEV = "cuda" if CUDA else "cpu"


def _kernel():
    from torchspec.runtime.paged_attention_triton import paged_attention_triton

    return paged_attention_triton


def _scenario(ctx, tq, kvh, group, d, page, pages_per_row, width=None, dtype=torch.float32, seed=0):
    """Random pools, scattered block tables (unused entries = trash page), q and this forward's K/V."""
    g = torch.Generator().manual_seed(seed)
    b = len(ctx)
    width = width or tq
    num_pages = b * pages_per_row + 3
    pool = lambda: torch.randn(num_pages * page, kvh, d, generator=g).to(dtype).to(DEV)  # noqa: E731
    k_pool, v_pool = pool(), pool()
    perm = torch.randperm(num_pages - 1, generator=g)[: b * pages_per_row] + 1
    bt = perm.view(b, pages_per_row).clone()
    for row, n in enumerate(ctx):  # pages past what the row needs stay on the trash page, as the engine leaves them
        bt[row, -(-(n + width) // page):] = 0
    q = torch.randn(b, kvh * group, tq, d, generator=g).to(dtype)
    k_new, v_new = (torch.randn(b, kvh, tq, d, generator=g).to(dtype) for _ in range(2))
    return (bt.to(DEV), torch.tensor(ctx, device=DEV), q.to(DEV), k_new.to(DEV), v_new.to(DEV), k_pool, v_pool)


def _random_tree(b, n, seed):
    g = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
                           for _ in range(b)])
    return tree_attention_mask(parents)  # [B, N, N]


def _check(s, tree_mask, page, anchor=None, window=None, num_splits=None, tol=2e-5):
    bt, ctx, q, k_new, v_new, k_pool, v_pool = s
    meta = build_attention_meta(bt, ctx, tree_mask.to(DEV), page,
                                anchor=None if anchor is None else anchor.to(DEV), window=window)
    scale = q.shape[-1] ** -0.5
    ref = paged_attention(q.cpu(), k_new.cpu(), v_new.cpu(), k_pool.cpu(), v_pool.cpu(),
                          build_attention_meta(bt.cpu(), ctx.cpu(), tree_mask.cpu(), page,
                                               anchor=None if anchor is None else anchor.cpu(), window=window),
                          scale)  # writes this forward's K/V into the CPU copies (the reference path)
    kp, vp = k_pool.clone(), v_pool.clone()
    kp.index_copy_(0, meta.write_slots.reshape(-1), k_new.transpose(1, 2).reshape(-1, *kp.shape[1:]))
    vp.index_copy_(0, meta.write_slots.reshape(-1), v_new.transpose(1, 2).reshape(-1, *vp.shape[1:]))
    got = _kernel()(q, kp, vp, meta, scale, num_splits=num_splits)
    assert "mask" not in vars(meta) and "key_slots" not in vars(meta)  # the kernels never build the dense view
    assert got.shape == ref.shape and torch.isfinite(ref.float()).all()
    err = (got.float().cpu() - ref.float()).abs().max().item()
    assert err <= tol, err


@pytest.mark.parametrize("group,d,page", [(1, 64, 16), (4, 128, 16), (8, 64, 64), (4, 80, 16), (4, 16, 16)])
def test_decode(group, d, page):
    ctx = [5, 300, 37, 0]  # < one page, several pages, odd, empty (the query sees only itself)
    s = _scenario(ctx, 1, 2, group, d, page, pages_per_row=-(-320 // page))
    _check(s, torch.ones(4, 1, 1, dtype=torch.bool), page)


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_decode_split_counts(num_splits):
    s = _scenario([700, 9, 130], 1, 2, 4, 64, 16, pages_per_row=48, seed=1)
    _check(s, torch.ones(3, 1, 1, dtype=torch.bool), 16, num_splits=num_splits)


@pytest.mark.parametrize("nodes,group,d,page", [(16, 4, 128, 16), (32, 8, 64, 64), (17, 1, 64, 16)])
def test_tree_verify(nodes, group, d, page):
    ctx = [3, 150, 61]
    s = _scenario(ctx, nodes, 2, group, d, page, pages_per_row=-(-(150 + nodes) // page) + 1, seed=2)
    _check(s, _random_tree(3, nodes, seed=3), page)


@pytest.mark.parametrize("window", [None, 8, 40])
def test_drafter_depth_with_earlier_uncommitted(window):
    """Depth d of a draft tree: R earlier draft tokens, anchor ctx - 1 for every query, window."""
    ctx, f, r = [2, 90, 33], 4, 6
    s = _scenario(ctx, f, 2, 4, 64, 16, pages_per_row=8, width=r + f, seed=4)
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(3, f, r + f, generator=g) < 0.4
    mask[:, torch.arange(f), r + torch.arange(f)] = True  # itself
    anchor = (torch.tensor(ctx) - 1)[:, None].expand(3, f)
    _check(s, mask, 16, anchor=anchor, window=window)


@pytest.mark.parametrize("window", [None, 5, 24])
def test_drafter_catch_up_anchored_at_own_position(window):
    """Step-0 entries: query t anchored at ctx + t, causal-in-window among the new tokens."""
    ctx, t = [40, 0, 7], 6
    s = _scenario(ctx, t, 1, 4, 64, 16, pages_per_row=4, seed=6)
    anchor = torch.tensor(ctx)[:, None] + torch.arange(t)
    _check(s, causal_mask(3, t, "cpu", window), 16, anchor=anchor, window=window)


@pytest.mark.parametrize("ctx,group,d", [([0, 0], 4, 64), ([100, 7], 4, 128), ([33, 64], 1, 64), ([0, 0], 4, 16)])
def test_chunked_prefill(ctx, group, d):
    """Tq above the split limit: one program per query block walks prefix and chunk (direct mode)."""
    tq = 80
    s = _scenario(ctx, tq, 2, group, d, 16, pages_per_row=-(-(max(ctx) + tq) // 16) + 1, seed=7)
    _check(s, causal_mask(2, tq, "cpu"), 16)


def test_keys_beyond_the_block_table_are_invisible():
    """A row whose uncommitted tokens run past its table: those writes hit the trash page and the
    reference sees no key there; neither may the kernel."""
    page, nodes = 16, 8
    s = _scenario([44, 10], nodes, 2, 4, 64, page, pages_per_row=3, seed=8)
    _check(s, causal_mask(2, nodes, "cpu"), page)  # row 0: positions 48..51 lie past its 3 pages


HALF = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]  # the interpreter's tl.dot multiplies bf16 bit patterns


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("tq", [1, 33, 80])
def test_half_precision(tq, dtype):
    s = _scenario([150, 20, 70, 3], tq, 2, 4, 128, 16, pages_per_row=16, dtype=dtype, seed=9)
    mask = causal_mask(4, tq, "cpu") if tq > 64 else _random_tree(4, tq, seed=10)
    _check(s, mask, 16, tol=2e-2)


@pytest.mark.skipif(not CUDA, reason="long rows: CUDA only")
@pytest.mark.parametrize("tq", [1, 33, 200])
def test_bf16_long_rows(tq):
    s = _scenario([1500, 20, 700, 4000], tq, 8, 4, 128, 16, pages_per_row=270, dtype=torch.bfloat16, seed=9)
    mask = causal_mask(4, tq, "cpu") if tq > 64 else _random_tree(4, tq, seed=10)
    _check(s, mask, 16, tol=2e-2)


@pytest.mark.skipif(not CUDA, reason="dispatch: CUDA only")
def test_paged_attention_dispatches_to_the_kernels_on_cuda():
    """``paged_attention`` writes this forward's K/V, then runs the kernels (no dense mask built)."""
    bt, ctx, q, k_new, v_new, k_pool, v_pool = _scenario([90, 5], 9, 2, 4, 128, 16, pages_per_row=8, seed=11)
    tree = _random_tree(2, 9, seed=12).to(DEV)
    meta = build_attention_meta(bt, ctx, tree, 16)
    got = paged_attention(q, k_new, v_new, k_pool, v_pool, meta, 128 ** -0.5)
    assert "mask" not in vars(meta)
    ref = paged_attention(q.cpu(), k_new.cpu(), v_new.cpu(), k_pool.cpu(), v_pool.cpu(),
                          build_attention_meta(bt.cpu(), ctx.cpu(), tree.cpu(), 16), 128 ** -0.5)
    assert (got.cpu() - ref).abs().max().item() <= 2e-5
