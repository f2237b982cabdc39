"""The round's index bookkeeping as fused regions on CUDA (skipped without a GPU): same tensors, few kernels.

A speculation round of a small target spent ~90 kernels of a few microseconds each between the
drafter and target forwards (the tree mask, write slots, the greedy walk, the compaction plan, the
catch-up layout): ~0.2 ms, a fifth of SmolLM2's plain step. Each is now one ``fused`` region
(``torchspec/targets/fused_ops.py``). Integer and boolean work only, so every compiled output must
equal the eager function's exactly, on random trees with padding and ragged rows; and each region
must launch only a few kernels.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda_kernels import kernel_total
from tests.unit.test_runtime_verify import random_tree
from torchspec.runtime.paged_kv import _write_slots
from torchspec.runtime.steps import _compaction, _step0_layout
from torchspec.runtime.tree import tree_attention_mask
from torchspec.runtime.verify import _greedy_walk

pytestmark = pytest.mark.gpu
PAGE = 16
MAX_KERNELS = 8  # per region (the greedy walk: + one per depth pass at most); eager they were 10-45 each


def _same(fused_fn, args) -> int:
    """Compiled == eager (exactly) for ``args``; returns the compiled call's kernel count."""
    got, want = fused_fn(*args), fused_fn.__wrapped__(*args)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
    return kernel_total(lambda: fused_fn(*args))


def _table(b: int, pages: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(4 * b * pages, generator=g)[: b * pages].reshape(b, pages).add(1).cuda()


@pytest.mark.parametrize("b,n,d", [(1, 6, 5), (8, 6, 5), (3, 17, 5), (8, 33, 7)])
def test_greedy_walk_and_tree_mask(b, n, d):
    tree = random_tree(b, n, vocab=4, seed=n + b)
    dev = torch.device("cuda")
    t = {k: getattr(tree, k).to(dev) for k in ("tokens", "parents", "depths", "valid", "sibling_rank")}
    depth = int(tree.depths.max())
    best = torch.randint(4, (b, n), generator=torch.Generator().manual_seed(b)).to(dev)
    k_walk = _same(_greedy_walk, (best, t["tokens"], t["parents"], t["depths"], t["valid"], t["sibling_rank"],
                                  max(d, depth)))
    k_mask = _same(tree_attention_mask, (t["parents"], max(d, depth)))
    assert k_walk <= MAX_KERNELS + d and k_mask <= MAX_KERNELS, f"kernels: walk {k_walk}, mask {k_mask}"


@pytest.mark.parametrize("b,width", [(1, 6), (8, 6), (5, 9)])
def test_compaction_write_slots_and_step0_layout(b, width):
    g = torch.Generator().manual_seed(width)
    dev = torch.device("cuda")
    bt = _table(b, 8, seed=b)
    ctx = torch.randint(1, 8 * PAGE - width, (b,), generator=g).to(dev)
    valid = (torch.rand(b, generator=g) > 0.3).to(dev)
    a = torch.randint(0, width, (b,), generator=g).to(dev)
    path = torch.sort(torch.randint(1, 3 * width, (b, width), generator=g), 1).values
    path[:, 0] = 0
    tokens = torch.randint(100, (b, 3 * width), generator=g).to(dev)
    nxt = torch.randint(100, (b,), generator=g).to(dev)
    k_comp = _same(_compaction, (a, path.to(dev), nxt, tokens, bt, ctx, valid, PAGE))
    k_slots = _same(_write_slots, (bt, ctx, valid, 2, width, PAGE))
    k_slots_all = _same(_write_slots, (bt, ctx, None, 0, width, PAGE))
    k_layout = _same(_step0_layout, (ctx, width, 3))
    _same(_step0_layout, (ctx, width, None))
    assert max(k_comp, k_slots, k_slots_all, k_layout) <= MAX_KERNELS, \
        f"kernels: compaction {k_comp}, write slots {k_slots} / {k_slots_all}, step-0 layout {k_layout}"
