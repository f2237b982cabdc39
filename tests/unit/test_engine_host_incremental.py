"""The engine's incremental host structures equal what they stand for, on random workloads (CPU, fp32).

* the block table: entries are batched and flushed before each forward (``Scheduler.flush_table``);
  at every forward the device table equals the one recomputed from the slots' pages (row i: its
  pages, then the trash page; a free slot: all trash), with admissions, chunked prefills, prefix-cache
  matches, stops and cancellations in the mix; a positive control (no flush) is caught;
* ``Scheduler.commit``'s fast path (no stop token, limit not reached) equals the token-by-token rule;
* ``prefill_wait``: prompts admitted while others decode share prefill forwards (fewer of them), and
  greedy outputs are token for token those of prefilling at once, plain and speculative.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.runtime_pair import build_pair
from torchspec.runtime import engine_forwards as forwards_module
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine
from torchspec.runtime.paged_kv import TRASH_PAGE
from torchspec.runtime.sampling import SamplingParams
from torchspec.runtime.scheduler import GenerationResult, Request, Scheduler, Slot

pytestmark = pytest.mark.usefixtures("one_thread")

CHAIN = SpecConfig(shape="chain", depth=3)
TREE = SpecConfig(shape="tree", depth=3, topk=2, num_nodes=5)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    return build_pair(tmp_path_factory.mktemp("pair_host"), tiny_tokenizer, num_layers=4)


def make_engine(pair, **options):
    return load_engine(*pair, device="cpu", dtype="float32", max_batch=4, max_context=96, page_size=4,
                       prefill_tokens=48, **options)


def expected_table(engine) -> torch.Tensor:
    table = torch.full_like(engine.block_table, TRASH_PAGE)
    for i, s in enumerate(engine.scheduler.slots):
        if s is not None:
            table[i, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.long)
    return table


def checked_forwards(monkeypatch, engine) -> dict:
    """Wrap the engine's forwards: at each one the device block table must equal the recomputed one."""
    calls = {"prefill": 0, "decode": 0}

    def wrap(fn, kind):
        def checked(*args, **kwargs):
            assert torch.equal(engine.block_table, expected_table(engine)), f"stale block table at a {kind}"
            calls[kind] += 1
            return fn(*args, **kwargs)
        return checked

    for name in ("prefill", "plain_step", "speculate"):
        monkeypatch.setattr(forwards_module, name, wrap(getattr(forwards_module, name),
                                                      "prefill" if name == "prefill" else "decode"))
    return calls


def random_workload(engine, spec, seed: int, n: int = 14, cancel: bool = True) -> dict[int, list[int]]:
    """Requests arriving over time (random prompts, some sharing a prefix, random limits and stop
    tokens, a few cancelled mid-way); steps until idle -> {submission index: tokens}."""
    rng = random.Random(seed)
    engine.configure(spec=spec, concurrency=4)
    shared = [rng.randrange(5, 300) for _ in range(12)]
    ids, out, submitted = {}, {}, 0
    while submitted < n or engine.has_work:
        for _ in range(rng.choice([0, 0, 1, 2])):
            if submitted == n:
                break
            head = shared[: rng.randint(0, 12)] if rng.random() < 0.5 else []
            prompt = head + [rng.randrange(5, 300) for _ in range(rng.randint(1, 40))]
            rid = engine.submit(prompt, max_new_tokens=rng.randint(1, 24), ignore_eos=True,
                                stop_token_ids=[rng.randrange(5, 300) for _ in range(3)])
            ids[rid] = submitted
            submitted += 1
        if cancel and rng.random() < 0.1:
            running = [s.request.id for s in engine.scheduler.slots if s is not None]
            if running:
                engine.cancel(rng.choice(running))
        for r in engine.step():
            out[ids[r.request_id]] = r.token_ids if r.finish_reason != "cancelled" else None
    assert engine.free_pages == engine.total_pages
    assert torch.equal(engine.block_table, torch.zeros_like(engine.block_table))
    return out


@pytest.mark.parametrize("spec", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
@pytest.mark.parametrize("seed", [0, 1])
def test_block_table_equals_recomputed_at_every_forward(pair, monkeypatch, spec, seed):
    engine = make_engine(pair)
    calls = checked_forwards(monkeypatch, engine)
    random_workload(engine, spec, seed)
    assert calls["prefill"] > 0 and calls["decode"] > 0
    assert engine.prefix_cache.matched_pages > 0  # the shared heads were matched


def test_positive_control_unflushed_table_is_caught(pair, monkeypatch):
    engine = make_engine(pair)
    checked_forwards(monkeypatch, engine)
    monkeypatch.setattr(Scheduler, "flush_table", lambda self: None)
    with pytest.raises(AssertionError, match="stale block table"):
        random_workload(engine, None, 0)


def reference_commit(tokens_so_far: list[int], tokens: list[int], stop: frozenset[int], limit: int
                     ) -> tuple[list[int], int, str]:
    out = list(tokens_so_far)
    for n, tok in enumerate(tokens, start=1):
        out.append(tok)
        if tok in stop:
            return out, n, "stop"
        if len(out) >= limit:
            return out, n, "length"
    return out, len(tokens), ""


def test_commit_equals_token_by_token_rule():
    rng = random.Random(0)
    sch = Scheduler(1, 4, torch.zeros(1, 4, dtype=torch.long), None, None, 16)
    for _ in range(500):
        stop = frozenset(rng.randrange(10) for _ in range(rng.randint(0, 2)))
        limit = rng.randint(1, 12)
        before = [rng.randrange(10, 20) for _ in range(rng.randint(0, limit - 1))]
        tokens = [rng.randrange(10) for _ in range(rng.randint(1, 6))]
        req = Request(0, [1], limit, SamplingParams(), stop, GenerationResult(1, token_ids=list(before)))
        sch.slots[0] = Slot(req)
        kept = sch.commit(0, tokens)
        ref, ref_kept, reason = reference_commit(before, tokens, stop, limit)
        assert (req.result.token_ids, kept, req.result.finish_reason) == (ref, ref_kept, reason)


@pytest.mark.parametrize("spec", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_prefill_wait_shares_forwards_and_keeps_greedy_outputs(pair, monkeypatch, spec):
    outputs, prefills = [], []
    for wait in (0, 3):
        engine = make_engine(pair, prefill_wait=wait)
        calls = checked_forwards(monkeypatch, engine)
        outputs.append(random_workload(engine, spec, seed=5, n=16, cancel=False))
        prefills.append(calls["prefill"])
    assert outputs[0] == outputs[1]
    assert prefills[1] < prefills[0]
