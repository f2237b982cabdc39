"""Held plans (``TORCHSPEC_CONTROLLER_PLANS=held``, ``controlled_drafting.HOLD_ROUNDS``): a verifying plan that a
deciding round plans again runs as its fixed shape, undecided, until the HOLD_ROUNDS-th round after it decides
again. Checked on the controller's schedule (what holds, for how long, what never holds), on the graphs captured
before a batch's first round (every held shape among them), and on served text (plain decoding's, greedy)."""

from __future__ import annotations

import pytest
import torch

from tests.controller_cases import NODES, SPECS, cpu_engine
from tests.cost_tables import linear_table
from tests.runtime_pair import build_pair
from torchspec.runtime.calibration import Calibration
from torchspec.runtime.controlled_drafting import HOLD_ROUNDS, PLAIN_ROUND, Controller
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.plan_averages import PLANS_ENV
from torchspec.runtime.sampling import SamplingParams

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    return build_pair(tmp_path_factory.mktemp("holds"), tiny_tokenizer)


@pytest.fixture(scope="module")
def confident(pair):
    """The tiny pair's drafter with its head's logits x40: the same drafts, confident enough to be verified."""
    return cpu_engine(pair, confident=True)


def controller(engine, spec: SpecConfig, monkeypatch, plans: str = "held") -> Controller:
    monkeypatch.setenv(PLANS_ENV, plans)
    costs = linear_table(engine, 0.05, 0.02, widths=[1, 2, 3], nodes=NODES)
    return Controller(costs, spec, Calibration(torch.device("cpu")))


def rounds(ctl: Controller, plans: list[tuple[int, int]]) -> list[tuple]:
    """Each round's (held?, depth, width, shape); a deciding round's plan for the next is the next of ``plans``."""
    got = []
    for nxt in plans:
        shape, costs = ctl.plan(GREEDY, 2, 100)
        held = costs is None
        depth, width = ctl.held if held else costs.plan
        got.append((held, depth, width, shape))
        ctl.after(costs, None if held else [*nxt, 1, 1])  # a held round writes no plan
    return got


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.shape)
def test_a_repeated_plan_is_held_until_the_next_deciding_round(confident, spec, monkeypatch):
    ctl = controller(confident, spec, monkeypatch)
    ctl.next_plan = (3, 3)
    got = rounds(ctl, [(3, 3)] * (2 * HOLD_ROUNDS + 1))
    assert [held for held, *_ in got] == ([False] + [True] * (HOLD_ROUNDS - 1)) * 2 + [False]
    assert all((d, w) == (3, 3) for _, d, w, _ in got) and ctl.trace == [(3, 3)] * len(got)
    held_shapes = {shape for held, *_, shape in got if held}
    assert held_shapes == {SpecConfig(shape="chain", depth=3, num_nodes=3) if spec.shape == "chain" else
                           SpecConfig(shape="tree", depth=3, topk=3, num_nodes=3)}  # a chain drafts its width alone
    assert HOLD_ROUNDS == 8
    ctl.next_plan, ctl.hold_left = (4, 2), 0  # a plan narrower than deep: a held chain drafts its width alone
    got = rounds(ctl, [(4, 2)] * 2)
    assert got[1][:3] == ((True, 2, 2) if spec.shape == "chain" else (True, 4, 2)) and got[0][:3] == (False, 4, 2)


def test_a_changed_plan_width_0_or_deferred_drafting_holds_nothing(confident, monkeypatch):
    ctl = controller(confident, SPECS[0], monkeypatch)
    ctl.next_plan = (2, 2)
    got = rounds(ctl, [(3, 4), (2, 2), (3, 4), (2, 2)])  # every round plans another shape than it ran
    assert not any(held for held, *_ in got)
    ctl.next_plan, ctl.hold_left = (2, 2), 0
    assert not any(held for held, *_ in rounds(ctl, [(1, 0)] * 3))  # width 0: plain rounds and probes
    ctl.next_plan, ctl.hold_left, ctl.deferred = (2, 2), 3, True  # a plain round's drafter entry is pending
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
            ctl.next_plan, ctl.hold_left, ctl.deferred, ctl.plain_left = (depth, width), 1, False, 0
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
