"""The greedy chain's scoreless draft (``drafting.draft_greedy_chain``) against the dynamic tree it replaces.

``draft_round`` sends greedy chains to ``draft_greedy_chain``, which drafts each depth's argmax without
the dynamic tree's log-softmax, sorts and gathers. It must return the very tree the k = 1 dynamic
tree returns (tokens, parents, depths, flags) and leave the drafter's cache as that one does, for a
dense and an efficient (low-rank + top-k) head, at several depths and batch rows with different
committed lengths. The k = 1 tree keeps its pool's first m nodes (``TreePool.tree``), checked against the
sorted assembly (``tree_select.assemble_tree``) that any other pool goes through; and the draft controller's
greedy chain grows its pools with scores through ``grow_scored_chain``, checked against the k = 1 tree's
growth (``grow_topk_tree``) depth by depth.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.runtime_pair import build_pair
from torchspec.runtime import drafting
from torchspec.runtime.drafting import (
    DraftInputs,
    SpecConfig,
    draft_greedy_chain,
    draft_round,
    grow_scored_chain,
    grow_topk_tree,
)
from torchspec.runtime.loading import load_engine
from torchspec.runtime.sampling import SamplingParams
from torchspec.runtime.tree_select import assemble_tree

TREE_FIELDS = ("tokens", "parents", "depths", "valid", "sampled", "sibling_rank", "dist_index")


@pytest.fixture(scope="module", params=[0, 16], ids=["dense_head", "efficient_head"])
def engine(request, tmp_path_factory, tiny_tokenizer):
    target, drafter = build_pair(tmp_path_factory.mktemp("chain"), tiny_tokenizer, lm_head_rank=request.param,
                                 lm_head_topk=32)
    eng = load_engine(target, drafter, device="cpu", dtype="float32", max_batch=3, max_context=96, page_size=8)
    assert eng.runner.efficient_head == bool(request.param)
    return eng


def _inputs(engine, seed: int) -> DraftInputs:
    g = torch.Generator().manual_seed(seed)
    b, h = 3, engine.runner.hidden_size
    ctx = torch.tensor([9, 30, 17])
    bt = engine.block_table[:b].clone()
    pages = torch.randperm(engine.caches.drafter.num_pages - 1, generator=g)[: b * 6] + 1
    bt[:, :6] = pages.view(b, 6)
    return DraftInputs(root=torch.randint(0, 384, (b,), generator=g), normed=torch.randn(b, h, generator=g),
                       feedback=torch.randn(b, h, generator=g), ctx_len=ctx, block_table=bt,
                       row_valid=torch.tensor([True, True, False]))


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_scoreless_chain_equals_the_k1_dynamic_tree(engine, depth):
    spec = SpecConfig(shape="chain", depth=depth)
    inp = _inputs(engine, depth)
    cache = engine.caches.drafter
    before = [t.clone() for t in (cache.k, cache.v)]
    *_, pool = grow_topk_tree(engine.runner, cache, inp, spec, SamplingParams())  # the k = 1 tree, sorted
    ref = pool.tree(inp.root, depth)
    ref_kv = [t.clone() for t in (cache.k, cache.v)]
    cache.k.copy_(before[0]), cache.v.copy_(before[1])
    fast = draft_greedy_chain(engine.runner, cache, inp, spec)
    for name in TREE_FIELDS:
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert torch.equal(cache.k, ref_kv[0]) and torch.equal(cache.v, ref_kv[1])
    assert fast.tokens.shape == (3, depth + 1) and torch.equal(fast.tokens[:, 0], inp.root)
    if depth > 1:  # positive control: the cache check sees the feedback a depth is fed (here zero instead)
        draft_greedy_chain(engine.runner, cache, dataclasses.replace(inp, feedback=inp.feedback * 0), spec)
        assert not torch.equal(cache.k, ref_kv[0])


def test_draft_round_takes_the_scoreless_path_for_greedy_chains_only(engine, monkeypatch):
    calls = []
    real = drafting.draft_greedy_chain
    monkeypatch.setattr(drafting, "draft_greedy_chain", lambda *a: calls.append("chain") or real(*a))
    inp = _inputs(engine, 0)
    cache = engine.caches.drafter
    draft_round(engine.runner, cache, inp, SpecConfig(shape="chain", depth=3), SamplingParams(), None)
    assert calls == ["chain"]
    draft_round(engine.runner, cache, inp, SpecConfig(shape="tree", depth=3, topk=2, num_nodes=4), SamplingParams(),
                None)
    det = SpecConfig(shape="chain", depth=3, candidates="deterministic")  # T > 0, deterministic candidates
    draft_round(engine.runner, cache, inp, det, SamplingParams(temperature=0.7), torch.Generator().manual_seed(0))
    assert calls == ["chain"]


@pytest.mark.parametrize("ties", [False, True])
def test_a_chain_pool_keeps_its_first_m_nodes_as_the_sorted_assembly_does(ties):
    """``TreePool.tree`` takes a k = 1 pool's first m nodes (``chain_tree``) instead of sorting it: the tree
    ``assemble_tree`` builds from the same pool, for every m, with and without tied scores; its score ranks are
    the chain's depth order, which ``steps._path_ranks`` assumes for a tree without ranks."""
    g = torch.Generator().manual_seed(int(ties))
    b, depth = 4, 5
    edges = torch.zeros(b, depth) if ties else -torch.rand(b, depth, generator=g)
    cum = edges.cumsum(1)  # cumulative log-probabilities: never increasing along the chain
    tok = [torch.randint(0, 100, (b, 1), generator=g) for _ in range(depth)]
    sc = [cum[:, d:d + 1] for d in range(depth)]
    parent = [torch.full((b, 1), d, dtype=torch.long) for d in range(depth - 1)]  # pool index of depth d's node
    pool = drafting.TreePool(tok=tok, sc=sc, parent=parent, front_sc=None)
    root = torch.randint(0, 100, (b,), generator=g)
    for m in range(depth + 1):
        fast = pool.tree(root, m)
        assert fast.tokens.shape == (b, m + 1) and fast.score_rank is None
        if m == 0:
            continue
        tokens, parents, depths, rank, score_rank = assemble_tree(root, tok, sc, parent, m)
        for name, ref in (("tokens", tokens), ("parents", parents), ("depths", depths), ("sibling_rank", rank)):
            assert torch.equal(getattr(fast, name), ref), (m, name)
        assert torch.equal(score_rank[:, 1:], torch.arange(m).expand(b, m))
    shuffled = drafting.TreePool(tok=tok[::-1], sc=sc, parent=parent, front_sc=None)  # positive control
    assert not torch.equal(shuffled.tree(root, depth).tokens, pool.tree(root, depth).tokens)


@pytest.mark.parametrize("frontier_at_last", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 5])
def test_scored_chain_grows_the_k1_trees_pools(engine, depth, frontier_at_last):
    """Depth by depth, the scored chain's pool (tokens, path scores, parents, frontier and its last edge) and the
    drafter cache it leaves equal the k = 1 tree's, which sorts and gathers a one-node frontier."""
    spec = SpecConfig(shape="chain", depth=depth)
    inp = _inputs(engine, 10 + depth)
    cache = engine.caches.drafter
    before = [t.clone() for t in (cache.k, cache.v)]

    def snapshots(grow, *args):
        out = []
        for pool in grow(engine.runner, cache, inp, spec, *args, frontier_at_last=frontier_at_last):
            front = None if pool.front_sc is None else (pool.front_sc.clone(), pool.front_edge().clone())
            out.append(([t.clone() for t in pool.tok], [t.clone() for t in pool.sc],
                        [t.clone() for t in pool.parent], front))
        return out, [t.clone() for t in (cache.k, cache.v)]

    ref, ref_kv = snapshots(grow_topk_tree, SamplingParams())
    cache.k.copy_(before[0]), cache.v.copy_(before[1])
    fast, fast_kv = snapshots(grow_scored_chain)
    assert len(fast) == len(ref) == depth
    for (ft, fs, fp, ff), (rt, rs, rp, rf) in zip(fast, ref):
        assert all(torch.equal(a, b) for a, b in zip(ft + fs + fp, rt + rs + rp)) and len(ft + fp) == len(rt + rp)
        assert (ff is None) == (rf is None)
        assert ff is None or (torch.equal(ff[0], rf[0]) and torch.equal(ff[1], rf[1]))
    assert (fast[-1][3] is not None) == frontier_at_last
    assert torch.equal(fast_kv[0], ref_kv[0]) and torch.equal(fast_kv[1], ref_kv[1])
    assert fast[-1][1][-1].lt(0).all()  # positive control: real log-probabilities, not zeros
