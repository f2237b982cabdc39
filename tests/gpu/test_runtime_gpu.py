"""Runtime on CUDA (skipped without a GPU): CUDA-graphed steps equal eager steps, greedy speculation
equals the plain decoder in fp32 with graphs on, sampled runs are reproducible from the seed, and
bf16 divergences between speculative and plain greedy output are reported with their logit margin."""

from __future__ import annotations

import pytest
import torch

from tests.runtime_pair import build_pair
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine
from torchspec.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu

SPECS = [SpecConfig(shape="chain", depth=5), SpecConfig(shape="tree", depth=5, topk=4, num_nodes=16)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    return build_pair(tmp_path_factory.mktemp("gpu_pair"), tiny_tokenizer)


def prompts(tokenizer, n):
    texts = ["hello there", "the cat sat on a mat and", "one two three", "repeat: red green blue", "alpha"]
    return [tokenizer.encode(texts[i % len(texts)], add_special_tokens=False) for i in range(n)]


def test_graphed_steps_equal_eager_and_plain_fp32(pair, tiny_tokenizer):
    graphed = load_engine(*pair, device="cuda", dtype="float32", max_batch=4, max_context=256, page_size=16)
    assert graphed.graphs is not None
    ps = prompts(tiny_tokenizer, 7)
    plain = graphed.generate(ps, max_new_tokens=48, ignore_eos=True)
    eager = load_engine(*pair, device="cuda", dtype="float32", max_batch=4, max_context=256, page_size=16)
    eager.graphs = None
    plain_eager = eager.generate(ps, max_new_tokens=48, ignore_eos=True)
    assert [r.token_ids for r in plain] == [r.token_ids for r in plain_eager]
    for spec in SPECS:
        out = graphed.generate(ps, max_new_tokens=48, spec=spec, ignore_eos=True)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
        assert sum(map(sum, (r.accept_lengths for r in out))) / sum(len(r.accept_lengths) for r in out) > 1.2
    assert len(graphed.graphs) >= 3 and not graphed.graphs.failed
    assert graphed.free_pages == graphed.total_pages


def test_sampled_graphed_runs_are_seeded(pair, tiny_tokenizer):
    engine = load_engine(*pair, device="cuda", dtype="float32", max_batch=4, max_context=256, page_size=16)
    ps = prompts(tiny_tokenizer, 5)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    for spec in (None, SPECS[0], SpecConfig(shape="tree", depth=4, branching=(3, 2, 1, 1))):
        a = engine.generate(ps, max_new_tokens=32, sampling=params, spec=spec, seed=3)
        b = engine.generate(ps, max_new_tokens=32, sampling=params, spec=spec, seed=3)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert not engine.graphs.failed


def test_bf16_divergences_are_near_ties(pair, tiny_tokenizer):
    engine = load_engine(*pair, device="cuda", dtype="bfloat16", max_batch=4, max_context=256, page_size=16)
    ps = prompts(tiny_tokenizer, 8)
    plain = engine.generate(ps, max_new_tokens=48, ignore_eos=True)
    out = engine.generate(ps, max_new_tokens=48, spec=SPECS[1], ignore_eos=True)
    equal = sum(a.token_ids == b.token_ids for a, b in zip(plain, out))
    print(f"bf16: {equal}/{len(ps)} sequences identical")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).cuda().eval()
    for p, a, b in zip(ps, plain, out):
        if a.token_ids == b.token_ids:
            continue
        i = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        prefix = torch.tensor([p + a.token_ids[:i]], device="cuda")
        logits = hf(prefix).logits[0, -1].float()
        margin = float(logits[a.token_ids[i]] - logits[b.token_ids[i]]).__abs__()
        print(f"divergence at token {i}: fp32 logit margin {margin:.4f}")
        assert margin < 0.05, "a bf16 divergence must be a near-tie"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_drafter_is_graphed(tmp_path, tiny_tokenizer, dtype):
    """An MoE drafter's rounds capture as CUDA graphs (no eager fallback), and stay lossless in fp32. Its
    load statistics once made a host tensor per forward, and then the fp32 grouped GEMM's group sizes
    (``grouped_mm_syncs``), both of which graph capture refuses; bf16 takes the native grouped GEMM."""
    pair = build_pair(tmp_path, tiny_tokenizer, moe=True)
    engine = load_engine(*pair, device="cuda", dtype=dtype, max_batch=4, max_context=256, page_size=16)
    ps = prompts(tiny_tokenizer, 5)
    plain = engine.generate(ps, max_new_tokens=32, ignore_eos=True)
    for spec in SPECS:
        out = engine.generate(ps, max_new_tokens=32, spec=spec, ignore_eos=True)
        if dtype == "float32":  # bf16 may diverge at near-ties (test_bf16_divergences_are_near_ties)
            assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert len(engine.graphs) >= 3 and not engine.graphs.failed
