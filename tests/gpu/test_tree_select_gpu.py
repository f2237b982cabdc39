"""The dynamic tree's selection arithmetic as fused regions on CUDA (skipped without a GPU).

``torchspec/runtime/tree_select.py``: per depth the candidates' log-softmax + top-k, the frontier's
expansion (cumulative scores, stable sort, gathers) and the ancestor mask; once per round the kept
nodes' assembly. Compiled must equal eager exactly where the region is exact (scores with many ties,
so the stable sorts' order is exercised), to rounding for the log-sum-exp; and each region must
launch no more kernels than its eager ops, and at most its cap below.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda_kernels import kernel_total
from tests.gpu.test_round_glue_gpu import _same
from torchspec.runtime.tree_select import assemble_tree, expand_frontier, log_top, with_ancestors

pytestmark = pytest.mark.gpu
# Kernels per compiled region, measured on the H200 (torch 2.11, 2026-12-03, eleventh session), plus slack: a
# sort or top-k Inductor cannot fuse stays a kernel of its own (expand_frontier 9, assemble_tree 16-18 with its
# two stable sorts; with_ancestors and log_top over 128 candidates within 6). A full-vocabulary log_top (the
# dense-head path) took 28: its top-k is a multi-pass radix select, so it is held to the eager count only.
CAPS = {"expand_frontier": 10, "with_ancestors": 6, "assemble_tree": 20, "log_top": 6}


def _fused_and_capped(name: str, fused_fn, args, cap: bool = True) -> None:
    """Compiled == eager exactly (``_same``), no more kernels than eager, and within the region's cap."""
    compiled = _same(fused_fn, args)
    eager = kernel_total(lambda: fused_fn.__wrapped__(*args))
    assert compiled <= eager, f"{name}: compiled {compiled} kernels > eager {eager}"
    assert not cap or compiled <= CAPS[name], f"{name}: {compiled} kernels > cap {CAPS[name]}"


def _tied(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Log-probability-like scores on a coarse grid: many exact ties."""
    return -torch.randint(0, 6, shape, generator=g).float().div(4).cuda()


@pytest.mark.parametrize("b,k,h,last", [(1, 4, 64, False), (8, 4, 64, True), (3, 8, 96, False), (8, 8, 64, False)])
def test_expand_frontier_is_exact(b, k, h, last):
    g = torch.Generator().manual_seed(b * k)
    args = (_tied(g, b, k), _tied(g, b, k, k), torch.randint(0, 1000, (b, k, k), generator=g).cuda(),
            torch.randint(0, 50, (b, k), generator=g).cuda(), torch.randn(b, k, h, generator=g).cuda(), 17, last)
    _fused_and_capped("expand_frontier", expand_frontier, args)


@pytest.mark.parametrize("b,k,depth", [(1, 4, 5), (8, 4, 5), (2, 8, 3), (4, 2, 7)])
def test_with_ancestors_and_assemble_tree_are_exact(b, k, depth):
    g = torch.Generator().manual_seed(depth)
    total = (depth - 1) * k
    anc = torch.rand(b, k, total, generator=g).cuda() > 0.6
    rows = torch.randint(0, k, (b, k), generator=g).cuda()
    _fused_and_capped("with_ancestors", with_ancestors, (anc, rows, k, k))
    _same(with_ancestors, (anc[:, :0], None, 0, k))
    toks = [torch.randint(0, 1000, (b, k), generator=g).cuda()]
    scs = [_tied(g, b, k).sort(-1, descending=True).values]
    parents = []
    for d in range(1, depth):  # parents in the previous depth; a child scores <= its parent (ties included)
        lo, hi = (0, k) if d == 1 else (k + (d - 2) * k * k, k + (d - 1) * k * k)
        par = lo + torch.randint(0, hi - lo, (b, k * k), generator=g).cuda()
        toks.append(torch.randint(0, 1000, (b, k * k), generator=g).cuda())
        scs.append(torch.gather(torch.cat(scs, 1), 1, par) - _tied(g, b, k * k).abs())
        parents.append(par)
    m = min(3 * k, k + (depth - 1) * k * k)
    _fused_and_capped("assemble_tree", assemble_tree,
                      (torch.randint(0, 1000, (b,), generator=g).cuda(), toks, scs, parents, m))


@pytest.mark.parametrize("shape,k,ids", [((1, 128), 4, True), ((8, 4, 128), 8, True), ((2, 49152), 8, False)])
def test_log_top_matches_eager_to_rounding(shape, k, ids):
    g = torch.Generator().manual_seed(k)
    logits = (torch.randn(*shape, generator=g) * 4).cuda().bfloat16()
    cand = torch.randperm(49152, generator=g)[: shape[-1]].expand(*shape).contiguous().cuda() if ids else None
    args = (logits, k) + ((cand,) if ids else ())
    (sc, top), (sc_ref, top_ref) = log_top(*args), log_top.__wrapped__(*args)
    torch.testing.assert_close(sc, sc_ref, rtol=0, atol=1e-5)
    # a score no other of its row equals has one id: the same compiled and eager
    unique = (sc_ref[..., :, None] == sc_ref[..., None, :]).sum(-1) == 1
    assert torch.equal(top[unique], top_ref[unique]) and bool(unique.any())
    compiled, eager = kernel_total(lambda: log_top(*args)), kernel_total(lambda: log_top.__wrapped__(*args))
    assert compiled <= eager, f"log_top {shape}: compiled {compiled} kernels > eager {eager}"
    assert not ids or compiled <= CAPS["log_top"], f"log_top {shape}: {compiled} kernels > cap {CAPS['log_top']}"
