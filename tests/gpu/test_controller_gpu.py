"""The draft controller on CUDA (skipped without a GPU): its tensor decisions equal the plain-Python
reference bit for bit when they run on the GPU (random rounds, and rounds recorded from a real
drafter on the device); the cost profiler measures positive, finite costs in both timing modes
(CUDA graphs and eager launches) on the device; and greedy output under the controller equals plain
decoding in fp32 on the GPU, whatever the table makes it choose -- host-chained without graphs
("within") and planned a round ahead with every planned shape a CUDA graph ("ahead").

    python -m pytest -q tests/gpu/test_controller_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.cost_tables import linear_table
from tests.runtime_pair import build_pair
from torchspec.runtime.controlled_drafting import PROBE_WIDTH
from torchspec.runtime.controller_policy import (
    PROB_ONE,
    RANK_BUCKETS,
    decide_after_depth,
    expected_tokens,
    verify_width,
)
from torchspec.runtime.controller_reference import (
    reference_decide_after_depth,
    reference_expected_tokens,
    reference_next_plan,
)
from torchspec.runtime.cost_profile import profile_costs
from torchspec.runtime.cost_table import device_name
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine
from torchspec.runtime.plan_averages import PLANS_ENV
from torchspec.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    return build_pair(tmp_path_factory.mktemp("controller_gpu"), tiny_tokenizer)


def engine_of(pair, cuda_graphs: bool = False):
    return load_engine(*pair, device="cuda", dtype="float32", max_batch=4, max_context=192, page_size=16,
                       cuda_graphs=cuda_graphs)


def decide_on_gpu_and_reference(pool, front, edge, depth, depth_ms, verify_ms, valid, scale, ahead=False):
    """((width, stop, go, expected tokens) on CUDA, the same from the reference on the host)."""
    scale_t = None if scale is None else torch.tensor(scale, device=CUDA)
    got = decide_after_depth(pool.to(CUDA), front.to(CUDA), edge.to(CUDA), depth, depth_ms.to(CUDA),
                             verify_ms.to(CUDA), valid.to(CUDA), scale_t, ahead=ahead)
    width = verify_width(pool.to(CUDA), depth, depth_ms.to(CUDA), verify_ms.to(CUDA), valid.to(CUDA), scale_t, ahead)
    tokens = expected_tokens(pool.to(CUDA), verify_ms.shape[0] - 1, valid.to(CUDA), scale_t)
    want = reference_decide_after_depth(pool.tolist(), front.tolist(), edge.tolist(), depth, depth_ms.tolist(),
                                        verify_ms.tolist(), valid.tolist(), scale, ahead)
    want_tokens = reference_expected_tokens(pool.tolist(), verify_ms.shape[0] - 1, valid.tolist(), scale)
    assert int(width) == want[0]
    return (int(got.width), bool(got.stop), bool(got.go), tokens.tolist()), (*want, want_tokens)


def test_random_rounds_decide_on_the_gpu_like_the_reference():
    from tests.unit.test_controller_policy import draft_scores

    gen = torch.Generator().manual_seed(1)
    seen = set()
    for i in range(200):
        rows, k = int(torch.randint(1, 65, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
        d_max = int(torch.randint(1, 7, (1,), generator=gen))
        depth = int(torch.randint(0, d_max, (1,), generator=gen))
        n_max = int(torch.randint(0, 64, (1,), generator=gen))
        pool, front, edge = draft_scores(gen, rows, k, depth, 200, float(torch.rand(1, generator=gen)) * 8)
        depth_ms = 0.02 + torch.rand(d_max, generator=gen) * 0.5
        verify_ms = 1 + torch.cumsum(torch.rand(n_max + 1, generator=gen) * 0.3, 0)
        valid = torch.rand(rows, generator=gen) < 0.9
        scale = (None if i % 3 == 0 else int(torch.randint(0, 2 * 65536, (1,), generator=gen)) if i % 3 == 1
                 else torch.randint(0, 4 * 65536, (RANK_BUCKETS,), generator=gen).tolist())  # one a rank bucket
        got, want = decide_on_gpu_and_reference(pool, front, edge, depth, depth_ms, verify_ms, valid, scale,
                                                ahead=i % 4 < 2)
        assert got == want, (i, rows, k, depth, n_max)
        seen.add(got[2])
    assert seen == {True, False}


def test_recorded_real_rounds_decide_on_the_gpu_like_the_reference(pair, tiny_tokenizer, monkeypatch):
    """Every decision of a real controlled generation on the GPU, replayed through the reference: host-chained
    ("within": ``decide_after_depth`` after each depth) and planned ahead (``decide_every_depth`` after the round,
    and the decision kernel: each depth's go flag and width against the reference at that depth, the next
    round's plan, and the kernel's calibration evidence against ``Calibration.evidence``)."""
    import torchspec.runtime.controlled_rounds as cd

    within, ahead = [], []
    real_after, real_every = cd.decide_after_depth, cd.decide_every_depth

    def host(t):
        return t.detach().cpu().clone() if torch.is_tensor(t) else t

    def after(pool, front, edge, depth, depth_ms, verify_ms, valid, scale=None):
        within.append([host(t) for t in (pool, front, edge, depth, depth_ms, verify_ms, valid, scale)])
        return real_after(pool, front, edge, depth, depth_ms, verify_ms, valid, scale)

    def every(pool, sizes, children, depth_ms, verify_ms, valid, scale, verified):  # the last round's plans (PLANS_ENV below)
        plan = real_every(pool, sizes, children, depth_ms, verify_ms, valid, scale, verified)
        ahead.append([host(t) for t in (pool, list(sizes), children, depth_ms, verify_ms, valid, scale, verified,
                                        plan.go, plan.width, plan.drafted, torch.stack([plan.next_depth, plan.next_width]))])
        return plan

    import torchspec.runtime.decide_triton as dt

    real_fused, fused = dt.decide_every_depth_fused, []

    def kernel(pool, sizes, fronts, edges, depth_ms, verify_ms, valid, cal, verified, averages=None):
        assert averages is None  # the last round's plans
        alpha, scale = cal.choice()  # what the kernel must choose from the same evidence
        evidence = cal.evidence(pool, verified, valid)
        plan, pending = real_fused(pool, sizes, fronts, edges, depth_ms, verify_ms, valid, cal, verified, averages)
        assert pending.tolist() == evidence.tolist()
        children = (fronts.double() + edges.double()) * alpha  # the inputs the tensor version decides on
        fused.append([host(t) for t in (pool.double() * alpha, list(sizes), children, depth_ms, verify_ms, valid,
                                        scale, verified, plan.go, plan.width, plan.drafted,
                                        torch.stack([plan.next_depth, plan.next_width]))])
        return plan, pending

    monkeypatch.setattr(cd, "decide_after_depth", after)
    monkeypatch.setattr(cd, "decide_every_depth", every)
    monkeypatch.setattr(dt, "decide_every_depth_fused", kernel)
    monkeypatch.setenv(PLANS_ENV, "last")  # reference_next_plan: the last round's plan
    engine = engine_of(pair)
    engine.runner.model.lm_head.weight.data.mul_(40.0)  # confident, so rounds go deep (test_controlled_drafting.py)
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "one two three", "alpha")]
    for mode, decide in (("within", "tensor"), ("ahead", "tensor"), ("ahead", "fused")):
        monkeypatch.setenv("TORCHSPEC_CONTROLLER_DECIDE", decide)
        engine.generate(ps, max_new_tokens=24, spec=SpecConfig(shape="tree", depth=4, topk=3, num_nodes=12),
                        ignore_eos=True, controller_mode=mode,
                        controller=linear_table(engine, 0.05, 0.02, widths=[1, 3], nodes=[0, 1, 2, 4, 8, 12]))
    assert len(within) > 10 and len(ahead) > 3 and len(fused) > 3
    ahead += fused  # the kernel's decisions on real rounds, against the reference as the tensor version's
    for pool, front, edge, depth, depth_ms, verify_ms, valid, scale in within:
        s = None if scale is None else scale.tolist()
        got, want = decide_on_gpu_and_reference(pool, front, edge, depth, depth_ms, verify_ms, valid, s)
        assert got == want
    for pool, sizes, children, depth_ms, verify_ms, valid, scale, verified, go, width, drafted, planned in ahead:
        s = None if scale is None else scale.tolist()
        for d, size in enumerate(sizes):  # a child's score is its frontier path plus its edge: the edge here is 0
            want = reference_decide_after_depth(pool[:, :size].tolist(), children[d].tolist(),
                                                torch.zeros_like(children[d]).tolist(), d, depth_ms.tolist(),
                                                verify_ms.tolist(), valid.tolist(), s, ahead=True)
            assert (int(width[d]), bool(go[d])) == (want[0], want[2]), (d, sizes)
        want = reference_next_plan([pool[:, :size].tolist() for size in sizes], children[-1].tolist(),
                                   torch.zeros_like(children[-1]).tolist(), depth_ms.tolist(), verify_ms.tolist(),
                                   valid.tolist(), s)
        assert tuple(planned.tolist()) == want
        unscaled = reference_expected_tokens(pool.tolist(), verified, valid.tolist(), None)
        assert int(drafted) == unscaled[-1] - int(valid.sum()) * PROB_ONE


def test_recorded_real_rounds_average_plans_on_the_gpu_like_the_tensor_twin(pair, tiny_tokenizer, monkeypatch):
    """Averaged plans (``TORCHSPEC_CONTROLLER_PLANS=average``) on real rounds: each call of the decision kernel
    against ``decide_every_depth_calibrated`` on the same inputs and a copy of the same table -- the plan (go
    flags, widths, next round, probe), the estimates, the evidence and the table folded in place all equal."""
    import torchspec.runtime.decide_triton as dt
    from torchspec.runtime.controlled_rounds import decide_every_depth_calibrated

    real_fused, calls = dt.decide_every_depth_fused, []

    def kernel(pool, sizes, fronts, edges, depth_ms, verify_ms, valid, cal, verified, averages=None):
        assert averages is not None
        twin = averages.clone()
        want, evidence = decide_every_depth_calibrated(pool, sizes, fronts, edges, depth_ms, verify_ms, valid, cal,
                                                       verified, twin)
        plan, pending = real_fused(pool, sizes, fronts, edges, depth_ms, verify_ms, valid, cal, verified, averages)
        assert averages.tolist() == twin.tolist() and pending.tolist() == evidence.tolist()
        for field in ("go", "width", "next_depth", "next_width", "drafted", "estimates", "probe_depth", "probe_width"):
            assert getattr(plan, field).tolist() == getattr(want, field).tolist(), field
        calls.append(int(plan.next_depth))
        return plan, pending

    monkeypatch.setattr(dt, "decide_every_depth_fused", kernel)
    monkeypatch.setenv(PLANS_ENV, "average")
    monkeypatch.setenv("TORCHSPEC_CONTROLLER_DECIDE", "fused")
    engine = engine_of(pair)
    engine.runner.model.lm_head.weight.data.mul_(40.0)
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "one two three", "alpha")]
    engine.generate(ps, max_new_tokens=32, spec=SpecConfig(shape="tree", depth=4, topk=3, num_nodes=12),
                    ignore_eos=True, controller_mode="ahead",
                    controller=linear_table(engine, 0.05, 0.02, widths=[1, 3], nodes=[0, 1, 2, 4, 8, 12]))
    assert len(calls) > 3 and max(calls) > 1  # several rounds, some planned deeper than one depth


@pytest.mark.parametrize("timing", ["graph", "eager"])
def test_profile_costs_on_the_gpu(pair, timing):
    engine = engine_of(pair)
    table = profile_costs(engine, batches=[1, 4], contexts=[32, 128], widths=[1, 2], nodes=[0, 2, 8], repeats=3,
                          timing=timing)
    assert table.meta["timing"] == timing and table.key.device == device_name(engine.device)
    for t in (table.depth, table.verify):
        assert torch.isfinite(t).all() and (t > 0).all()
    assert math.isfinite(table.verify_ms(4, 100)[-1].item())
    assert engine.free_pages == engine.total_pages  # the lent pages came back
    with pytest.raises(ValueError, match="timing"):
        profile_costs(engine, batches=[1], contexts=[32], widths=[1], nodes=[0], repeats=1, timing="host")


@pytest.mark.parametrize("mode", ["within", "ahead"])
@pytest.mark.parametrize("depth_ms,per_node", [(0.01, 100.0), (0.001, 0.001), (0.05, 0.02)],
                         ids=["plain", "deep", "between"])
def test_controlled_greedy_equals_plain_on_the_gpu(pair, tiny_tokenizer, depth_ms, per_node, mode):
    engine = engine_of(pair, cuda_graphs=mode == "ahead")
    engine.runner.model.lm_head.weight.data.mul_(40.0)
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "the cat sat", "alpha", "one")]
    plain = engine.generate(ps, max_new_tokens=32, ignore_eos=True)
    for spec in (SpecConfig(shape="tree", depth=4, topk=3, num_nodes=12), SpecConfig(shape="chain", depth=5)):
        costs = linear_table(engine, depth_ms, per_node, widths=[1, 3], nodes=[0, 1, 2, 4, 8, 12], noise=0.5)
        for concurrency in ((4,) if mode == "ahead" else (1, 4)):  # ahead: every planned shape is a graph capture
            out = engine.generate(ps, max_new_tokens=32, spec=spec, ignore_eos=True, controller=costs,
                                  controller_mode=mode, concurrency=concurrency)
            assert [r.token_ids for r in out] == [r.token_ids for r in plain], (spec.shape, concurrency)
            widths = {w for _, w in engine.controller.trace}
            probe = PROBE_WIDTH if mode == "ahead" else 0  # ahead mode's probes verify the best candidate
            assert (widths <= {0, probe}) if per_node == 100.0 else (max(widths) > 0)
    assert engine.free_pages == engine.total_pages
    if mode == "ahead":  # every planned shape ran as a captured graph
        assert len(engine.graphs) > 4 and not engine.graphs.failed


def test_a_decision_kernel_that_cannot_be_built_falls_back_to_tensor_ops(pair, tiny_tokenizer, monkeypatch):
    """A GPU or Triton that cannot build the kernel: one warning, then the same decisions as tensor operations,
    the output still plain decoding's and every planned shape still a graph."""
    import triton.errors

    import torchspec.runtime.controlled_rounds as cd
    import torchspec.runtime.decide_triton as dt

    def unbuildable(*args, **kwargs):
        raise triton.errors.TritonError("no kernel here")

    monkeypatch.setattr(dt, "decide_every_depth_fused", unbuildable)
    monkeypatch.setattr(cd, "_UNBUILT", [])
    engine = engine_of(pair, cuda_graphs=True)
    engine.runner.model.lm_head.weight.data.mul_(40.0)
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "the cat sat")]
    plain = engine.generate(ps, max_new_tokens=24, ignore_eos=True)
    costs = linear_table(engine, 0.001, 0.001, widths=[1, 3], nodes=[0, 1, 2, 4, 8, 12])
    out = engine.generate(ps, max_new_tokens=24, spec=SpecConfig(shape="tree", depth=4, topk=3, num_nodes=12),
                          ignore_eos=True, controller=costs, concurrency=2)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert cd._UNBUILT == ["TritonError: no kernel here"] and not engine.graphs.failed
    assert max(w for _, w in engine.controller.trace) > 0


def test_a_new_table_calibrates_a_new_calibration_in_new_graphs(pair, tiny_tokenizer):
    """Graphs capture the calibration's tensors: a new cost table (a new calibration) must not replay the graphs
    of the last one, which would go on updating the old evidence while the new one stays empty."""
    engine = engine_of(pair, cuda_graphs=True)
    engine.runner.model.lm_head.weight.data.mul_(40.0)
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "the cat sat")]
    spec = SpecConfig(shape="tree", depth=4, topk=3, num_nodes=12)
    seen = []
    for seed in range(2):
        costs = linear_table(engine, 0.001, 0.001, widths=[1, 3], nodes=[0, 1, 2, 4, 8, 12], seed=seed)
        engine.generate(ps, max_new_tokens=24, spec=spec, ignore_eos=True, controller=costs, concurrency=2)
        cal = engine.controller.calibration
        seen.append(cal)
        assert float(cal.accepted) > 0 and float(cal.expected[0]) > 0  # this table's rounds fed this calibration
    assert seen[0] is not seen[1] and seen[0].serial != seen[1].serial


@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_every_planned_round_is_captured_before_any_runs(pair, tiny_tokenizer, shape, monkeypatch):
    """``capture_controller_graphs`` captures, on idle rows, every round the controller may plan at the configured
    batch (each depth and width, after deferred plain rounds or not, and the deferring plain round) for every
    context bucket; the runs that follow -- whatever the table makes the controller choose -- capture nothing
    more, and their greedy output is plain decoding's (the idle captures wrote nothing). Deciding rounds
    ("average": a chain's held shapes repeat across depths, so their count is not the list's; held plans'
    captures are test_held_plans_run_as_captured_graphs_and_keep_greedy_output's)."""
    monkeypatch.setenv(PLANS_ENV, "average")
    engine = engine_of(pair, cuda_graphs=True)
    engine.runner.model.lm_head.weight.data.mul_(40.0)
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "the cat sat", "alpha", "one")]
    plain = engine.generate(ps, max_new_tokens=40, ignore_eos=True, concurrency=4)
    spec = SpecConfig(shape=shape, depth=4, topk=3, num_nodes=12)
    decisions = set()
    for i, (depth_ms, per_node) in enumerate(((0.01, 100.0), (0.001, 0.001), (0.05, 0.02))):
        costs = linear_table(engine, depth_ms, per_node, widths=[1, 3], nodes=[0, 1, 2, 4, 8, 12], noise=0.5)
        engine.configure(spec=spec, controller=costs, concurrency=4)
        captured = engine.capture_controller_graphs()
        assert captured == len(engine.controller.round_shapes(GREEDY, 4, 0)) + (i == 0)  # + the deferring plain round
        assert engine.capture_controller_graphs() == 0  # once per (batch, bucket, shape, calibration)
        before = len(engine.graphs)
        out = engine.generate(ps, max_new_tokens=40, spec=spec, ignore_eos=True, controller=costs, concurrency=4)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain], (depth_ms, per_node)
        assert len(engine.graphs) == before, "a controlled run captured a graph it should have found captured"
        decisions |= set(engine.controller.trace)
    assert len(decisions) > 3 and not engine.graphs.failed
    assert engine.free_pages == engine.total_pages


@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_held_plans_run_as_captured_graphs_and_keep_greedy_output(pair, tiny_tokenizer, shape, monkeypatch):
    """Held plans (``TORCHSPEC_CONTROLLER_PLANS=held``) on CUDA graphs: every held shape is among the graphs
    captured before the run, so the run captures nothing more; held rounds run; the output is plain decoding's."""
    monkeypatch.setenv(PLANS_ENV, "held")
    engine = engine_of(pair, cuda_graphs=True)
    engine.runner.model.lm_head.weight.data.mul_(40.0)
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "the cat sat", "alpha", "one")]
    plain = engine.generate(ps, max_new_tokens=48, ignore_eos=True, concurrency=4)
    spec = SpecConfig(shape=shape, depth=4, topk=3, num_nodes=12)
    costs = linear_table(engine, 1e-4, 1e-4, widths=[1, 3], nodes=[0, 1, 2, 4, 8, 12])  # cheap: plans settle
    engine.configure(spec=spec, controller=costs, concurrency=4)
    assert engine.capture_controller_graphs() > 0
    before = len(engine.graphs)
    engine.round_kinds.clear()
    out = engine.generate(ps, max_new_tokens=48, spec=spec, ignore_eos=True, controller=costs, concurrency=4)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert len(engine.graphs) == before, "a held round captured a graph it should have found captured"
    held = sum(n for kind, (n, _) in engine.round_kinds.items() if kind.startswith("held"))
    assert held > 0, engine.round_kinds
    assert not engine.graphs.failed and engine.free_pages == engine.total_pages


@pytest.mark.parametrize("scale", [5.0, 40.0])
def test_held_plans_after_a_wider_batch_as_a_chain_keep_greedy_output(pair, tiny_tokenizer, scale, monkeypatch):
    """The bench's order on one engine (thirtieth session: an illegal memory access on an H100 in the held run at
    c = 8 after c = 64 with a middling drafter, not at c = 8 alone): at a wide batch the controller drafts chains
    (``chain_from_batch``), then at a narrower one trees, each batch running the averaged plans, the chain and held
    plans in turn on CUDA graphs. Every run must equal plain decoding and return every page."""
    engine = engine_of(pair, cuda_graphs=True)
    engine.runner.model.lm_head.weight.data.mul_(scale)  # x5: a middling drafter; x40: a confident one
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "the cat sat", "alpha", "one")]
    spec = SpecConfig(shape="tree", depth=4, topk=3, num_nodes=12)
    chain = SpecConfig(shape="chain", depth=4)
    costs = linear_table(engine, 0.02, 0.01, widths=[1, 3], nodes=[0, 1, 2, 4, 8, 12])
    for concurrency in (4, 2):
        plain = [r.token_ids for r in engine.generate(ps * 2, max_new_tokens=48, ignore_eos=True,
                                                      concurrency=concurrency)]
        for bound, plans in ((spec, "average"), (chain, "average"), (spec, "held")):
            monkeypatch.setenv(PLANS_ENV, plans)
            out = engine.generate(ps * 2, max_new_tokens=48, spec=bound, ignore_eos=True, controller=costs,
                                  concurrency=concurrency, chain_from_batch=4 if bound is spec else None)
            torch.cuda.synchronize()
            assert [r.token_ids for r in out] == plain, (concurrency, bound.shape, plans)
    assert not engine.graphs.failed and engine.free_pages == engine.total_pages


@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_graphed_rounds_fold_the_calibrations_averaged_table(pair, tiny_tokenizer, shape, monkeypatch):
    """With averaged plans, rounds replayed from CUDA graphs fold into the calibration's one table per shape, as
    eager rounds do (thirtieth session: each graph had folded its own copy of the table, so graphed rounds planned
    from their own plan's rounds alone and the calibration's table stayed unrated). Outputs stay plain decoding's;
    the plans round by round are compared and printed, not asserted (a graph's matmuls may round differently)."""
    monkeypatch.setenv(PLANS_ENV, "average")
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "the cat sat", "alpha", "one")]
    spec = SpecConfig(shape=shape, depth=4, topk=3, num_nodes=12)
    runs = {}
    for graphs in (False, True):
        engine = engine_of(pair, cuda_graphs=graphs)
        engine.runner.model.lm_head.weight.data.mul_(5.0)  # plans that move between shapes
        costs = linear_table(engine, 0.02, 0.01, widths=[1, 3], nodes=[0, 1, 2, 4, 8, 12])
        out = engine.generate(ps, max_new_tokens=48, spec=spec, ignore_eos=True, controller=costs, concurrency=4)
        tables = engine.controller.calibration._averages
        runs[graphs] = [r.token_ids for r in out], list(engine.controller.trace), tables
        assert tables and all(bool((t >= 0).any()) for t in tables.values()), (graphs, tables)
    assert runs[True][0] == runs[False][0]
    assert len(set(runs[True][1])) > 2, runs[True][1]  # positive control: the plans moved
    same = sum(a == b for a, b in zip(runs[True][1], runs[False][1]))
    print(f"{shape}: graphed and eager plans agree in {same} of {len(runs[False][1])} rounds")
