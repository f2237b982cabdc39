"""Held plans (``TORCHSPEC_CONTROLLER_PLANS=held``, ``held_plans.py``): a verifying plan that a deciding round plans
again runs as its fixed shape, undecided, until the HOLD_ROUNDS-th round after it decides again, or until its
rounds' committed tokens stop paying for it. Checked on the controller's schedule (what holds, for how long, what
never holds, what ends a hold), on the break-even it is held to, on the graphs captured before a batch's first
round (every held shape among them), and on served text (plain decoding's, greedy)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torchspec.runtime.controlled_drafting as controlled_drafting
from tests.controller_cases import NODES, SPECS, cpu_engine
from tests.cost_tables import linear_table
from torchspec.runtime.calibration import Calibration
from torchspec.runtime.controlled_drafting import PLAIN_ROUND, Controller
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.held_plans import HOLD_MOST, HOLD_ROUNDS, RELEASE_Z, Hold
from torchspec.runtime.plan_averages import PLANS_ENV
from torchspec.runtime.round_costs import break_even_tokens
from torchspec.runtime.sampling import SamplingParams

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def confident(controller_pair):
    """The tiny pair's drafter with its head's logits x40: the same drafts, confident enough to be verified."""
    return cpu_engine(controller_pair, confident=True)


def controller(engine, spec: SpecConfig, monkeypatch, plans: str = "held") -> Controller:
    monkeypatch.setenv(PLANS_ENV, plans)
    costs = linear_table(engine, 0.05, 0.02, widths=[1, 2, 3], nodes=NODES)
    return Controller(costs, spec, Calibration(torch.device("cpu")))


PAYS = 20  # tokens two rows commit in a round: 10 a row-round, beyond any plan's break-even in these tables


def rounds(ctl: Controller, plans: list[tuple[int, int]], tokens: list[int] | None = None,
           rows: int = 2) -> list[tuple]:
    """Each round's (held?, depth, width, shape); a deciding round's plan for the next is the next of ``plans``;
    round i commits ``tokens[i]`` over ``rows`` rows (default: ``PAYS`` every round)."""
    got = []
    for i, nxt in enumerate(plans):
        shape, costs = ctl.plan(GREEDY, rows, 100)
        held = costs is None
        depth, width = ctl.held if held else costs.plan
        got.append((held, depth, width, shape))
        ctl.after(costs, None if held else [*nxt, 1, 1], PAYS if tokens is None else tokens[i], rows)  # held: no plan
    return got


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.shape)
def test_a_repeated_plan_is_held_until_the_next_deciding_round(confident, spec, monkeypatch):
    ctl = controller(confident, spec, monkeypatch)
    ctl.next_plan = (3, 3)
    got = rounds(ctl, [(3, 3)] * (3 * HOLD_ROUNDS + 1))  # confirmed after a full hold: the next is twice as long
    assert [held for held, *_ in got] == ([False] + [True] * (HOLD_ROUNDS - 1)
                                          + [False] + [True] * (2 * HOLD_ROUNDS - 1) + [False])
    assert all((d, w) == (3, 3) for _, d, w, _ in got) and ctl.trace == [(3, 3)] * len(got)
    held_shapes = {shape for held, *_, shape in got if held}
    assert held_shapes == {SpecConfig(shape="chain", depth=3, num_nodes=3) if spec.shape == "chain" else
                           SpecConfig(shape="tree", depth=3, topk=3, num_nodes=3)}  # a chain drafts its width alone
    assert HOLD_ROUNDS == 8
    ctl.next_plan = (4, 2)
    ctl.hold.stop()  # a plan narrower than deep: a held chain drafts its width alone
    got = rounds(ctl, [(4, 2)] * 2)
    assert got[1][:3] == ((True, 2, 2) if spec.shape == "chain" else (True, 4, 2)) and got[0][:3] == (False, 4, 2)


def test_a_changed_plan_width_0_or_deferred_drafting_holds_nothing(confident, monkeypatch):
    ctl = controller(confident, SPECS[0], monkeypatch)
    ctl.next_plan = (2, 2)
    got = rounds(ctl, [(3, 4), (2, 2), (3, 4), (2, 2)])  # every round plans another shape than it ran
    assert not any(held for held, *_ in got)
    ctl.next_plan = (2, 2)
    ctl.hold.stop()
    assert not any(held for held, *_ in rounds(ctl, [(1, 0)] * 3))  # width 0: plain rounds and probes
    ctl.next_plan, ctl.hold.left, ctl.deferred = (2, 2), 3, True  # a plain round's drafter entry is pending
    shape, costs = ctl.plan(GREEDY, 2, 100)
    assert costs is not None and costs.flush  # the round decides and catches the drafter up first
    positive = controller(confident, SPECS[0], monkeypatch)  # positive control: the same plan twice holds
    positive.next_plan = (2, 2)
    assert [held for held, *_ in rounds(positive, [(2, 2)] * 2)] == [False, True]


@pytest.mark.parametrize("plans", ["average", "last"])
def test_other_plans_never_hold(confident, monkeypatch, plans):
    ctl = controller(confident, SPECS[1], monkeypatch, plans)
    ctl.next_plan = (3, 3)
    assert not any(held for held, *_ in rounds(ctl, [(3, 3)] * 10))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.shape)
def test_a_hold_ends_once_its_rounds_stop_paying(confident, spec, monkeypatch):
    """A hold starts on a deciding round that reached the plan's break-even and runs while its rounds' tokens a
    row-round stay within a standard error of it (``held_plans.pays``): at 64 rows a round, rounds at a token a row
    (a plain step's yield at a speculating round's cost) end it within three rounds and the next round decides, and
    a deciding round at a token a row starts no hold; at 2 rows a round the same means are within their noise for
    six rounds (the break-even as is ended the hold after two)."""
    ctl = controller(confident, spec, monkeypatch)
    need = break_even_tokens(ctl.table, ctl._held_shape(ctl._base(64), 3, 3), 3, 64, 64)
    assert 1.2 < need < 1.22  # 1.21: depth 0 and 2 more at 0.05 ms, 3 nodes at 0.02 over a 1 ms plain step
    ctl.next_plan = (3, 3)  # (3, 3) commits at most 4 a row-round; 96/64, then 160/128, 224/192 pay, 288/256 does not
    got = rounds(ctl, [(3, 3)] * 6, tokens=[96, 64, 64, 64, 128, 128], rows=64)
    assert [held for held, *_ in got] == [False, True, True, True, False, True]  # round 3 falls short: 4 decides
    ctl = controller(confident, spec, monkeypatch)
    ctl.next_plan = (3, 3)  # a token a row-round on the deciding round: below the break-even, no hold
    assert [held for held, *_ in rounds(ctl, [(3, 3)] * 3, tokens=[64] * 3, rows=64)] == [False] * 3
    ctl = controller(confident, spec, monkeypatch)
    ctl.next_plan = (3, 3)  # positive control: 80/64 = 1.25 a row-round and on, held
    assert [held for held, *_ in rounds(ctl, [(3, 3)] * 3, tokens=[80] * 3, rows=64)] == [False, True, True]
    ctl = controller(confident, spec, monkeypatch)
    ctl.next_plan = (3, 3)  # the same means over 2 rows a round (3/2, then 5/4, 7/6, ... 15/14 falls short)
    got = rounds(ctl, [(3, 3)] * (HOLD_ROUNDS + 1), tokens=[3] + [2] * HOLD_ROUNDS, rows=2)
    assert [held for held, *_ in got] == [False] + [True] * 6 + [False, False]


def test_a_hold_counts_every_round_since_it_started():
    """The break-even is judged on all the hold's row-rounds together, so a short round after good ones goes on
    while the total is within a standard error of paying (``sqrt((m - 1) * (most - m) / rows)``, ``m`` the tokens a
    row-round with one more at the break-even); a hold starts only on a round that paid."""
    assert RELEASE_Z == 1.0
    hold = Hold()
    hold.start(need=2.0, tokens=12, rows=4, most=4)  # 3 a row-round
    assert hold.take() and hold.left == HOLD_ROUNDS - 2
    hold.observe(tokens=4, rows=4)  # 16 over 8: 2 a row-round
    assert hold.take()
    hold.observe(tokens=3, rows=4)  # 19 over 12 = 1.583: m = 21 / 13, 2 - sqrt(0.615 * 2.385 / 12) = 1.65
    assert not hold.take() and hold.left == 0
    hold.start(need=2.0, tokens=7, rows=4, most=4)  # a new hold starts afresh: 1.75 a row-round did not pay
    assert not hold.take()
    hold.start(need=2.0, tokens=8, rows=4, most=4)  # 2 a row-round: held
    hold.observe(tokens=5, rows=4)  # 13 over 8 = 1.625: short of 2, within the noise (2 - 0.441 = 1.559)
    assert [hold.take() for _ in range(HOLD_ROUNDS)] == [True] * (HOLD_ROUNDS - 1) + [False]


def test_one_row_round_that_accepts_nothing_does_not_end_a_hold():
    """At c = 1 a row-round is one draw: a hold of a plan that needs 1.6 tokens (at most 3), started on a round of
    2, goes on through three rounds that accepted nothing (3/2, 4/3, 5/4 are within the noise) and ends on the
    fourth (6/5 < 1.6 - sqrt(0.267 * 1.733 / 5) = 1.296). A deciding round that accepted nothing starts none, and a
    break-even beyond what a row-round can commit never holds."""
    hold = Hold()
    hold.start(need=1.6, tokens=2, rows=1, most=3)
    assert hold.take()
    for _ in range(3):
        hold.observe(tokens=1, rows=1)
        assert hold.take()
    hold.observe(tokens=1, rows=1)
    assert not hold.take()
    hold.start(need=1.6, tokens=1, rows=1, most=3)
    assert not hold.take()
    hold.start(need=3.5, tokens=30, rows=10, most=3)  # 3 a row-round, the most: never the 3.5 it needs
    assert not hold.take()
    hold.start(need=1.0, tokens=1, rows=1, most=2)  # a break-even of one token: a token pays, and no spread
    hold.observe(tokens=1, rows=1)
    assert hold.take()


def test_a_plan_confirmed_after_a_full_hold_goes_on_from_its_evidence_for_twice_as_long():
    """A deciding round that plans again the plan of a hold that ran all its rounds while paying holds it again on
    that hold's own rounds and its own (within the noise, not a paying round of its own), twice as long each time up
    to HOLD_MOST - 1; a hold released on evidence, another plan, or no plan starts afresh (a round that paid, 7)."""
    assert (HOLD_ROUNDS, HOLD_MOST) == (8, 32)
    hold, plan = Hold(), (2, 16)

    def run_full(length: int, tokens: int = 2) -> None:
        assert hold.left == length
        for _ in range(length):
            assert hold.take()
            hold.observe(tokens=tokens, rows=1)
        assert not hold.take() and hold.full

    hold.start(need=1.6, tokens=2, rows=1, most=3, plan=plan)
    run_full(7)
    hold.start(need=1.6, tokens=1, rows=1, most=3, plan=plan)  # one token: carried, 17 over 9 row-rounds pays
    assert (hold.tokens, hold.rows, hold.own_tokens, hold.own_rows) == (17, 9, 1, 1)
    run_full(15)
    hold.start(need=1.6, tokens=2, rows=1, most=3, plan=plan)  # carries the last hold's own rounds only: 31 + 2
    assert (hold.tokens, hold.rows) == (33, 17)
    run_full(31)
    hold.start(need=1.6, tokens=2, rows=1, most=3, plan=plan)
    run_full(HOLD_MOST - 1)  # no longer than HOLD_MOST - 1
    hold.start(need=1.6, tokens=1, rows=1, most=3, plan=(3, 16))  # another plan: afresh, and one token did not pay
    assert hold.left == 0 and not hold.full
    hold.start(need=1.6, tokens=2, rows=1, most=3, plan=plan)  # afresh: 7 rounds
    assert hold.left == HOLD_ROUNDS - 1
    for _ in range(4):  # rounds that accept nothing end it on evidence (test_one_row_round_that_accepts_nothing)
        hold.take()
        hold.observe(tokens=1, rows=1)
    assert not hold.take() and not hold.full
    hold.start(need=1.6, tokens=1, rows=1, most=3, plan=plan)  # released: nothing carried, one token does not pay
    assert hold.left == 0
    hold.start(need=1.6, tokens=2, rows=1, most=3)
    run_full(7)
    hold.start(need=1.6, tokens=1, rows=1, most=3)  # no plan named: never carried
    assert hold.left == 0
    hold.start(need=1.6, tokens=2, rows=1, most=3, plan=plan)
    run_full(7)
    hold.start(need=1.6, tokens=1, rows=1, most=3, plan=plan)
    hold.stop()  # a probe or a changed plan stops it: the next start is afresh
    hold.start(need=1.6, tokens=1, rows=1, most=3, plan=plan)
    assert hold.left == 0


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.shape)
def test_break_even_is_the_held_rounds_cost_over_a_plain_steps(confident, spec):
    """``break_even_tokens`` from the table: depth 0 (the width-0 round less its plain step), each later depth at
    the drafter's width, the verify forward of the width and the host's time a round, over a plain step's time."""
    costs = linear_table(confident, 0.05, 0.02, widths=[1, 2, 3], nodes=NODES)
    costs = dataclasses.replace(costs, overhead=torch.tensor([0.25, 0.25, 0.25], dtype=torch.float64))
    shape = dataclasses.replace(spec, depth=3, num_nodes=4) if spec.shape == "tree" else \
        dataclasses.replace(spec, depth=4, num_nodes=4)
    depths = shape.depth  # a tree of depth 3 verifying 4 nodes, or a chain of 4
    expected = (0.05 + (depths - 1) * 0.05 + 1 + 0.02 * 4 + 0.25) / (1 + 0.25)
    assert break_even_tokens(costs, shape, 4, 4, 100) == pytest.approx(expected, rel=1e-6)  # fp32 lookups


def test_served_holds_follow_what_the_rounds_commit(confident, tiny_tokenizer, monkeypatch):
    """The engine hands every round's committed tokens to the controller: held at a break-even of 0, never held
    when no round could pay (a break-even of 1e9), and plain decoding's text either way."""
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "the cat sat on", "one two")]
    plain = [r.token_ids for r in confident.generate(ps, max_new_tokens=40, ignore_eos=True)]
    monkeypatch.setenv(PLANS_ENV, "held")
    held_rounds = {}
    for need in (0.0, 1e9):  # a table each: a controller continuing on the same table keeps its break-evens
        costs = linear_table(confident, 1e-4, 1e-4, widths=[1, 2, 3], nodes=NODES)
        monkeypatch.setattr(controlled_drafting, "break_even_tokens", lambda *a, need=need: need)
        confident.round_kinds.clear()
        out = confident.generate(ps, max_new_tokens=40, spec=SPECS[0], ignore_eos=True, controller=costs)
        assert [r.token_ids for r in out] == plain
        held_rounds[need] = sum(n for kind, (n, _) in confident.round_kinds.items() if kind.startswith("held"))
    assert held_rounds[0.0] > 0 and held_rounds[1e9] == 0, held_rounds


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.shape)
def test_round_shapes_hold_every_held_round(confident, spec, monkeypatch):
    """What the engine captures before a batch's first controlled round includes each plan's held shape (no
    costs), so a hold never captures a graph inside a timed run or a request."""
    ctl = controller(confident, spec, monkeypatch)
    family = {(s, None if c is None else (c.plan, c.flush)) for s, c in ctl.round_shapes(GREEDY, 2, 100)}
    held_family = {s for s, c in family if c is None}
    assert held_family
    seen = set()
    for depth in range(1, spec.depth + 1):
        for width in range(1, 3 * spec.num_nodes):
            ctl.next_plan, ctl.hold.left, ctl.deferred, ctl.plain_left = (depth, width), 1, False, 0
            shape, costs = ctl.plan(GREEDY, 2, 100)
            assert costs is None and (shape, None) in family, (depth, width)
            seen.add(shape)
    assert seen == held_family


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.shape)
def test_held_plans_keep_greedy_output(confident, tiny_tokenizer, spec, monkeypatch):
    """Served with held plans and cheap drafting (plans settle and hold): the text is plain decoding's, and held
    rounds ran (the engine's round kinds count them apart)."""
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "the cat sat on", "one two")]
    plain = confident.generate(ps, max_new_tokens=40, ignore_eos=True)
    costs = linear_table(confident, 1e-4, 1e-4, widths=[1, 2, 3], nodes=NODES)
    monkeypatch.setenv(PLANS_ENV, "held")
    confident.round_kinds.clear()
    out = confident.generate(ps, max_new_tokens=40, spec=spec, ignore_eos=True, controller=costs)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    held = sum(n for kind, (n, _) in confident.round_kinds.items() if kind.startswith("held"))
    decided = sum(n for kind, (n, _) in confident.round_kinds.items() if kind.startswith("d"))
    assert held > 0 and decided > 0, confident.round_kinds
    assert max(max(r.accept_lengths) for r in out) > 1 and PLAIN_ROUND not in confident.controller.trace[-3:]
