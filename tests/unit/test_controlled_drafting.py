"""The draft controller in the engine (torchspec/runtime/controlled_drafting.py), CPU, fp32.

Greedy output must equal plain decoding under every decision the controller takes. Cost tables are
built by hand to force each regime -- verification so dear that no draft pays (width 0: every round
commits one token), depths and nodes so cheap that it drafts the spec's whole depth and verifies wide
-- and random tables cover the decisions between (stops at every depth, widths 0 .. N). Bad
configurations are one-line errors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.controller_cases import NODES, SPECS, cpu_engine, prompts, run, table
from torchspec.runtime.calibration import ALPHAS, Calibration
from torchspec.runtime.controlled_drafting import MODES
from torchspec.runtime.cost_table import CostTable
from torchspec.runtime.drafting import SpecConfig


@pytest.fixture(scope="module")
def engine(controller_pair):
    return cpu_engine(controller_pair)


@pytest.fixture(scope="module")
def confident(controller_pair):
    """The same drafter with its head's logits scaled x40: the same argmax (the same accepted drafts), but
    confident -- the tiny pair's own distributions are near-flat (top probability ~0.004), which no
    cost table makes worth a second depth."""
    return cpu_engine(controller_pair, confident=True)


@pytest.fixture(scope="module")
def confidently_wrong(controller_pair):
    """Confident (head x40) and wrong: eh_proj scrambled, so the drafter no longer reads the token it
    must continue -- what an untrained drafter whose head is the target's looks like."""
    engine = cpu_engine(controller_pair, confident=True)
    w = engine.runner.model.eh_proj.weight
    w.data.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(7)) * 3 / w.shape[1] ** 0.5)
    return engine


@pytest.fixture(scope="module")
def plain(engine, tiny_tokenizer):
    return {n: engine.generate(prompts(tiny_tokenizer, n), max_new_tokens=32, ignore_eos=True) for n in (1, 3)}


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.shape)
@pytest.mark.parametrize("batch", [1, 3])
def test_verification_too_dear_decodes_plainly(engine, plain, tiny_tokenizer, spec, batch, mode):
    out, trace = run(engine, tiny_tokenizer, batch, spec, table(engine, depth=0.01, verify_per_node=50.0), mode)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain[batch]]
    from torchspec.runtime.controlled_drafting import PROBE_WIDTH

    probe = PROBE_WIDTH if mode == "ahead" else 0  # ahead mode's probes verify the best candidate
    assert trace and all(width <= probe for _, width in trace)
    assert sum(width > 0 for _, width in trace) <= len(trace) // 4 + 1  # the probes: the first, then a streak apart
    assert all(max(r.accept_lengths) <= 1 + probe for r in out)  # a plain step's token (and a probe's candidate)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.shape)
def test_cheap_drafting_goes_deep_and_wide(confident, plain, tiny_tokenizer, spec, mode):
    out, trace = run(confident, tiny_tokenizer, 3, spec, table(confident, depth=1e-4, verify_per_node=1e-4), mode)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain[3]]
    assert max(d for d, _ in trace) == spec.depth and max(w for _, w in trace) > spec.depth // 2
    assert max(max(r.accept_lengths) for r in out) > 1  # the pair agrees: drafts are accepted


def test_every_decision_keeps_greedy_output(confident, plain, tiny_tokenizer, mode):
    """Random tables between the two regimes: whatever depth and width each round gets, the text is plain's."""
    seen = set()
    for seed in range(7):
        spec = SPECS[seed % 2]
        costs = table(confident, depth=1e-3 + 0.02 * seed, verify_per_node=0.01 * 3 ** seed, noise=0.5, seed=seed)
        out, trace = run(confident, tiny_tokenizer, 1 + 2 * (seed % 2), spec, costs, mode)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain[1 + 2 * (seed % 2)]], seed
        seen |= set(trace)
    depths, widths = {d for d, _ in seen}, {w for _, w in seen}
    assert len(depths) >= 3 and 0 in widths and len(widths) >= 4, seen  # the runs really differ in shape


def test_bad_controller_configurations_are_refused(engine):
    costs = table(engine, depth=0.1, verify_per_node=0.1)
    with pytest.raises(ValueError, match="controller needs a spec"):
        engine.configure(controller=costs)
    with pytest.raises(ValueError, match="widths .* lack the drafter width 4"):
        engine.configure(spec=SpecConfig(shape="tree", depth=3, topk=4, num_nodes=8), controller=costs)
    small = CostTable(key=costs.key, widths=costs.widths, nodes=costs.nodes, batches=[1, 2], contexts=costs.contexts,
                      depth=costs.depth[:, :2], verify=costs.verify[:, :2], round=costs.round[:, :2], meta={})
    with pytest.raises(ValueError, match="batches up to 2 but 3 rows may run"):  # a round beyond it: refused now
        engine.configure(spec=SPECS[0], controller=small)
    engine.configure(spec=SPECS[0], controller=small, concurrency=2)
    with pytest.raises(ValueError, match="nodes go up to 12 but spec verifies up to 20"):
        engine.configure(spec=SpecConfig(shape="tree", depth=4, topk=3, num_nodes=20), controller=costs)
    with pytest.raises(ValueError, match="controller mode='sideways' must be one of"):
        engine.configure(spec=SPECS[0], controller=costs, controller_mode="sideways")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCHSPEC_CONTROLLER_DECIDE", "host")
        with pytest.raises(ValueError, match="TORCHSPEC_CONTROLLER_DECIDE='host' is not a way to decide"):
            engine.configure(spec=SPECS[0], controller=costs)
    engine.configure()  # plain again: the fixture's engine stays usable


def test_a_confidently_wrong_drafter_is_soon_not_verified(confidently_wrong, plain, tiny_tokenizer, mode):
    """Its confidence promises a wide tree; the calibration learns within a few rounds that nothing it
    proposes is accepted, and the controller then decodes plainly, probing one or two nodes now and then
    (a node costing 10% of a step pays from 10% acceptance on: the probes are the price of noticing a
    drafter that improves)."""
    costs = table(confidently_wrong, depth=0.02, verify_per_node=0.1)
    out, trace = run(confidently_wrong, tiny_tokenizer, 1, SPECS[0], costs, mode)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain[1]]
    widths = [w for _, w in trace]
    first = 0 if mode == "within" else 1  # ahead: the first round drafts depth 0 alone and plans the second
    assert widths[first] > 0  # before any evidence the confidence is believed
    assert sum(w == 0 for w in widths[3:]) >= 0.8 * len(widths[3:])


def test_an_underconfident_drafter_that_is_right_is_drafted(engine, plain, tiny_tokenizer, mode):
    """The tiny pair's own drafter: near-flat (top probability ~0.004, so a path of 3 is ~1e-7) yet the target's
    argmax. With a multiplicative scale alone (capped x4) the controller never drafted it (acceptance 1.0);
    the calibration's exponent reads it as it is borne out, and the controller drafts the widest trees."""
    spec = SPECS[0]
    out, trace = run(engine, tiny_tokenizer, 3, spec, table(engine, depth=1e-3, verify_per_node=1e-3), mode)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain[3]]
    alpha = float(engine.controller.calibration.choice()[0])
    fixed = engine.generate(prompts(tiny_tokenizer, 3), max_new_tokens=32, spec=spec, ignore_eos=True)

    def acceptance(results) -> float:
        return sum(sum(r.accept_lengths) for r in results) / sum(len(r.accept_lengths) for r in results)
    assert acceptance(out) >= 0.8 * acceptance(fixed) and acceptance(fixed) > 1.5, (acceptance(out), trace)
    assert max(d for d, _ in trace) >= 2 and max(w for _, w in trace) == spec.num_nodes, trace  # deep and wide
    assert alpha < 1


def test_from_chain_from_batch_rows_on_greedy_rounds_draft_a_chain(confident, plain, tiny_tokenizer, mode):
    """chain_from_batch=1: every round a chain (k = 1: at most spec.depth nodes verified); above the batch (4 for
    3 rows, which finish at different rounds) the same table drafts the k-wide tree, wider than the depth."""
    costs = table(confident, depth=1e-4, verify_per_node=1e-4)
    spec = SPECS[0]
    for chain_from, chain in ((1, True), (4, False)):
        out = confident.generate(prompts(tiny_tokenizer, 3), max_new_tokens=32, spec=spec, ignore_eos=True,
                                 controller=costs, chain_from_batch=chain_from, controller_mode=mode)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain[3]]
        widest = max(w for _, w in confident.controller.trace)
        assert (widest <= spec.depth) if chain else (widest > spec.depth), (chain_from, confident.controller.trace)
    with pytest.raises(ValueError, match="chain_from_batch=0"):
        confident.configure(spec=spec, controller=costs, chain_from_batch=0)


def test_the_cost_tables_chain_rule_applies_unless_the_caller_gives_one(confident, tiny_tokenizer):
    """A table that records ``chain_from_batch`` (torchspec-profile --chain-from-batch) makes the controller draft
    chains from that batch on by itself; an explicit ``chain_from_batch`` wins over it."""
    costs = table(confident, depth=1e-4, verify_per_node=1e-4)
    costs.chain_from_batch = 1
    spec = SPECS[0]
    for given, chain in ((None, True), (4, False)):
        confident.generate(prompts(tiny_tokenizer, 3), max_new_tokens=16, spec=spec, ignore_eos=True,
                           controller=costs, chain_from_batch=given)
        assert confident.controller.chain_from_batch == (1 if given is None else given)
        widest = max(w for _, w in confident.controller.trace)
        assert (widest <= spec.depth) if chain else (widest > spec.depth), (given, confident.controller.trace)


def test_ahead_rounds_draft_what_the_round_before_planned(confident, plain, tiny_tokenizer, monkeypatch):
    """Ahead mode: each greedy round's (depth, width) is the plan the previous round wrote on the device (clamped to
    the spec and to an allowed width), the first round drafts depth 0 alone, and depths grow one a round at most.
    Every round decides here ("average"; the default's held rounds run a plan undecided: test_controller_holds)."""
    import torchspec.runtime.controlled_rounds as cd
    from torchspec.runtime.plan_averages import PLANS_ENV

    monkeypatch.setenv(PLANS_ENV, "average")

    plans, real = [], cd.draft_ahead_tree

    def recording(*args):
        tree, plan = real(*args)
        plans.append(plan.tolist())
        return tree, plan

    monkeypatch.setattr(cd, "draft_ahead_tree", recording)
    import torchspec.runtime.steps as steps
    monkeypatch.setattr(steps, "draft_ahead_tree", recording)
    spec = SPECS[0]
    costs = table(confident, depth=0.01, verify_per_node=0.02, noise=0.5)
    out, trace = run(confident, tiny_tokenizer, 1, spec, costs, "ahead")
    assert [r.token_ids for r in out] == [r.token_ids for r in plain[1]]
    assert trace[0] == (1, 1) and len(plans) == len(trace)  # a first probe verifies the best candidate
    for (depth, width), planned in zip(trace[1:], plans):
        assert depth == min(planned[0], spec.depth) and width <= planned[1]
        assert width == planned[1] or width == max(n for n in NODES if n <= planned[1])
    assert all(b[0] <= a[0] + 1 for a, b in zip(trace, trace[1:]))
    assert max(d for d, _ in trace) >= 3 and max(w for _, w in trace) >= 4, trace


@pytest.mark.parametrize("plans", ["last", "average"])
def test_ahead_goes_deeper_where_depth_0_alone_does_not_pay(confident, plain, tiny_tokenizer, monkeypatch, plans):
    """A round's depth 0 dear (the whole width-0 round 1 ms over a plain step), every later depth and node nearly
    free: depth 0 alone is not worth verifying, a deeper round is. The probe's plan goes one depth deeper with
    the width the criterion predicted for that round (``RoundPlan.deeper_width``), not the width 0 of depth 0
    alone, which kept a drafter that pays from its second depth on in plain streaks for good; nor is a deep round
    cut back to depth 1 after one hard first token (the first depth where the criterion stopped, planned before):
    the plans only deepen, to the spec's depth (averaged plans more slowly: the depth-4 entries catch up with
    the optimistic first ratings of depth 3)."""
    from torchspec.runtime.plan_averages import PLANS_ENV

    monkeypatch.setenv(PLANS_ENV, plans)
    cheap = table(confident, depth=1e-4, verify_per_node=1e-3)
    costs = dataclasses.replace(cheap, round=cheap.verify[..., 0] + 1.0)
    out, trace = run(confident, tiny_tokenizer, 1, SPECS[0], costs, "ahead")
    assert [r.token_ids for r in out] == [r.token_ids for r in plain[1]]
    depths = [d for d, _ in trace]
    assert trace[0] == (1, 1) and depths == sorted(depths) and depths[-1] == SPECS[0].depth, trace
    assert all(w >= 4 for _, w in trace[2:]), trace
    if plans == "last":  # 1, 2, 3, then 4 deep
        assert all(d == SPECS[0].depth for d in depths[3:]), trace
    assert max(max(r.accept_lengths) for r in out) > 2


@pytest.mark.parametrize("plans", ["average", "last"])
def test_ahead_plans_equal_the_criterion_taken_depth_by_depth(confident, tiny_tokenizer, monkeypatch, plans):
    """Real rounds of a drafter: ahead mode's plan, evaluated after the round for every depth at once
    (``decide_every_depth``), is the plain-Python reference's on the pools the tree grew depth by depth --
    "last" (the default): ``reference_next_plan``, the best-rated round among the depths drafted and one more;
    "average": ``reference_plan_from`` the averaged table after ``reference_fold`` of the round's
    ``reference_round_estimates``, the table in the runtime equal to it -- and the calibration's evidence is
    ``expected_tokens`` of the verified nodes."""
    import torchspec.runtime.controlled_rounds as cd
    import torchspec.runtime.steps as steps
    from torchspec.runtime.controller_policy import PROB_ONE, expected_tokens
    from torchspec.runtime.controller_reference import reference_next_plan
    from torchspec.runtime.drafting import grow_dynamic_tree
    from torchspec.runtime.plan_averages import (
        PLANS_ENV,
        reference_fold,
        reference_plan_from,
        reference_round_estimates,
    )
    from torchspec.runtime.sampling import SamplingParams

    monkeypatch.setenv(PLANS_ENV, plans)

    real, checked = cd.draft_ahead_tree, []

    def depth_by_depth(runner, cache, inp, spec, costs):
        (alpha, scale), pools = costs.calibration.choice(), []
        a = float(alpha)  # the calibration's exponent: a power of two, so x * a is exact in any order

        def read(x: torch.Tensor) -> list:
            return (x.double() * a).tolist()
        for pool in grow_dynamic_tree(runner, cache, inp, spec, SamplingParams(), frontier_at_last=True):
            pools.append(read(torch.cat(pool.sc, 1)))
        args = (read(pool.front_sc), read(pool.front_edge()), costs.depth_ms.tolist(), costs.verify_ms.tolist(),
                inp.row_valid.tolist(), scale.tolist())
        folded = None
        if costs.averages is None:  # a probe: the plan itself
            want = reference_next_plan(pools, *args) * 2
        else:
            folded = reference_fold(costs.averages.tolist(), reference_round_estimates(pools, *args))
            want = reference_plan_from(folded, costs.depth_ms.tolist(), costs.verify_ms.tolist())
        live = int(inp.row_valid.sum()) * PROB_ONE
        drafted = [(int(expected_tokens(torch.cat(pool.sc, 1).double() * e, costs.plan[1], inp.row_valid)[-1]) - live)
                   / PROB_ONE for e in ALPHAS]  # the evidence under each exponent
        return list(want), drafted, folded

    def compared(runner, cache, inp, spec, costs):
        assert (costs.averages is None) == (plans == "last")
        want, pending, folded = depth_by_depth(runner, cache, inp, spec, costs)
        tree, plan = real(runner, cache, inp, spec, costs)
        assert plan.tolist() == want and costs.calibration.pending[:, -1].tolist() == pending  # in all
        assert folded is None or costs.averages.tolist() == folded
        checked.append(want)
        return tree, plan

    monkeypatch.setattr(cd, "draft_ahead_tree", compared)
    monkeypatch.setattr(steps, "draft_ahead_tree", compared)
    for noise in (0.0, 0.5):
        run(confident, tiny_tokenizer, 2, SPECS[0], table(confident, depth=0.01, verify_per_node=0.02, noise=noise),
            "ahead")
    assert len(checked) > 20 and len({tuple(p) for p in checked}) > 3


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.shape)
@pytest.mark.parametrize("chain_from_batch", [None, 2])
def test_round_shapes_hold_every_round_the_controller_plans(engine, spec, chain_from_batch, monkeypatch):
    """``Controller.round_shapes`` (what the engine captures as CUDA graphs before a batch's first controlled round)
    holds every (shape, plan, flush) that ``plan`` returns at that batch for any plan a round may write -- each
    depth, each width (clamped to the spec and to an allowed width; probes of width-0 plans), after deferred plain
    rounds or not -- and every sampled round's depth; it leaves the controller's host state as it was. (Deciding
    rounds: held ones are test_controller_holds.py::test_round_shapes_hold_every_held_round.)"""
    from torchspec.runtime.controlled_drafting import PLAIN_ROUND, Controller
    from torchspec.runtime.plan_averages import PLANS_ENV
    from torchspec.runtime.sampling import SamplingParams

    monkeypatch.setenv(PLANS_ENV, "average")

    ctl = Controller(table(engine, depth=0.05, verify_per_node=0.02), spec, Calibration(torch.device("cpu")),
                     chain_from_batch)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8)
    for batch in (1, 3):
        state = (ctl.next_plan, ctl.plain_left, ctl.streak, ctl.deferred, list(ctl.trace), ctl.sampled_depth)
        family = {(s, c.plan, c.flush) for s, c in ctl.round_shapes(greedy, batch, 40)}
        assert state == (ctl.next_plan, ctl.plain_left, ctl.streak, ctl.deferred, ctl.trace, ctl.sampled_depth)
        base = ctl.chain if chain_from_batch is not None and batch >= chain_from_batch else spec
        assert all(s.shape == base.shape for s, _, _ in family)
        assert len(family) <= 2 * spec.depth * (ctl._widths[-1] + 1)  # a few dozen graphs, not one per context
        seen = set()
        for depth in range(1, spec.depth + 3):
            for width in range(0, 3 * spec.num_nodes):
                for deferred in (False, True):
                    ctl.next_plan, ctl.plain_left, ctl.deferred = (depth, width), 0, deferred
                    shape, costs = ctl.plan(greedy, batch, 40 + width)
                    assert costs.plan != PLAIN_ROUND  # plain_left = 0: a width-0 plan probes
                    assert (shape, costs.plan, costs.flush) in family, (depth, width, deferred)
                    seen.add((shape, costs.plan, costs.flush))
        assert seen == family  # and nothing the controller never plans is captured
        sampled_family = {(s, c.flush) for s, c in ctl.round_shapes(sampled, batch, 40)}
        for depth in range(1, spec.depth + 1):
            for deferred in (False, True):
                ctl.sampled_depth, ctl.deferred = depth, deferred
                shape, costs = ctl.plan(sampled, batch, 40)
                assert (shape, costs.flush) in sampled_family
    within = Controller(ctl.table, spec, ctl.calibration, chain_from_batch, mode="within")
    assert within.round_shapes(greedy, 3, 40) == []  # "within" runs without graphs


def test_every_round_and_graph_of_a_shape_folds_the_one_averaged_table(confident, monkeypatch):
    """The averaged plan table is the calibration's, one per drafted shape: every round's costs reach it, at any
    context or plan, and so does a CUDA graph's static copy of those costs (``graphs._clone_tree`` copies tensor
    fields; a table held as a field was copied per graph, each folding only the rounds of its own plan)."""
    from torchspec.runtime.controlled_drafting import Controller
    from torchspec.runtime.graphs import _clone_tree
    from torchspec.runtime.plan_averages import PLANS_ENV

    monkeypatch.setenv(PLANS_ENV, "average")
    ctl = Controller(table(confident, depth=0.05, verify_per_node=0.02), SPECS[0], Calibration(torch.device("cpu")))
    costs = [ctl._lookup(SPECS[0], 2, ctx, sampled=False) for ctx in (16, 100, 150)]
    shared = ctl.calibration.averages_for(*costs[0].averages_key)
    static = _clone_tree(costs[1])
    assert static.depth_ms is not costs[1].depth_ms  # the graph's own copy of the costs ...
    assert all(c.averages is shared for c in costs) and static.averages is shared  # ... folds the one table
    shared.fill_(5)
    assert static.averages.eq(5).all()
    chain = ctl._lookup(ctl.chain, 2, 100, sampled=False)
    assert chain.averages is not shared and chain.averages_key[0] == "chain"  # a table a drafted shape
