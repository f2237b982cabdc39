"""Stress the request API (fp32, CPU): 256 requests through 8 slots with everything on at once.

Random prompt lengths (1 token to max_context - 1), some behind one of three shared system prompts
(the prefix cache is on), chunked prefill (``prefill_tokens`` smaller than many prompts, so long
prompts are prefilled over several steps beside running rows), random output lengths, random
per-request stop tokens, mixed sampling (greedy, T = 0.7 / top-p 0.9, T = 1 / top-k 50) in the same
rounds of a speculative tree, and about a tenth of the requests cancelled at random steps.

Checks: no crash; 0 leaked pages (free + idle cached == capacity, no cached page referenced, every
block table row back on the trash page); every greedy request's tokens equal the same request run
alone with plain decoding, truncated by its stop rules (a request that ended at the context limit:
a prefix of it; a cancelled one: a prefix); the sampled requests' tokens are reproducible for a
fixed seed (the whole run repeated).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.runtime_pair import build_pair
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.engine import SpeculativeEngine
from torchspec.runtime.loading import load_engine
from torchspec.runtime.sampling import SamplingParams

N = 256
MAX_CONTEXT, PAGE, SLOTS = 64, 4, 8
SPEC = SpecConfig(shape="tree", depth=3, topk=2, num_nodes=5, branching=(2, 2, 1))
SETTINGS = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9),
            SamplingParams(temperature=1.0, top_k=50)]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    target, drafter = build_pair(tmp_path_factory.mktemp("pair_stress"), None)
    return load_engine(target, drafter, device="cpu", dtype="float32", max_batch=1, max_context=MAX_CONTEXT,
                       page_size=PAGE, num_pages=2)  # a stub: the engines below bring their own pools


def engine_like(base, **kw) -> SpeculativeEngine:
    args = {"max_batch": SLOTS, "max_context": MAX_CONTEXT, "page_size": PAGE, "prefill_tokens": 24, "fuse": False,
            **kw}
    return SpeculativeEngine(base.decoder, base.runner, None, **args)


def workload(seed: int = 0) -> tuple[list[dict], dict[int, int]]:
    """N request kwargs and {request index: step at which to cancel it}."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 384) for _ in range(n)] for n in (12, 17, 24)]
    reqs, cancel = [], {}
    for i in range(N):
        kind = rng.random()
        if kind < 0.1:
            prompt = [rng.randrange(1, 384)]
        elif kind < 0.2:
            prompt = [rng.randrange(1, 384) for _ in range(rng.randrange(MAX_CONTEXT - 8, MAX_CONTEXT))]
        else:
            head = rng.choice(systems) if kind < 0.6 else []
            prompt = head + [rng.randrange(1, 384) for _ in range(rng.randrange(1, 20))]
        stop = [rng.randrange(1, 384) for _ in range(rng.randrange(0, 3))]
        reqs.append({"prompt_ids": prompt, "max_new_tokens": rng.randrange(1, 13), "stop_token_ids": stop,
                     "ignore_eos": rng.random() < 0.5, "sampling": SETTINGS[rng.randrange(3)]})
        if rng.random() < 0.1:
            cancel[i] = rng.randrange(0, 120)
    return reqs, cancel


def run(engine: SpeculativeEngine, reqs: list[dict], cancel: dict[int, int], seed: int) -> list:
    engine.configure(spec=SPEC, seed=seed, concurrency=SLOTS)
    ids = [engine.submit(**r) for r in reqs]
    at: dict[int, list[int]] = {}
    for i, step in cancel.items():
        at.setdefault(step, []).append(i)
    out, step = {}, 0
    while engine.has_work:
        for i in at.get(step, []):
            engine.cancel(ids[i])
        out.update((r.request_id, r) for r in engine.step())
        step += 1
    cache = engine.prefix_cache
    assert engine.allocator.free_pages + cache.idle_pages == engine.total_pages  # 0 leaked pages
    assert all(cache.refs(p) == 0 for p in cache._by_page)
    assert torch.equal(engine.block_table, torch.zeros_like(engine.block_table))
    return [out[i] for i in ids]


def expected(plain: list[int], req: dict, eos: set[int]) -> list[int]:
    """The plain-decoding tokens (generated with no stop rule) cut by the request's stop rules."""
    stops = set(req["stop_token_ids"]) | (set() if req["ignore_eos"] else eos)
    out = []
    for tok in plain[: req["max_new_tokens"]]:
        out.append(tok)
        if tok in stops:
            break
    return out


def test_stress_256_requests(base):
    torch.set_num_threads(2)
    reqs, cancel = workload()
    t0 = time.perf_counter()
    engine = engine_like(base)
    results = run(engine, reqs, cancel, seed=11)
    t_run = time.perf_counter() - t0
    greedy = [i for i, r in enumerate(reqs) if r["sampling"].greedy]
    t0 = time.perf_counter()  # the reference: each greedy request alone, plain decoding, no stop rule
    ref = engine_like(base, max_batch=1, prefix_cache=False)
    alone = {i: ref.generate([reqs[i]["prompt_ids"]], max_new_tokens=reqs[i]["max_new_tokens"],
                              ignore_eos=True)[0].token_ids for i in greedy}
    t_ref = time.perf_counter() - t0
    counts = {"cancelled": 0, "context": 0, "exact": 0}
    for i in greedy:
        want, got = expected(alone[i], reqs[i], ref.eos_token_ids), results[i]
        if got.finish_reason == "cancelled":
            counts["cancelled"] += 1
            assert got.token_ids == want[: len(got.token_ids)], i
        elif len(got.token_ids) < len(want) and got.finish_reason == "length":  # context limit: a prefix
            counts["context"] += 1
            ctx = len(reqs[i]["prompt_ids"]) + len(got.token_ids) - 1
            assert ctx + max(engine._per_round(True), engine._per_round(False)) >= MAX_CONTEXT
            assert got.token_ids == want[: len(got.token_ids)], i
        else:
            counts["exact"] += 1
            assert got.token_ids == want, i
    reasons = [r.finish_reason for r in results]
    print(f"stress: run {t_run:.1f}s, reference {t_ref:.1f}s, greedy {counts}, finish reasons "
          f"{ {k: reasons.count(k) for k in set(reasons)} }, cached prompt tokens {sum(r.cached_tokens for r in results)}")
    assert all(reasons) and reasons.count("cancelled") >= 5 and reasons.count("stop") >= 1
    assert sum(r.cached_tokens for r in results) > 0  # the prefix cache was used
    assert counts["exact"] > 50
    again = run(engine_like(base), reqs, cancel, seed=11)
    assert [r.token_ids for r in again] == [r.token_ids for r in results]  # sampled ones included
    assert [r.finish_reason for r in again] == reasons
