"""Tensor-parallel serving of a hybrid Gated-DeltaNet target on gloo == single-process (TP=2).

The GDN layers' heads, convolution channels and recurrent state are sharded with the heads, so each
rank keeps 1/tp of every slot's state and commits its own part of the accepted node. One 2-rank
launch (Qwen3.5-style tiny target, fp32) checks: greedy chain and tree speculation equal the TP
plain decoder token for token, which equals the single-process plain decoder; every rank commits
the same tokens; each rank's recurrent state holds half the value heads.
"""

import pytest

from tests.runtime_pair import build_pair
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine
from torchspec.runtime.tp import check_tp_consistency, init_tp_from_env

from .launcher import launch

NEW_TOKENS = 24
TEXTS = ["hello there", "the cat sat on a mat and", "one two three"]
SPECS = {"chain": SpecConfig(shape="chain", depth=4), "tree": SpecConfig(shape="tree", depth=3, topk=3, num_nodes=8)}
ENGINE = {"device": "cpu", "dtype": "float32", "max_batch": 2, "max_context": 96, "page_size": 4}


def _generate(engine, prompts, **kwargs) -> list[list[int]]:
    out = engine.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=0, **kwargs)
    rounds = [a for r in out for a in r.accept_lengths]
    engine.last_acceptance = sum(rounds) / len(rounds)
    return [r.token_ids for r in out]


def _worker(target: str, drafter: str, prompts: list[list[int]]) -> dict:
    group, device = init_tp_from_env(backend="gloo")
    engine = load_engine(target, drafter, tp_group=group, **{**ENGINE, "device": device})
    runs = {"plain": _generate(engine, prompts)}
    acceptance = {}
    for name, spec in SPECS.items():
        runs[name] = _generate(engine, prompts, spec=spec)
        acceptance[name] = engine.last_acceptance
    for tokens in runs.values():
        check_tp_consistency(tokens, group)
    return {"runs": runs, "acceptance": acceptance, "state_heads": engine.caches.recurrent.ssm.shape[2],
            "free_pages": engine.free_pages == engine.total_pages}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    target, drafter = build_pair(tmp_path_factory.mktemp("tp_hybrid"), tiny_tokenizer, flavour="qwen3_5")
    return target, drafter, [tiny_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def test_tp2_hybrid_speculation_equals_single_process_plain(pair):
    target, drafter, prompts = pair
    single = load_engine(target, drafter, **ENGINE)
    want = _generate(single, prompts)
    results = launch(_worker, world_size=2, args=pair, timeout_s=180)
    heads = single.caches.recurrent.ssm.shape[2]
    for r in results:
        assert r["state_heads"] * 2 == heads and r["free_pages"]
        assert r["runs"]["plain"] == want
        for name in SPECS:
            assert r["runs"][name] == want, name
            assert r["acceptance"][name] > 1.2, r["acceptance"]  # drafts were really accepted
