"""Engine correctness on CPU (fp32): the plain decoder equals transformers' greedy ``generate``, greedy
speculation equals the plain decoder token for token (chain and tree, several shapes, batch sizes
1, 3 and 7, EOS inside accepted spans), KV pages all come back, and bad input is refused cleanly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.runtime_pair import build_pair
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine
from torchspec.runtime.sampling import SamplingParams

SPECS = [
    SpecConfig(shape="chain", depth=1),
    SpecConfig(shape="chain", depth=3),
    SpecConfig(shape="chain", depth=6),
    SpecConfig(shape="tree", depth=3, topk=2, num_nodes=5),
    SpecConfig(shape="tree", depth=4, topk=3, num_nodes=12),
    SpecConfig(shape="tree", depth=6, topk=4, num_nodes=24),
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory, tiny_tokenizer):
    return build_pair(tmp_path_factory.mktemp(f"pair_{request.param}"), tiny_tokenizer, flavour=request.param)


@pytest.fixture(scope="module")
def engine(pair):
    target, drafter = pair
    return load_engine(target, drafter, device="cpu", dtype="float32", max_batch=3, max_context=160, page_size=4)


def prompts(tokenizer, n: int) -> list[list[int]]:
    texts = ["hello there", "the cat sat on a mat and", "one two three", "repeat: red green blue",
             "alpha", "a much longer prompt that spans several pages of the cache, surely", "dog"]
    return [tokenizer.encode(texts[i % len(texts)], add_special_tokens=False) for i in range(n)]


def test_plain_decoder_equals_transformers_generate(pair, engine, tiny_tokenizer):
    hf = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()
    ps = prompts(tiny_tokenizer, 3)
    ours = engine.generate(ps, max_new_tokens=24, ignore_eos=True)
    for p, r in zip(ps, ours):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0, min_new_tokens=24)[0, len(p):].tolist()
        assert r.token_ids == ref


@pytest.fixture(scope="module")
def plain_outputs(engine, tiny_tokenizer):
    """Plain greedy outputs per batch size, computed once per target."""
    return {n: engine.generate(prompts(tiny_tokenizer, n), max_new_tokens=40, ignore_eos=True) for n in (1, 3, 7)}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.shape}-d{s.depth}-k{s.topk}-n{s.num_nodes}")
@pytest.mark.parametrize("batch", [1, 3, 7])
def test_greedy_speculation_equals_plain(engine, plain_outputs, tiny_tokenizer, spec, batch):
    ps = prompts(tiny_tokenizer, batch)
    plain = plain_outputs[batch]
    spec_out = engine.generate(ps, max_new_tokens=40, spec=spec, ignore_eos=True)
    for a, b in zip(plain, spec_out):
        assert b.token_ids == a.token_ids
        assert sum(b.accept_lengths) + 1 >= len(b.token_ids)
    rounds = sum(len(r.accept_lengths) for r in spec_out)
    accepted = sum(sum(r.accept_lengths) for r in spec_out)
    if spec.depth > 1:  # the pair is built to agree: accepted spans must really occur
        assert accepted / rounds > 1.2
    assert engine.free_pages == engine.total_pages


@pytest.mark.parametrize("spec", [SPECS[2], SPECS[5]], ids=["chain", "tree"])
def test_stop_token_inside_accepted_span(engine, tiny_tokenizer, spec):
    ps = prompts(tiny_tokenizer, 3)
    plain = engine.generate(ps, max_new_tokens=40, ignore_eos=True)
    spec_full = engine.generate(ps, max_new_tokens=40, spec=spec, ignore_eos=True)
    # a stop token the speculative run committed in the middle of a multi-token round
    stop = None
    for r in spec_full:
        pos = 0
        for n in r.accept_lengths:
            if n >= 3:
                stop = r.token_ids[1 + pos + 1]  # the second token of that round's span
                break
            pos += n
        if stop is not None:
            break
    assert stop is not None, "no round accepted 3+ tokens; the pair should agree more"
    a = engine.generate(ps, max_new_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    b = engine.generate(ps, max_new_tokens=40, spec=spec, ignore_eos=True, stop_token_ids=[stop])
    for x, y, full in zip(a, b, plain):
        assert y.token_ids == x.token_ids
        if stop in full.token_ids:
            assert y.token_ids == full.token_ids[: full.token_ids.index(stop) + 1]
            assert y.finish_reason == "stop"
    assert engine.free_pages == engine.total_pages


def test_max_new_tokens_truncates_inside_a_round(engine, tiny_tokenizer):
    ps = prompts(tiny_tokenizer, 3)
    for n in (1, 2, 5, 13):
        plain = engine.generate(ps, max_new_tokens=n, ignore_eos=True)
        spec = engine.generate(ps, max_new_tokens=n, spec=SPECS[2], ignore_eos=True)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        assert all(len(r.token_ids) == n and r.finish_reason == "length" for r in spec)


def test_sampled_generation_is_seeded_and_returns_pages(engine, tiny_tokenizer):
    ps = prompts(tiny_tokenizer, 5)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    for spec in (None, SPECS[2], SpecConfig(shape="tree", depth=3, branching=(3, 2, 1))):
        a = engine.generate(ps, max_new_tokens=20, sampling=params, spec=spec, seed=7)
        b = engine.generate(ps, max_new_tokens=20, sampling=params, spec=spec, seed=7)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        assert engine.free_pages == engine.total_pages


def test_context_limit_finishes_with_length(engine, tiny_tokenizer):
    p = [tiny_tokenizer.encode("a much longer prompt", add_special_tokens=False)]
    plain = engine.generate(p, max_new_tokens=1000, ignore_eos=True)
    spec = engine.generate(p, max_new_tokens=1000, spec=SPECS[5], ignore_eos=True)
    assert plain[0].finish_reason == spec[0].finish_reason == "length"
    assert len(p[0]) + len(plain[0].token_ids) <= engine.max_context
    assert spec[0].token_ids == plain[0].token_ids[: len(spec[0].token_ids)]
    assert engine.free_pages == engine.total_pages


@pytest.mark.parametrize("kwargs, match", [
    ({"prompts": [[]]}, "empty"),
    ({"prompts": [[1] * 200]}, "max_context"),
    ({"prompts": [[10**6]]}, "outside"),
    ({"sampling": SamplingParams(temperature=-1.0)}, "temperature"),
    ({"sampling": SamplingParams(temperature=1.0, top_p=0.0)}, "top_p"),
    ({"sampling": SamplingParams(temperature=1.0, top_p=1.5)}, "top_p"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"spec": SpecConfig(shape="tree", depth=2, topk=2, num_nodes=50)}, "num_nodes"),
    ({"spec": SpecConfig(shape="ring")}, "shape"),
    ({"concurrency": 9}, "concurrency"),
])
def test_bad_requests_are_refused_without_leaking_pages(engine, kwargs, match):
    args = {"prompts": [[1, 2, 3]], **kwargs}
    with pytest.raises(ValueError, match=match):
        engine.generate(args.pop("prompts"), **args)
    assert engine.free_pages == engine.total_pages


def test_max_new_tokens_zero_returns_empty(engine):
    out = engine.generate([[1, 2, 3], [4]], max_new_tokens=0, spec=SPECS[1])
    assert [r.token_ids for r in out] == [[], []] and all(r.finish_reason == "length" for r in out)


def test_drafter_exported_for_another_target_is_refused(pair, tmp_path, tiny_tokenizer):
    other, _ = build_pair(tmp_path, tiny_tokenizer, seed=5)
    with pytest.raises(ValueError, match="fingerprint"):
        load_engine(other, pair[1], device="cpu", dtype="float32", max_batch=1, max_context=64)


def test_efficient_head_drafter_speculates_losslessly(tmp_path, tiny_tokenizer):
    target, drafter = build_pair(tmp_path, tiny_tokenizer, lm_head_rank=16, lm_head_topk=32)
    engine = load_engine(target, drafter, device="cpu", dtype="float32", max_batch=2, max_context=96, page_size=8)
    assert engine.runner.efficient_head
    ps = prompts(tiny_tokenizer, 3)
    plain = engine.generate(ps, max_new_tokens=30, ignore_eos=True)
    for spec in (SPECS[2], SPECS[4]):
        out = engine.generate(ps, max_new_tokens=30, spec=spec, ignore_eos=True)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
