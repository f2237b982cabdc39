"""Chunked prefill (fp32, CPU): prompts prefilled in chunks of at most ``prefill_tokens`` tokens per forward.

* chunked == unchunked greedy outputs (and acceptance: the drafter's cache is the same), plain and speculative, for a Llama-family target and a hybrid
  Gated-DeltaNet target (whose recurrent state continues from chunk to chunk), with chunk sizes that
  end mid-page (3, 6 with 4-token pages) and exactly at page ends (4, 8), and prompts of 1 token to
  several pages; with the prefix cache, a chunk also continues after cached pages;
* the target's and the drafter's K/V of the prompt (and a hybrid target's committed state) after a
  chunked prefill equal a one-shot prefill's;
* a long prompt does not stall running requests: while it is prefilled chunk by chunk, every step
  also decodes the running one, and its first token comes only after its last chunk.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.runtime_pair import build_pair
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.engine import SpeculativeEngine
from torchspec.runtime.loading import load_engine

PAGE = 4
TREE = SpecConfig(shape="tree", depth=3, topk=2, num_nodes=5)
CHUNKS = [3, 4, 6, 8]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def base(request, tmp_path_factory, tiny_tokenizer):
    target, drafter = build_pair(tmp_path_factory.mktemp(f"pair_chunk_{request.param}"), tiny_tokenizer,
                                 flavour=request.param)
    return load_engine(target, drafter, device="cpu", dtype="float32", max_batch=3, max_context=64, page_size=PAGE,
                       num_pages=2)  # a stub: the engines below bring their own pools


def engine_like(base, **kw) -> SpeculativeEngine:
    args = {"max_batch": 3, "max_context": 64, "page_size": PAGE, "fuse": False, **kw}
    return SpeculativeEngine(base.decoder, base.runner, base.tokenizer, **args)


PROMPTS = [[17], [5, 9, 11, 13], list(range(40, 48)), list(range(100, 113)), [30 + (7 * j) % 90 for j in range(27)]]


@pytest.fixture(scope="module")
def unchunked(base):
    engine = engine_like(base, prefix_cache=False)
    out = {spec: engine.generate(PROMPTS, max_new_tokens=10, spec=spec, ignore_eos=True) for spec in (None, TREE)}
    out["accept"] = [r.accept_lengths for r in out[TREE]]
    return {**{spec: [r.token_ids for r in out[spec]] for spec in (None, TREE)}, "accept": out["accept"]}


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
def test_chunked_equals_unchunked(base, unchunked, spec, chunk):
    engine = engine_like(base, prefill_tokens=chunk, prefix_cache=False)
    out = engine.generate(PROMPTS, max_new_tokens=10, spec=spec, ignore_eos=True)
    assert [r.token_ids for r in out] == unchunked[spec]
    if spec is not None:  # the drafter's cache too: a chunk's last entry is fed the next prompt token
        assert [r.accept_lengths for r in out] == unchunked["accept"]
    assert engine.free_pages == engine.total_pages


@pytest.mark.parametrize("chunk", [3, 8])
def test_chunks_continue_after_cached_pages(base, unchunked, chunk):
    engine = engine_like(base, prefill_tokens=chunk)
    if engine.prefix_cache is None:
        pytest.skip("hybrid targets run without the prefix cache")
    engine.generate(PROMPTS, max_new_tokens=10, spec=TREE, ignore_eos=True)
    again = engine.generate(PROMPTS, max_new_tokens=10, spec=TREE, ignore_eos=True)
    assert [r.cached_tokens for r in again] == [PAGE * ((len(p) - 1) // PAGE) for p in PROMPTS]
    assert [r.token_ids for r in again] == unchunked[TREE]
    assert [r.accept_lengths for r in again] == unchunked["accept"]


def prompt_state(engine, length: int) -> list[torch.Tensor]:
    """Slot 0's target and drafter K/V at positions 0 .. length - 1 (and a hybrid target's state)."""
    ps = PAGE
    slots = (engine.block_table[0, :, None] * ps + torch.arange(ps)).reshape(-1)[:length]
    out = [cache.k[:, slots] for cache in (engine.caches.target, engine.caches.drafter)]
    out += [cache.v[:, slots] for cache in (engine.caches.target, engine.caches.drafter)]
    if engine.caches.recurrent is not None:
        out += [engine.caches.recurrent.ssm[:, 0], engine.caches.recurrent.conv[:, 0]]
    return [x.clone() for x in out]


@pytest.mark.parametrize("chunk", [3, 4])
def test_caches_after_chunks_equal_one_shot(base, chunk):
    """After the step that prefills the last chunk (its decode round only writes positions >= the
    prompt's length, and commits a hybrid target's state for the same tokens), the target's and the
    drafter's K/V of the prompt and the recurrent state equal a one-shot prefill's."""
    prompt, states = PROMPTS[-1], []
    for size in (10**4, chunk):
        engine = engine_like(base, prefill_tokens=size, prefix_cache=False)
        engine.configure(spec=TREE)
        engine.submit(prompt, max_new_tokens=20, ignore_eos=True)
        steps = 0
        while steps == 0 or engine.scheduler.slots[0].prefilling:
            engine.step()
            steps += 1
        assert steps == (1 if size > 100 else math.ceil(len(prompt) / size))
        states.append(prompt_state(engine, len(prompt)))
        engine.scheduler.abort()
    for a, b in zip(*states):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
def test_long_prompt_does_not_stall_running_requests(base, unchunked, spec):
    engine = engine_like(base, prefill_tokens=4, prefix_cache=False)
    engine.configure(spec=spec)
    short = engine.submit(PROMPTS[1], max_new_tokens=40, ignore_eos=True)
    engine.step()  # the short prompt: one chunk, its first token, a round
    long = engine.submit(PROMPTS[-1], max_new_tokens=10, ignore_eos=True)
    slots = engine.scheduler.slots
    progress, steps, results = [], 0, {}
    while slots[1] is None or slots[1].prefilling:
        before = len(slots[0].request.result.token_ids)
        assert slots[1] is None or slots[1].request.result.token_ids == []  # no first token before the last chunk
        results.update((r.request_id, r) for r in engine.step())
        progress.append(len(slots[0].request.result.token_ids) - before)
        steps += 1
    assert steps == math.ceil(len(PROMPTS[-1]) / 4) and all(n >= 1 for n in progress)
    assert len(slots[1].request.result.token_ids) >= 1  # its first token, and the round of the same step
    while engine.has_work:
        results.update((r.request_id, r) for r in engine.step())
    assert results[long].token_ids == unchunked[spec][-1]
    assert results[short].token_ids[:10] == unchunked[spec][1]
