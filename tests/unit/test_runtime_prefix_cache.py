"""Prefix caching (``torchspec/runtime/prefix_cache.py``) alone and through the engine (fp32, CPU).

* the cache: chained keys (a page whose following token differs, or whose earlier pages differ, does
  not match), reference counts, LRU eviction that never takes a referenced page, the allocator asking
  the cache before it reports the pool out of pages, namespaces (plain-decoding pages lack drafter
  entries);
* the engine: requests sharing a system prompt give the same greedy tokens with and without the cache
  (plain, chain, tree); running requests hold the same physical pages (counted); no page leaks
  (free + idle == capacity once all finished); a pool too small to keep everything evicts and still
  gives the same tokens, and no page a running sequence holds is ever free; a hybrid target runs
  without it.
"""

from __future__ import annotations

import pytest
import torch

from tests.runtime_pair import build_pair
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.engine import SpeculativeEngine
from torchspec.runtime.loading import load_engine
from torchspec.runtime.paged_kv import PageAllocator
from torchspec.runtime.prefix_cache import TARGET_ONLY, WITH_DRAFTER, PrefixCache

PAGE = 4
SYSTEM = [10 + (3 * i) % 200 for i in range(8 * PAGE)]  # 8 full pages
TREE = SpecConfig(shape="tree", depth=4, topk=3, num_nodes=12)
CHAIN = SpecConfig(shape="chain", depth=3)


# --- the cache alone ------------------------------------------------------------------------------

def fill(cache: PrefixCache, prompt: list[int], pages: list[int], root: int = WITH_DRAFTER) -> None:
    parent = root
    for k, page in enumerate(pages):
        parent = cache.insert(parent, prompt, k, page)


def test_keys_chain_and_include_the_following_token():
    cache = PrefixCache(PAGE)
    a = list(range(1, 14))  # 13 tokens: 3 shareable pages
    fill(cache, a, [7, 8, 9])
    assert cache.match(a) == ([7, 8, 9], 3)
    assert cache.match(a[:12] + [99])[0] == [7, 8]  # page 2 is followed by a different token
    assert cache.match(a[:12])[0] == [7, 8]  # 12 tokens: page 2 would leave nothing to prefill
    assert cache.match([0] + a[1:])[0] == []  # page 0 differs, so every later page differs too
    assert cache.match(a, root=TARGET_ONLY)[0] == []
    for pages in ([7, 8, 9], [7, 8], [7, 8]):  # the matches' references
        cache.release(pages)
    assert [cache.refs(p) for p in (7, 8, 9)] == [1, 1, 1]  # the writer's own reference


def test_eviction_is_lru_and_never_takes_a_referenced_page():
    cache = PrefixCache(PAGE)
    a, b = list(range(1, 10)), list(range(50, 59))  # 2 shareable pages each
    fill(cache, a, [1, 2])
    fill(cache, b, [3, 4])
    cache.release([1, 2])
    cache.release([3, 4])
    assert cache.idle_pages == 4
    cache.match(a)  # a in use again (and most recently used)
    assert cache.evict(10) == [4, 3]  # b's tail first; a's pages are referenced
    assert cache.cached_pages == 2 and cache.match(b)[0] == []
    cache.release([1, 2])  # the match's reference
    assert cache.evict(1) == [2] and cache.match(a)[0] == [1]


def test_allocator_asks_the_cache_before_running_out():
    cache = PrefixCache(PAGE)
    alloc = PageAllocator(5, cache.evict)  # pages 1..4
    pages = alloc.alloc(4)
    fill(cache, list(range(1, 18)), pages[:3])
    cache.release(pages[:3])  # cached, idle
    alloc.free(pages[3:])
    assert len(alloc.alloc(2)) == 2 and cache.cached_pages == 2  # the free page + one evicted (the deepest)
    assert len(cache.match(list(range(1, 18)))[0]) == 2  # both cached pages are referenced now
    with pytest.raises(MemoryError, match="out of pages"):
        alloc.alloc(2)


# --- through the engine ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_tokenizer):
    target, drafter = build_pair(tmp_path_factory.mktemp("pair_prefix"), tiny_tokenizer)
    return load_engine(target, drafter, device="cpu", dtype="float32", max_batch=3, max_context=96, page_size=PAGE,
                       num_pages=2)  # a stub: the engines below bring their own pools


def engine_like(base, **kw) -> SpeculativeEngine:
    args = {"max_batch": 3, "max_context": 96, "page_size": PAGE, "fuse": False, **kw}
    return SpeculativeEngine(base.decoder, base.runner, base.tokenizer, **args)


def requests(n: int) -> list[list[int]]:
    """A shared system prompt, a turn marker (the token after the shared pages), then per-request
    turns of 1..12 tokens."""
    return [SYSTEM + [250] + [200 + (5 * i + j) % 150 for j in range(1 + (7 * i) % 12)] for i in range(n)]


def assert_no_leak(engine) -> None:
    cache = engine.prefix_cache
    assert engine.allocator.free_pages + cache.idle_pages == engine.total_pages
    assert all(cache.refs(p) == 0 for p in cache._by_page)


def run_checked(engine, prompts, spec, max_new: int = 16) -> list[list[int]]:
    """Step through the request API, checking after every step that no page a slot holds is free and
    that a cached page's reference count is the number of slots holding it."""
    engine.configure(spec=spec)
    ids = {engine.submit(p, max_new_tokens=max_new, ignore_eos=True): k for k, p in enumerate(prompts)}
    out, peak_shared = {}, 0
    while engine.has_work:
        for r in engine.step():
            out[ids[r.request_id]] = r
        held = [p for s in engine.scheduler.slots if s is not None for p in s.pages]
        assert not set(held) & set(engine.allocator._free)
        cache = engine.prefix_cache
        for page in set(held) & set(cache._by_page):
            assert cache.refs(page) == held.count(page)
        peak_shared = max(peak_shared, len(held) - len(set(held)))
    engine.peak_shared = peak_shared
    return [out[k] for k in range(len(prompts))]


@pytest.mark.parametrize("spec", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_shared_system_prompt_same_tokens_shared_pages_no_leak(base, spec):
    ps = requests(7)
    want = engine_like(base, prefix_cache=False).generate(ps, max_new_tokens=16, spec=spec, ignore_eos=True)
    engine = engine_like(base, prefix_cache=True)
    got = run_checked(engine, ps, spec)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.accept_lengths for r in got] == [r.accept_lengths for r in want]  # the drafter's entries are shared too
    # the first wave (3 slots) prefills together; later requests reuse the system prompt's 8 pages
    assert [r.cached_tokens for r in got[3:]] == [len(SYSTEM)] * 4
    assert engine.peak_shared >= 8 * 2  # two running slots beside the writer held the same 8 pages
    assert_no_leak(engine)
    again = engine.generate(ps[:3], max_new_tokens=16, spec=spec, ignore_eos=True)  # now all from the cache
    assert [r.cached_tokens for r in again] == [len(SYSTEM)] * 3
    assert [r.token_ids for r in again] == [r.token_ids for r in want[:3]]
    assert_no_leak(engine)


def test_plain_decoding_pages_are_not_reused_by_speculation(base):
    engine = engine_like(base)
    engine.generate(requests(1), max_new_tokens=4)
    assert engine.prefix_cache.cached_pages > 0
    assert engine.generate(requests(1), max_new_tokens=4, spec=CHAIN)[0].cached_tokens == 0
    assert engine.generate(requests(1), max_new_tokens=4, spec=TREE)[0].cached_tokens == len(SYSTEM)


def test_a_page_followed_by_another_token_is_not_reused(base):
    engine = engine_like(base)
    a = SYSTEM + [300, 301, 302]
    b = SYSTEM + [299, 301, 302]  # same 8 pages, a different token after the last
    engine.generate([a], max_new_tokens=8, spec=TREE, ignore_eos=True)
    out = engine.generate([b], max_new_tokens=8, spec=TREE, ignore_eos=True)[0]
    assert out.cached_tokens == len(SYSTEM) - PAGE
    ref = engine_like(base, prefix_cache=False).generate([b], max_new_tokens=8, spec=TREE, ignore_eos=True)[0]
    assert out.token_ids == ref.token_ids and out.accept_lengths == ref.accept_lengths


@pytest.mark.parametrize("num_pages", [48, 64])
def test_eviction_under_pressure(base, num_pages):
    """A pool that cannot keep every finished prompt's pages: 3 slots of up to 15 pages each, 12
    distinct prompts (each 8-11 shareable pages) twice over."""
    ps = [[7 + i] + SYSTEM[1:] + [9] * (i % 12) for i in range(12)] * 2
    want = engine_like(base, prefix_cache=False).generate(ps, max_new_tokens=12, spec=CHAIN, ignore_eos=True)
    engine = engine_like(base, num_pages=num_pages)
    got = run_checked(engine, ps, CHAIN, max_new=12)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert engine.prefix_cache.cached_pages < num_pages - 1  # it evicted
    assert_no_leak(engine)


def test_hybrid_targets_run_without_prefix_cache(tmp_path, tiny_tokenizer):
    target, drafter = build_pair(tmp_path, tiny_tokenizer, flavour="qwen3_5")
    engine = load_engine(target, drafter, device="cpu", dtype="float32", max_batch=2, max_context=64, page_size=PAGE)
    assert engine.prefix_cache is None
    out = engine.generate(requests(2), max_new_tokens=4, spec=CHAIN, ignore_eos=True)
    assert all(r.cached_tokens == 0 for r in out) and engine.free_pages == engine.total_pages
    assert torch.equal(engine.block_table, torch.zeros_like(engine.block_table))
