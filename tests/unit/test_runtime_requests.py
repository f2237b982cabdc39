"""The engine's request API on CPU (fp32): ``submit`` / ``cancel`` / ``step`` / ``has_work``.

* ``generate`` is a loop over the request API: driving ``step`` by hand gives the same tokens;
* per-request limits and stop tokens: every request of a batch with different settings ends exactly
  as the same request run alone;
* cancellation: a waiting request is dropped at once, a running one at the next step (its tokens so
  far are a prefix of the uncancelled run), every page comes back; cancelling a finished request is
  a no-op (False), an id never issued an error;
* per-request sampling: greedy requests decoded in the same rounds as sampled ones (a mixed round:
  sampled tree, per-row settings) give exactly their greedy outputs, for plain decoding, chains and
  sampled trees; sampled requests are reproducible for a fixed seed.
"""

from __future__ import annotations

import pytest
import torch

from tests.runtime_pair import build_pair
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine
from torchspec.runtime.sampling import SamplingParams

CHAIN = SpecConfig(shape="chain", depth=3)
TREE = SpecConfig(shape="tree", depth=3, topk=2, num_nodes=5)
SAMPLED_TREE = SpecConfig(shape="tree", depth=3, branching=(3, 2, 1))
T1 = SamplingParams(temperature=1.0)
T07 = SamplingParams(temperature=0.7, top_p=0.9, top_k=20)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_tokenizer):
    target, drafter = build_pair(tmp_path_factory.mktemp("pair_requests"), tiny_tokenizer)
    return load_engine(target, drafter, device="cpu", dtype="float32", max_batch=4, max_context=96, page_size=4)


def prompts(n: int) -> list[list[int]]:
    return [[5 + (7 * i + j) % 300 for j in range(3 + (5 * i) % 17)] for i in range(n)]


def drive(engine, requests: list[dict], cancel_waiting: tuple[int, ...] = (),
          cancel_after: dict[int, int] | None = None) -> dict[int, object]:
    """Submit ``requests`` (kwargs of submit), cancel those of ``cancel_waiting`` at once, step until
    idle, cancelling request k once it has ``cancel_after[k]`` tokens; returns {index: result}."""
    ids = [engine.submit(**r) for r in requests]
    for k in cancel_waiting:
        assert engine.cancel(ids[k])
    out, pending = {}, dict(cancel_after or {})
    while engine.has_work:
        running = {s.request.id: s.request.result for s in engine.scheduler.slots if s is not None}
        for k, n in list(pending.items()):
            if ids[k] in running and len(running[ids[k]].token_ids) >= n:
                assert engine.cancel(ids[k])
                del pending[k]
        for r in engine.step():
            out[ids.index(r.request_id)] = r
    assert not pending, "a request to cancel finished first"
    return out


@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
def test_generate_equals_driving_steps(engine, spec):
    ps = prompts(6)
    want = engine.generate(ps, max_new_tokens=12, spec=spec, ignore_eos=True)
    engine.configure(spec=spec)
    got = drive(engine, [{"prompt_ids": p, "max_new_tokens": 12, "ignore_eos": True} for p in ps])
    assert [got[i].token_ids for i in range(len(ps))] == [r.token_ids for r in want]
    assert engine.free_pages == engine.total_pages


def test_per_request_limits_and_stop_tokens(engine):
    ps = prompts(7)
    engine.configure(spec=CHAIN)
    alone = [engine.generate([p], max_new_tokens=20, spec=CHAIN, ignore_eos=True)[0].token_ids for p in ps]
    reqs = []
    for i, p in enumerate(ps):
        stop = [alone[i][3 + i % 4]] if i % 2 else []  # a token the request really produces
        reqs.append({"prompt_ids": p, "max_new_tokens": 5 + 2 * i, "stop_token_ids": stop, "ignore_eos": True})
    engine.configure(spec=CHAIN)
    got = drive(engine, reqs)
    for i, r in enumerate(reqs):
        full = alone[i][: r["max_new_tokens"]]
        if r["stop_token_ids"]:
            full = full[: full.index(r["stop_token_ids"][0]) + 1]
        assert got[i].token_ids == full, i
        assert got[i].finish_reason == ("stop" if r["stop_token_ids"] else "length")
    assert engine.free_pages == engine.total_pages


def test_cancel_waiting_running_and_finished(engine):
    ps = prompts(6)
    engine.configure(spec=TREE, concurrency=2)
    full = engine.generate(ps, max_new_tokens=30, spec=TREE, ignore_eos=True, concurrency=2)
    engine.configure(spec=TREE, concurrency=2)
    reqs = [{"prompt_ids": p, "max_new_tokens": 30, "ignore_eos": True} for p in ps]
    got = drive(engine, reqs, cancel_waiting=(5,), cancel_after={0: 4, 3: 10})
    assert got[5].finish_reason == "cancelled" and got[5].token_ids == []
    for k in (0, 3):
        assert got[k].finish_reason == "cancelled"
        assert 0 < len(got[k].token_ids) < 30
        assert got[k].token_ids == full[k].token_ids[: len(got[k].token_ids)]
    for k in (1, 2, 4):
        assert got[k].token_ids == full[k].token_ids and got[k].finish_reason == "length"
    assert engine.free_pages == engine.total_pages
    assert engine.cancel(got[1].request_id) is False  # finished: a no-op
    with pytest.raises(ValueError, match="no request has id"):
        engine.cancel(10**6)


def test_cancel_twice_and_configure_in_flight(engine):
    engine.configure()
    rid = engine.submit(prompts(1)[0], max_new_tokens=30, ignore_eos=True)
    with pytest.raises(ValueError, match="in flight"):
        engine.configure(spec=CHAIN)
    engine.step()
    assert engine.cancel(rid) is True
    assert engine.cancel(rid) is False
    (res,) = engine.step()
    assert res.finish_reason == "cancelled" and not engine.has_work
    assert engine.free_pages == engine.total_pages


@pytest.mark.parametrize("spec", [None, CHAIN, SAMPLED_TREE, TREE], ids=["plain", "chain", "sampled_tree", "tree"])
def test_greedy_rows_of_mixed_rounds_are_exact(engine, spec):
    ps = prompts(8)
    greedy = engine.generate(ps, max_new_tokens=16, ignore_eos=True)
    mixed = [SamplingParams(), T1, SamplingParams(), T07]

    def run(seed: int) -> dict:
        engine.configure(spec=spec, seed=seed)
        reqs = [{"prompt_ids": p, "max_new_tokens": 16, "ignore_eos": True, "sampling": mixed[i % 4]}
                for i, p in enumerate(ps)]
        return drive(engine, reqs)

    got = run(seed=3)
    for i in range(0, len(ps), 2):
        assert got[i].token_ids == greedy[i].token_ids, i
    sampled = [got[i].token_ids for i in range(1, len(ps), 2)]
    assert sampled != [greedy[i].token_ids for i in range(1, len(ps), 2)]  # the sampled rows really sample
    assert [run(seed=3)[i].token_ids for i in range(1, len(ps), 2)] == sampled  # reproducible
    if spec is not None:
        assert sum(sum(got[i].accept_lengths) for i in range(0, len(ps), 2)) > len(ps)  # multi-token rounds
    assert engine.free_pages == engine.total_pages


def test_zero_max_new_tokens_and_bad_requests(engine):
    engine.configure()
    rid = engine.submit([1, 2, 3], max_new_tokens=0)
    (res,) = engine.step()
    assert res.request_id == rid and res.token_ids == [] and res.finish_reason == "length"
    with pytest.raises(ValueError, match="top_p"):
        engine.submit([1, 2], sampling=SamplingParams(temperature=1.0, top_p=0.0))
    with pytest.raises(ValueError, match="empty"):
        engine.submit([])
    assert not engine.has_work and torch.equal(engine.block_table, torch.zeros_like(engine.block_table))


def test_decode_rounds_counts_batched_rounds(engine):
    """``decode_rounds`` (what the benchmarks divide decode time by): one per step that ran rows --
    a plain request of n tokens takes n - 1 (its first token comes from prefill), and requests that
    run side by side share their rounds."""
    before = engine.decode_rounds
    engine.generate([prompts(1)[0]], max_new_tokens=6, ignore_eos=True)
    assert engine.decode_rounds - before == 5
    before = engine.decode_rounds
    engine.generate(prompts(3), max_new_tokens=6, ignore_eos=True, concurrency=3)
    assert engine.decode_rounds - before == 5


def test_accept_lengths_count_the_tokens_kept(engine):
    """A round cut by a stop token or the token limit records the tokens it kept, so every result's
    accept_lengths sum to its tokens after the first (which prefill gives)."""
    ps = prompts(4)
    plain = engine.generate(ps, max_new_tokens=12, ignore_eos=True, spec=CHAIN)
    stops = [r.token_ids[5] for r in plain]  # a stop token inside each output, likely mid-round
    for limit, stop in ((7, None), (40, stops)):
        for r, s in zip(ps, stops if stop else [None] * len(ps)):
            (res,) = engine.generate([r], max_new_tokens=limit, ignore_eos=True, spec=CHAIN,
                                     stop_token_ids=[s] if s is not None else None)
            assert sum(res.accept_lengths) == len(res.token_ids) - 1, (res.accept_lengths, res.token_ids)
