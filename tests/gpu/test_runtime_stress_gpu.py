"""The request-API stress test on CUDA (skipped without a GPU): bf16, CUDA graphs on.

The workload of ``tests/integration/test_runtime_stress.py`` (256 requests through 8 slots, random
prompt and output lengths, shared system prompts with the prefix cache, chunked prefill, per-request
stop tokens, mixed greedy / sampled rows, random cancellations), run graphed in bf16. Checks: no crash,
0 leaked pages, no graph fell back to eager, at most 4 graphs per kind (greedy / mixed rounds share
them whatever the rows' settings), sampled requests reproducible for a fixed seed, and every greedy
request compared with the same request run alone (plain decoding, bf16): a difference is allowed
only as a near-tie -- at the first differing position the fp32 logits of the two tokens (the
checkpoint in fp32, transformers) differ by at most 2 bf16 ulps of the logit. Counts are printed.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.integration.test_runtime_stress import MAX_CONTEXT, PAGE, SLOTS, SPEC, expected, run, workload
from tests.runtime_pair import build_pair
from torchspec.runtime.engine import SpeculativeEngine
from torchspec.runtime.loading import load_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers (8 significant bits) at magnitude |x|."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("pair_stress_gpu"), None)


def engine_like(base, **kw) -> SpeculativeEngine:
    args = {"max_batch": SLOTS, "max_context": MAX_CONTEXT, "page_size": PAGE, "prefill_tokens": 24, "fuse": False,
            **kw}
    return SpeculativeEngine(base.decoder, base.runner, None, **args)


def test_stress_bf16_graphed(pair):
    base = load_engine(*pair, device="cuda", dtype="bfloat16", max_batch=1, max_context=MAX_CONTEXT,
                       page_size=PAGE, num_pages=2)
    reqs, cancel = workload()
    engine = engine_like(base)
    assert engine.graphs is not None
    results = run(engine, reqs, cancel, seed=5)
    assert not engine.graphs._failed
    kinds = {key[-1] for key in engine.graphs._graphs}
    assert kinds <= {"greedy", "mixed"} and len(engine.graphs) == len(kinds)  # one graph per (batch, spec, kind)
    again = run(engine_like(base), reqs, cancel, seed=5)
    assert [r.token_ids for r in again] == [r.token_ids for r in results]

    ref = engine_like(base, max_batch=1, prefix_cache=False)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).cuda().eval()
    counts = {"identical": 0, "near_tie": 0, "cancelled_or_context_prefix": 0}
    for i, req in enumerate(reqs):
        if not req["sampling"].greedy:
            continue
        alone = ref.generate([req["prompt_ids"]], max_new_tokens=req["max_new_tokens"], ignore_eos=True)[0].token_ids
        want, got = expected(alone, req, ref.eos_token_ids), results[i].token_ids
        if got == want:
            counts["identical"] += 1
            continue
        j = next((k for k, (x, y) in enumerate(zip(want, got)) if x != y), None)
        if j is None:  # one is a prefix of the other: cancelled, or ended at the context limit
            assert len(got) < len(want) and results[i].finish_reason in ("cancelled", "length")
            counts["cancelled_or_context_prefix"] += 1
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([req["prompt_ids"] + want[:j]], device="cuda")).logits[0, -1].float()
        a, b = float(logits[want[j]]), float(logits[got[j]])
        top = float(logits.max())
        print(f"request {i}: divergence at token {j}: logits {a:.5f} vs {b:.5f} (max {top:.5f})")
        assert abs(a - b) <= 2 * bf16_ulp(top), "a bf16 divergence must be a near-tie"
        counts["near_tie"] += 1
    print(f"bf16 stress, greedy requests vs one at a time: {counts}; spec {SPEC}")
    assert counts["identical"] > 0
