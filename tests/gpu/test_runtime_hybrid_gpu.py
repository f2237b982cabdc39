"""Hybrid Gated-DeltaNet targets in the runtime on CUDA (skipped without a GPU).

* fp32, CUDA graphs on: greedy speculation (chain, tree) equals the plain decoder, which equals the
  eager plain decoder, over 7 prompts through 4 slots; a second call (graphs replayed, not captured)
  gives the same tokens; no step fell back to eager. A hybrid step commits recurrent state, so this
  also checks that capturing a graph (warm-up runs + first replay) commits nothing.
* bf16 (the serving dtype; a random tiny qwen3_5 target): speculative == plain with graphs on, any
  divergence a near-tie of the fp32 oracle.
* commit sanity, timing-free: a whole tree forward's recurrence (schedule, conv, delta rule) and
  ``commit`` captured in one CUDA graph and replayed for two different accepted nodes give each time
  the state of running that node's path sequentially (gdn_ops), and leave invalid rows alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_runtime_hybrid import (
    gdn_inputs,
    hybrid_pair,
    oracle,
    path_to,
    prompts,
    random_trees,
    sequential,
)
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine
from torchspec.runtime.recurrent_state import RecurrentState, RecurrentStep, build_recurrent_meta

pytestmark = pytest.mark.gpu

SPECS = [SpecConfig(shape="chain", depth=5), SpecConfig(shape="tree", depth=5, topk=4, num_nodes=16)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    return hybrid_pair(tmp_path_factory.mktemp("gpu_hybrid"), tiny_tokenizer, "qwen3_5")


def test_graphed_speculation_equals_plain_fp32(pair, tiny_tokenizer):
    engine = load_engine(*pair, device="cuda", dtype="float32", max_batch=4, max_context=256, page_size=16)
    assert engine.graphs is not None and engine.caches.recurrent is not None
    ps = prompts(tiny_tokenizer, 7)
    plain = engine.generate(ps, max_new_tokens=48, ignore_eos=True)
    eager = load_engine(*pair, device="cuda", dtype="float32", max_batch=4, max_context=256, page_size=16)
    eager.graphs = None
    assert [r.token_ids for r in eager.generate(ps, max_new_tokens=48, ignore_eos=True)] == \
        [r.token_ids for r in plain]
    for spec in SPECS:
        for _ in range(2):  # first call captures the round's graph, the second replays it
            out = engine.generate(ps, max_new_tokens=48, spec=spec, ignore_eos=True)
            assert [r.token_ids for r in out] == [r.token_ids for r in plain]
        rounds = [a for r in out for a in r.accept_lengths]
        assert sum(rounds) / len(rounds) > 1.2
    assert len(engine.graphs) >= 3 and not engine.graphs.failed
    assert engine.free_pages == engine.total_pages


def test_bf16_speculation_equals_plain_or_near_ties(pair, tiny_tokenizer):
    engine = load_engine(*pair, device="cuda", dtype="bfloat16", max_batch=4, max_context=256, page_size=16)
    ps = prompts(tiny_tokenizer, 8)
    plain = engine.generate(ps, max_new_tokens=48, ignore_eos=True)
    hf = None
    for spec in SPECS:
        out = engine.generate(ps, max_new_tokens=48, spec=spec, ignore_eos=True)
        equal = sum(a.token_ids == b.token_ids for a, b in zip(plain, out))
        print(f"bf16 {spec.shape}: {equal}/{len(ps)} sequences identical")
        for p, a, b in zip(ps, plain, out):
            if a.token_ids == b.token_ids:
                continue
            if hf is None:
                hf = oracle(pair[0], "qwen3_5").cuda()
            i = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            with torch.no_grad():
                logits = hf(torch.tensor([p + a.token_ids[:i]], device="cuda")).logits[0, -1].float()
            margin = abs(float(logits[a.token_ids[i]] - logits[b.token_ids[i]]))
            print(f"divergence at token {i}: fp32 logit margin {margin:.4f}")
            assert margin < 0.05, "a bf16 divergence must be a near-tie"
    assert not engine.graphs.failed


def test_graphed_tree_recurrence_and_commit():
    b, n, kernel, dev = 3, 9, 4, torch.device("cuda")
    parents, depths = random_trees(b, n, seed=3)
    x, q, k, v, g, beta = (t.to(dev) for t in gdn_inputs(b, n, seed=4))
    weight = torch.randn(6, kernel, device=dev)
    state = RecurrentState([2], 4, 6, kernel, 2, 4, 5, torch.float32, dev)
    state.conv.normal_()
    state.ssm.normal_()
    before = (state.conv.clone(), state.ssm.clone())
    slots, valid = torch.tensor([3, 1, 0], device=dev), torch.tensor([True, True, False], device=dev)
    last = torch.zeros(b, dtype=torch.long, device=dev)
    parents_d, depths_d = parents.to(dev), depths.to(dev)

    def round_():
        step = RecurrentStep(state, build_recurrent_meta(slots, kernel, row_valid=valid, parents=parents_d,
                                                         depths=depths_d))
        out = step.conv(2, x, weight), step.delta_rule(2, q, k, v, g, beta)
        step.commit(last, valid)
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        round_()  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, o = round_()
    for choice in ([n - 1, 4, 2], [2, n - 1, 5]):
        state.conv.copy_(before[0])
        state.ssm.copy_(before[1])
        last.copy_(torch.tensor(choice))
        graph.replay()
        torch.cuda.synchronize()
        for r in range(b):
            committed = (before[1][0, slots[r]], before[0][0, slots[r]])
            args = (weight, x[r], q[r], k[r], v[r], g[r], beta[r])
            for i in range(n):
                ry, ro, _, _ = sequential(*committed, *args, path_to(parents[r], i))
                torch.testing.assert_close(y[r, i], ry, rtol=0, atol=1e-5)
                torch.testing.assert_close(o[r, i], ro, rtol=0, atol=1e-4)
            _, _, s, hist = sequential(*committed, *args, path_to(parents[r], choice[r]))
            want_ssm, want_conv = (s, hist) if valid[r] else committed
            torch.testing.assert_close(state.ssm[0, slots[r]], want_ssm, rtol=0, atol=1e-4)
            torch.testing.assert_close(state.conv[0, slots[r]], want_conv, rtol=0, atol=0)
        assert torch.equal(state.ssm[0, 2], before[1][0, 2])  # a slot no row uses
