"""The draft controller's probes and plain streaks (torchspec/runtime/controlled_drafting.py), CPU, fp32: while
the plan is width 0 the rounds run plain, a probe drafts every PROBE_EVERY rounds with streaks doubling to
PROBE_MOST, a verifying plan resets them; the probe drafts what the averaged tables rate best; a later configure
carries the schedule on and a new drafter starts it afresh; every round pays the table's host time; the round
costs are looked up once a batch and context step. Greedy output stays plain decoding's throughout.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.controller_cases import SPECS, cpu_engine, prompts, run, table
from torchspec.runtime.calibration import Calibration
from torchspec.runtime.drafting import SpecConfig


@pytest.fixture(scope="module")
def engine(controller_pair):
    return cpu_engine(controller_pair)


@pytest.fixture(scope="module")
def plain(engine, tiny_tokenizer):
    return {1: engine.generate(prompts(tiny_tokenizer, 1), max_new_tokens=32, ignore_eos=True)}


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
            ctl.after(costs, plan if costs.plan != PLAIN_ROUND else None, 2, 2)  # a plain round writes no plan
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
    b = RoundCosts.lookup(timed, SPECS[0], 2, 100, calibration)  # batch 2: 1/3 of the way from 1 (0.3) to 4 (0.4)
    host = 0.3 + 0.1 / 3
    torch.testing.assert_close(b.verify_ms, a.verify_ms + host)
    torch.testing.assert_close(b.depth_ms, a.depth_ms)
    sampled = SpecConfig(shape="tree", depth=3)
    torch.testing.assert_close(RoundCosts.lookup_sampled(timed, sampled, 2, 100, calibration).verify_ms,
                               RoundCosts.lookup_sampled(bare, sampled, 2, 100, calibration).verify_ms + host)


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
    ctl.after(costs, [1, 0, 3, 12], 2, 2)  # plain next; were it to probe: depth 3, 12 nodes
    ctl.plain_left = 0  # the streak's end
    _, probe = ctl.plan(greedy, 2, 100)
    assert probe.plan == ((3, 12) if plans == "average" else (1, PROBE_WIDTH))
    ctl.after(probe, [1, 0, 4, 100], 2, 2)  # a probe beyond the spec's shape: its depth and widest allowed width
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


@pytest.mark.parametrize("plans", ["held", "average", "last"])
def test_a_probe_that_paid_drafts_again_whatever_its_estimates_said(engine, plans, monkeypatch):
    """A probe that committed its shape's break-even (tokens a row-round against a plain step's cost) plans its own
    shape next, undecided by the estimates and unheld, so the next round decides on fresh ratings; one that did not
    pay keeps the width-0 plan, and a deciding round that is not a probe keeps whatever it planned. On this CPU a
    second run of the trained SmolLM2 drafter over the same 8 MT-Bench prompts otherwise spent 53 of one prompt's
    61 rounds plain behind probes that each accepted their token (thirty-fourth session)."""
    from torchspec.runtime.controlled_drafting import PLAIN_ROUND, Controller
    from torchspec.runtime.plan_averages import PLANS_ENV
    from torchspec.runtime.sampling import SamplingParams

    monkeypatch.setenv(PLANS_ENV, plans)
    ctl = Controller(table(engine, depth=0.05, verify_per_node=0.02), SPECS[0], Calibration(torch.device("cpu")))
    greedy = SamplingParams()
    ctl.next_plan = (1, 0)  # width 0: the next round is a probe
    _, probe = ctl.plan(greedy, 2, 100)
    assert ctl.probing and probe.plan[1] >= 1
    need = ctl._hold_need(*probe.plan)
    assert 1 < need < 2
    ctl.after(probe, [1, 0, *probe.plan], tokens=int(need * 2) + 1, rows=2)  # paid: its own shape next
    assert ctl.next_plan == tuple(probe.plan) and ctl.hold.left == 0
    _, again = ctl.plan(greedy, 2, 100)
    assert again is not None and again.plan == tuple(probe.plan) and not ctl.probing and ctl.held is None
    ctl.after(again, [1, 0, *probe.plan], tokens=6, rows=2)  # not a probe: its width-0 plan stands
    assert ctl.next_plan[1] == 0
    ctl.plain_left = 0
    _, probe = ctl.plan(greedy, 2, 100)
    ctl.after(probe, [1, 0, *probe.plan], tokens=2, rows=2)  # a probe that did not pay: plain again
    assert ctl.next_plan[1] == 0 and ctl.plan(greedy, 2, 100)[1].plan == PLAIN_ROUND


def test_rounds_past_the_tables_contexts_share_one_lookup_and_a_continued_controller_keeps_them(engine):
    """A table measured at one context (the trained SmolLM2 drafter's, thirty-third session: 288 tokens) prices
    every context alike: rounds past its last context (or before its first) share the lookup and the hold's
    break-even, where a lookup per 64 tokens of context put ~0.4 ms of host time into a deciding round every few
    rounds. A controller that continues the last one (the engine's next ``configure``) keeps both; a different
    calibration does not (its RoundCosts hold the calibration)."""
    from torchspec.runtime.controlled_drafting import CTX_STEP, Controller
    from torchspec.runtime.sampling import SamplingParams

    costs = table(engine, depth=0.05, verify_per_node=0.02, noise=0.5)  # contexts 16 and 256
    cal = Calibration(torch.device("cpu"))
    ctl = Controller(costs, SPECS[0], cal)
    greedy = SamplingParams()
    ctl.next_plan = (1, 2)
    rounds = [ctl.plan(greedy, 2, ctx)[1] for ctx in (256, 300, 1000, 5 * CTX_STEP + 7)]
    assert all(r.depth_ms is rounds[0].depth_ms for r in rounds) and len(ctl._costs) == 1
    low = [ctl.plan(greedy, 2, ctx)[1] for ctx in (0, 15, CTX_STEP - 1)]  # below 64: priced at the first context
    assert low[0].depth_ms is low[2].depth_ms and low[0].depth_ms is not rounds[0].depth_ms
    needs = {ctl._priced_at(ctx) for ctx in (256, 300, 1000)}
    assert needs == {256}
    for ctx in (256, 1000, 4000):
        ctl._at = (2, ctx)
        ctl._hold_need(1, 2)
    assert len(ctl._break_even) == 1

    nxt = Controller(costs, SPECS[0], cal)
    nxt.continue_from(ctl)
    nxt.next_plan = (1, 2)
    assert nxt.plan(greedy, 2, 700)[1].depth_ms is rounds[0].depth_ms and nxt._break_even is ctl._break_even
    other = Controller(costs, SPECS[0], Calibration(torch.device("cpu")))
    other.continue_from(ctl)
    assert other._costs == {} and other._break_even == {}


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

