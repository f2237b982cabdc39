"""Tensor-parallel speculative runtime on gloo == single-process plain decoding (TP=2 and TP=4).

One launch per TP size does every check (process start-up dominates on 2 cores). Each rank sets
up through ``init_tp_from_env`` (the world is the tp group) and builds the engine with
``load_engine(..., tp_group=...)`` from the tiny target + drafter pair (4 KV heads), fp32. Checks:
greedy chain and tree speculation equal the TP plain decoder token for token, and the TP plain
decoder equals the single-process one (computed here, tp_group=None); every rank commits the
same tokens (``check_tp_consistency``), greedy and sampled (T=0.8, chain); the guard names the
ranks that diverge.
"""

import pytest

from tests.runtime_pair import build_pair
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine
from torchspec.runtime.sampling import SamplingParams
from torchspec.runtime.tp import check_tp_consistency, init_tp_from_env, is_rank0

from .launcher import launch

TP_SIZES = (2, 4)
NEW_TOKENS = 30
TEXTS = ["hello there", "the cat sat on a mat and", "repeat: red green blue"]
SPECS = {
    "chain": SpecConfig(shape="chain", depth=4),
    "tree": SpecConfig(shape="tree", depth=4, topk=3, num_nodes=10),
}
SAMPLED = SamplingParams(temperature=0.8)
ENGINE = {"device": "cpu", "dtype": "float32", "max_batch": 3, "max_context": 96, "page_size": 4}


def _generate(engine, prompts, **kwargs) -> dict:
    out = engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=0, **kwargs)
    return {"tokens": [r.token_ids for r in out], "accept": [r.accept_lengths for r in out]}


def _tp_worker(target: str, drafter: str, prompts: list[list[int]]) -> dict:
    group, device = init_tp_from_env(backend="gloo")
    engine = load_engine(target, drafter, tp_group=group, **{**ENGINE, "device": device})
    runs = {"plain": _generate(engine, prompts)}
    for name, spec in SPECS.items():
        runs[name] = _generate(engine, prompts, spec=spec)
    runs["sampled_chain"] = _generate(engine, prompts, spec=SPECS["chain"], sampling=SAMPLED)
    for run in runs.values():
        check_tp_consistency(run["tokens"], group)  # raises on every rank if any rank diverged
    # the guard itself: make the last rank diverge and expect it to be named
    fake = [[0, 1, 2]] if group.rank() < group.size() - 1 else [[0, 1, 3]]
    with pytest.raises(RuntimeError, match=rf"ranks \[{group.size() - 1}\] generated different tokens"):
        check_tp_consistency(fake, group)
    return {"tp_rank": engine.decoder.tp_rank, "tp_size": engine.decoder.tp_size, "rank0": is_rank0(),
            "free_pages": engine.free_pages == engine.total_pages, "runs": runs}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    target, drafter = build_pair(tmp_path_factory.mktemp("tp_engine_pair"), tiny_tokenizer)
    prompts = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    return target, drafter, prompts


@pytest.fixture(scope="module")
def single_process_plain(pair) -> list[list[int]]:
    target, drafter, prompts = pair
    group, _ = init_tp_from_env()
    assert group is None  # no torchrun env in the test process
    return _generate(load_engine(target, drafter, **ENGINE), prompts)["tokens"]


@pytest.fixture(scope="module", params=TP_SIZES, ids=lambda tp: f"tp{tp}")
def tp_results(request, pair) -> tuple[int, list[dict]]:
    return request.param, launch(_tp_worker, world_size=request.param, args=pair, timeout_s=120)


def test_ranks_hold_their_shard_and_agree(tp_results):
    tp, results = tp_results
    assert [r["tp_rank"] for r in results] == list(range(tp))
    assert all(r["tp_size"] == tp for r in results)
    assert [r["rank0"] for r in results] == [True] + [False] * (tp - 1)
    assert all(r["free_pages"] for r in results)
    for name in results[0]["runs"]:  # greedy and sampled: every rank committed the same tokens
        assert all(r["runs"][name] == results[0]["runs"][name] for r in results), name


def test_tp_plain_equals_single_process(tp_results, single_process_plain):
    _, results = tp_results
    plain = results[0]["runs"]["plain"]["tokens"]
    assert [len(t) for t in plain] == [NEW_TOKENS] * len(TEXTS)
    assert plain == single_process_plain


@pytest.mark.parametrize("name", list(SPECS))
def test_tp_greedy_speculation_equals_plain(tp_results, single_process_plain, name):
    tp, results = tp_results
    run = results[0]["runs"][name]
    assert run["tokens"] == results[0]["runs"]["plain"]["tokens"] == single_process_plain
    rounds = sum(len(a) for a in run["accept"])
    mean = sum(sum(a) for a in run["accept"]) / rounds
    print(f"tp={tp} {name}: mean acceptance {mean:.2f} over {rounds} rounds")
    assert mean > 1.2  # the pair is built to agree: accepted spans must really occur


def test_tp_sampled_chain_runs(tp_results):
    tp, results = tp_results
    run = results[0]["runs"]["sampled_chain"]
    assert [len(t) for t in run["tokens"]] == [NEW_TOKENS] * len(TEXTS)
    assert run["tokens"] != results[0]["runs"]["plain"]["tokens"]  # T=0.8 really sampled
    rounds = sum(len(a) for a in run["accept"])
    print(f"tp={tp} sampled chain: mean acceptance {sum(sum(a) for a in run['accept']) / rounds:.2f}")
