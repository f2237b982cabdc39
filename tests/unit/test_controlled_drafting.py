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

from tests.cost_tables import linear_table
from tests.runtime_pair import build_pair
from torchspec.runtime.calibration import ALPHAS, Calibration
from torchspec.runtime.controlled_drafting import MODES
from torchspec.runtime.cost_table import CostTable
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine

SPECS = [SpecConfig(shape="tree", depth=4, topk=3, num_nodes=12), SpecConfig(shape="chain", depth=5)]
NODES = [0, 1, 2, 4, 8, 12]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    return build_pair(tmp_path_factory.mktemp("controlled"), tiny_tokenizer)


@pytest.fixture(scope="module")
def engine(pair):
    return load_engine(*pair, device="cpu", dtype="float32", max_batch=3, max_context=160, page_size=4)


@pytest.fixture(scope="module")
def confident(pair):
    """The same drafter with its head's logits scaled x40: the same argmax (the same accepted drafts), but
    confident -- the tiny pair's own distributions are near-flat (top probability ~0.004), which no
    cost table makes worth a second depth."""
    engine = load_engine(*pair, device="cpu", dtype="float32", max_batch=3, max_context=160, page_size=4)
    engine.runner.model.lm_head.weight.data.mul_(40.0)
    return engine


@pytest.fixture(scope="module")
def confidently_wrong(pair):
    """Confident (head x40) and wrong: eh_proj scrambled, so the drafter no longer reads the token it
    must continue -- what an untrained drafter whose head is the target's looks like."""
    engine = load_engine(*pair, device="cpu", dtype="float32", max_batch=3, max_context=160, page_size=4)
    engine.runner.model.lm_head.weight.data.mul_(40.0)
    w = engine.runner.model.eh_proj.weight
    w.data.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(7)) * 3 / w.shape[1] ** 0.5)
    return engine


def prompts(tokenizer, n: int) -> list[list[int]]:
    texts = ["hello there", "the cat sat on a mat and", "one two three", "repeat: red green blue"]
    return [tokenizer.encode(texts[i % len(texts)], add_special_tokens=False) for i in range(n)]


@pytest.fixture(scope="module")
def plain(engine, tiny_tokenizer):
    return {n: engine.generate(prompts(tiny_tokenizer, n), max_new_tokens=32, ignore_eos=True) for n in (1, 3)}


def table(engine, depth: float, verify_per_node: float, *, noise: float = 0.0, seed: int = 0) -> CostTable:
    return linear_table(engine, depth, verify_per_node, widths=[1, 2, 3], nodes=NODES, noise=noise, seed=seed)


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


def run(engine, tokenizer, n: int, spec: SpecConfig, costs: CostTable, mode: str):
    out = engine.generate(prompts(tokenizer, n), max_new_tokens=32, spec=spec, ignore_eos=True, controller=costs,
                          controller_mode=mode)
    return out, list(engine.controller.trace)


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
    the spec and to an allowed width), the first round drafts depth 0 alone, and depths grow one a round at most."""
    import torchspec.runtime.controlled_drafting as cd

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
    import torchspec.runtime.controlled_drafting as cd
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


def _probe_rounds(n: int) -> list[int]:
    """The rounds of a width-0 plan that probe: the first, then streaks of PROBE_EVERY doubling to PROBE_MOST."""
    from torchspec.runtime.controlled_drafting import PROBE_EVERY, PROBE_MOST

    out, at, streak = [], 0, PROBE_EVERY
    while at < n:
        out.append(at)
        at, streak = at + streak, min(2 * streak, PROBE_MOST)
    return out


def test_probe_streaks_double_while_width_0_and_reset_after_a_verifying_round(engine):
    """An untrained drafter's probes: rounds 0, 8, 24, 56, 120, ... (streaks 8, 16, 32, 64, 64); a plan that
    verifies resets the streak, so the next width-0 plan probes at once and then after 8 rounds again."""
    from torchspec.runtime.controlled_drafting import PLAIN_ROUND, PROBE_EVERY, PROBE_MOST, Controller
    from torchspec.runtime.sampling import SamplingParams

    ctl = Controller(table(engine, depth=0.05, verify_per_node=0.02), SPECS[0], Calibration(torch.device("cpu")))
    greedy = SamplingParams()

    def rounds(n: int, plan: list[int]) -> list[tuple[int, int]]:
        got = []
        for _ in range(n):
            _, costs = ctl.plan(greedy, 2, 100)
            got.append(costs.plan)
            ctl.after(costs, plan if costs.plan != PLAIN_ROUND else None)  # a plain round writes no plan
        return got

    first = rounds(130, [1, 0])
    assert [i for i, p in enumerate(first) if p != PLAIN_ROUND] == _probe_rounds(130) == [0, 8, 24, 56, 120]
    assert PROBE_MOST == 64 and PROBE_EVERY == 8
    rounds(10 - 1, [1, 0])  # 130 .. 138: plain (the streak from 120 runs to 184)
    assert rounds(1, [2, 3]) == [PLAIN_ROUND]  # the plan it asks for waits for the probe ...
    ctl.next_plan = (2, 3)  # ... a verifying plan arrives (as a probe's would)
    assert rounds(1, [1, 0]) == [(2, 3)]
    again = rounds(20, [1, 0])
    assert [i for i, p in enumerate(again) if p != PLAIN_ROUND] == [0, 8]  # short streaks again


def test_a_later_configure_with_the_same_table_continues_the_probe_schedule(engine, plain, tiny_tokenizer):
    """Several generate calls with one table (a bench's runs, a long-lived server): the second controller goes on
    with the first one's plain streak, so the probes of both calls together are one schedule's, not a fresh
    probe and short streaks each call; a new table starts over."""
    from torchspec.runtime.controlled_drafting import PLAIN_ROUND

    costs = table(engine, depth=0.01, verify_per_node=50.0)
    traces = [run(engine, tiny_tokenizer, 1, SPECS[0], costs, "ahead")[1] for _ in range(3)]
    joined = [p for t in traces for p in t]
    assert [i for i, p in enumerate(joined) if p != PLAIN_ROUND] == _probe_rounds(len(joined))
    assert traces[1][0] == PLAIN_ROUND  # mid-streak: no probe to start the call
    fresh = run(engine, tiny_tokenizer, 1, SPECS[0], table(engine, depth=0.01, verify_per_node=50.0), "ahead")[1]
    assert fresh[0] != PLAIN_ROUND and [i for i, p in enumerate(fresh) if p != PLAIN_ROUND] == _probe_rounds(len(fresh))


def test_a_changed_drafter_starts_a_new_calibration_and_probe_schedule(engine, tiny_tokenizer):
    """Weights replaced in the same runner (``drafter_changed``): the same table gets a fresh calibration and
    the controller probes at once with short streaks, as for a new table; without it, both carry on."""
    from torchspec.runtime.controlled_drafting import PLAIN_ROUND

    costs = table(engine, depth=0.01, verify_per_node=50.0)
    run(engine, tiny_tokenizer, 1, SPECS[0], costs, "ahead")
    first = engine.controller.calibration
    assert run(engine, tiny_tokenizer, 1, SPECS[0], costs, "ahead")[1][0] == PLAIN_ROUND  # carried on, mid-streak
    assert engine.controller.calibration is first
    engine.drafter_changed()
    fresh = run(engine, tiny_tokenizer, 1, SPECS[0], costs, "ahead")[1]
    assert engine.controller.calibration is not first
    assert [i for i, p in enumerate(fresh) if p != PLAIN_ROUND] == _probe_rounds(len(fresh))


def test_every_round_pays_the_tables_host_time(engine):
    """A table's host time a round (``overhead_ms``) is added to every verify cost, plain step included; depth 0
    stays the whole width-0 round less the timed plain step."""
    from torchspec.runtime.round_costs import RoundCosts

    bare = table(engine, depth=0.05, verify_per_node=0.02)
    timed = dataclasses.replace(bare, overhead=torch.tensor([0.3, 0.4, 0.5], dtype=torch.float64))
    calibration = Calibration(torch.device("cpu"))
    a = RoundCosts.lookup(bare, SPECS[0], 2, 100, calibration)
    b = RoundCosts.lookup(timed, SPECS[0], 2, 100, calibration)  # batch 2 -> the table's 4: 0.4 ms
    torch.testing.assert_close(b.verify_ms, a.verify_ms + 0.4)
    torch.testing.assert_close(b.depth_ms, a.depth_ms)
    sampled = SpecConfig(shape="tree", depth=3)
    torch.testing.assert_close(RoundCosts.lookup_sampled(timed, sampled, 2, 100, calibration).verify_ms,
                               RoundCosts.lookup_sampled(bare, sampled, 2, 100, calibration).verify_ms + 0.4)


@pytest.mark.parametrize("plans", ["average", "last"])
def test_a_probe_drafts_the_best_verifying_shape_the_averages_rate(engine, monkeypatch, plans):
    """Averaged plans: a plain plan's probe drafts the table's best verifying entry (the round's plan [4]: next
    depth, width, the probe's depth and width), so a drafter that pays only in deep rounds shows it and leaves
    its plain streak; a probe of depth 0 alone could not (the lock-in measured in the twenty-fifth session).
    Plans from the last round alone keep the depth-0 probe of PROBE_WIDTH nodes."""
    from torchspec.runtime.controlled_drafting import PLAIN_ROUND, PROBE_WIDTH, Controller
    from torchspec.runtime.plan_averages import PLANS_ENV
    from torchspec.runtime.sampling import SamplingParams

    monkeypatch.setenv(PLANS_ENV, plans)
    ctl = Controller(table(engine, depth=0.05, verify_per_node=0.02), SPECS[0], Calibration(torch.device("cpu")))
    greedy = SamplingParams()
    _, costs = ctl.plan(greedy, 2, 100)  # the first round: a probe
    assert costs.plan == (1, PROBE_WIDTH) and (costs.averages is not None) == (plans == "average")
    ctl.after(costs, [1, 0, 3, 12])  # plain next; were it to probe: depth 3, 12 nodes
    ctl.plain_left = 0  # the streak's end
    _, probe = ctl.plan(greedy, 2, 100)
    assert probe.plan == ((3, 12) if plans == "average" else (1, PROBE_WIDTH))
    ctl.after(probe, [1, 0, 4, 100])  # a probe beyond the spec's shape: its depth and widest allowed width
    assert ctl.plan(greedy, 2, 100)[1].plan == PLAIN_ROUND
    ctl.plain_left = 0
    assert ctl.plan(greedy, 2, 100)[1].plan == ((4, 12) if plans == "average" else (1, PROBE_WIDTH))


def test_round_costs_are_looked_up_once_per_batch_and_context_step(engine):
    """A table lookup is ~0.4 ms of host time, more than a third of a SmolLM2 step on an H200: the controller keeps
    each (shape, batch, 64 tokens of context) lookup's device tensors and every round reuses them."""
    from torchspec.runtime.controlled_drafting import CTX_STEP, PLAIN_ROUND, Controller
    from torchspec.runtime.round_costs import RoundCosts
    from torchspec.runtime.sampling import SamplingParams

    costs = table(engine, depth=0.05, verify_per_node=0.02, noise=0.5)
    ctl = Controller(costs, SPECS[0], Calibration(torch.device("cpu")))
    greedy = SamplingParams()
    ctl.next_plan = (1, 2)  # verifying rounds (a plain round looks nothing up)
    _, a = ctl.plan(greedy, 2, 3 * CTX_STEP + 1)
    _, b = ctl.plan(greedy, 2, 4 * CTX_STEP - 1)
    _, c = ctl.plan(greedy, 2, 4 * CTX_STEP)
    assert a is not b and a.depth_ms is b.depth_ms and a.verify_ms is b.verify_ms  # one lookup, fresh RoundCosts
    assert c.depth_ms is not a.depth_ms
    want = RoundCosts.lookup(costs, SPECS[0], 2, 3 * CTX_STEP, ctl.calibration, measured_only=True)
    assert torch.equal(a.depth_ms, want.depth_ms) and torch.equal(a.verify_ms, want.verify_ms)
    assert ctl.trace == [(1, 2)] * 3 and a.trace is ctl.trace
    ctl.next_plan = (1, 0)  # width 0: a probe looks up, then a plain round does not
    _, probe = ctl.plan(greedy, 2, 3 * CTX_STEP)
    _, plain = ctl.plan(greedy, 2, 3 * CTX_STEP)
    assert probe.depth_ms is a.depth_ms and plain.plan == PLAIN_ROUND and plain.depth_ms.numel() == 0
    assert ctl.trace[-2:] == [(1, 1), PLAIN_ROUND]


def test_width_0_streaks_run_plain_rounds_and_catch_the_drafter_up_at_the_probe(engine, plain, tiny_tokenizer):
    """Ahead mode: while the plan is width 0, rounds draft nothing (``plain_step_deferring_drafter``) except a probe
    (depth 0, decided again) first and every PROBE_EVERY-th; the text is plain decoding's. Three plain rounds and
    the catch-up on their deferred entries leave the drafter's caches and state as three full rounds verifying
    nothing do (each catching the drafter up at once), and the target's caches alike."""
    from torchspec.runtime.controlled_drafting import PLAIN_ROUND

    dear = table(engine, depth=0.01, verify_per_node=50.0)
    out, trace = run(engine, tiny_tokenizer, 1, SPECS[0], dear, "ahead")
    assert [r.token_ids for r in out] == [r.token_ids for r in plain[1]]
    probes = [i for i, plan in enumerate(trace) if plan != PLAIN_ROUND]
    assert probes == [p for p in _probe_rounds(len(trace))] and all(trace[i] == (1, 1) for i in probes)

    from torchspec.runtime.cost_profile import _Rows
    from torchspec.runtime.drafting import DraftInputs
    from torchspec.runtime.paged_kv import TRASH_PAGE
    from torchspec.runtime.pending_drafter import catch_up_pending
    from torchspec.runtime.round_costs import RoundCosts
    from torchspec.runtime.sampling import SamplingParams
    from torchspec.runtime.steps import plain_step_deferring_drafter, speculate

    pages = [engine.allocator.alloc(engine.pages_per_row) for _ in range(2)]
    slots = torch.tensor([0, 1])
    try:
        for i, row in enumerate(pages):
            engine.block_table[i] = torch.tensor(row)
        torch.manual_seed(3)
        rows = _Rows(engine, 2, 20, 2)
        engine.normed[:2].normal_(), engine.feedback[:2].normal_()
        caches = [engine.caches.target.k, engine.caches.target.v, engine.caches.drafter.k, engine.caches.drafter.v]
        before = [t.clone() for t in caches] + [engine.normed[:2].clone(), engine.feedback[:2].clone()]
        ones = torch.ones(1)
        costs = RoundCosts(ones, ones.expand(2).contiguous(), Calibration(torch.device("cpu")), plan=(1, 0))
        spec = SpecConfig(shape="tree", depth=1, topk=3, num_nodes=1)

        def inputs(root, ctx, normed, feedback):
            return DraftInputs(root=root, normed=normed, feedback=feedback, ctx_len=ctx, block_table=rows.block_table,
                               row_valid=rows.valid)

        root, ctx, tokens = rows.tokens[:, 0], rows.ctx_len.clone(), []
        engine.caches.pending.reset(slots)
        for _ in range(3):  # plain rounds: the drafter's entries wait
            step = plain_step_deferring_drafter(engine.decoder, engine.runner, engine.caches, rows.block_table, ctx,
                                                root, rows.valid, slots)
            assert step.normed is None
            tokens.append(step.tokens)
            root, ctx = step.root, ctx + 1
        assert engine.caches.pending.count[:2].tolist() == [3, 3]
        caught = catch_up_pending(engine.runner, engine.caches, inputs(root, ctx, before[4], before[5]), slots)
        assert engine.caches.pending.count[:2].tolist() == [0, 0]
        deferred = [t.clone() for t in caches] + [caught.normed, caught.feedback]

        for t, b in zip(caches, before):
            t.copy_(b)
        root, ctx, normed, feedback = rows.tokens[:, 0], rows.ctx_len.clone(), before[4], before[5]
        for i in range(3):  # full rounds verifying nothing: the drafter caught up every round
            full = speculate(engine.decoder, engine.runner, engine.caches, inputs(root, ctx, normed, feedback), spec,
                             SamplingParams(), None, costs=costs)
            assert torch.equal(full.tokens, tokens[i])
            root, ctx, normed, feedback = full.root, ctx + 1, full.normed, full.feedback
        # the catch-up's padding wrote positions >= ctx (uncommitted, rewritten before any read): not compared
        from torchspec.runtime.paged_kv import slots_for_positions

        beyond = slots_for_positions(rows.block_table, ctx[:, None] + torch.arange(engine.caches.pending.capacity),
                                     engine.page_size).flatten()
        for got, want in zip(deferred, [*caches, normed, feedback]):
            if got.dim() == 4:
                got, want = got.clone(), want.clone()
                got[:, beyond], want[:, beyond] = 0, 0
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        engine.block_table[:2] = TRASH_PAGE
        for row in pages:
            engine.allocator.free(row)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.shape)
@pytest.mark.parametrize("chain_from_batch", [None, 2])
def test_round_shapes_hold_every_round_the_controller_plans(engine, spec, chain_from_batch):
    """``Controller.round_shapes`` (what the engine captures as CUDA graphs before a batch's first controlled round)
    holds every (shape, plan, flush) that ``plan`` returns at that batch for any plan a round may write -- each
    depth, each width (clamped to the spec and to an allowed width; probes of width-0 plans), after deferred plain
    rounds or not -- and every sampled round's depth; it leaves the controller's host state as it was."""
    from torchspec.runtime.controlled_drafting import PLAIN_ROUND, Controller
    from torchspec.runtime.sampling import SamplingParams

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
