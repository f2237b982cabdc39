"""A greedy round whose depth and verification width the draft controller chooses (ahead: a round before, on the GPU).

The fixed dynamic tree (``drafting.draft_dynamic_tree``) drafts ``spec.depth`` depths and verifies its
``spec.num_nodes`` best nodes whatever the drafter's confidence. Here the same tree is grown depth by
depth, and after each depth ``controller_policy.decide_after_depth`` weighs one more depth against its
measured cost (``RoundCosts``, looked up in a ``cost_table.CostTable`` for the round's padded batch and
context); when it says stop (or the spec's depth is reached), the round verifies the ``width`` best
nodes that maximise expected tokens per ms -- none at all when the drafter is not worth its cost, and
the round is then a plain decode step (plus the drafter's depth 0 and catch-up, which keep the
drafter's state current for the next round).

**Sampled rounds** (T > 0, a sampled tree) must fix their shape before their draws (choosing nodes by
the confidences just drawn would bias the output): each drafts the depth at which the *previous*
sampled round's criterion stopped (``controller_policy.next_sampled_depth``; one level more when it
never stopped, up to ``spec.depth``), starting from ``INITIAL_SAMPLED_DEPTH``. The criterion is
evaluated after the round on its own tree (``sampled_depth.sampled_go_flags``: each level's nodes scored by the
probability their draft distribution gave them) and verifies every drafted node, as the fixed sampled
tree does. Rounds with deterministic candidates at T > 0 keep ``spec``'s fixed shape.

**Two modes** (their rounds on the drafter: ``controlled_rounds.py``). ``"ahead"`` (the default) decides each
greedy round's shape one round ahead, on the GPU: a round drafts its planned (depth, width) as a fixed shape
(``grow_dynamic_tree(frontier_at_last=True)``), then evaluates the criterion at each of its depths on its own
scores and plans the next round: among the depths drafted and one more (its children predicted as the go criterion
predicts them), the (depth, width) of the highest expected tokens per ms, rated on an average of recent rounds'
ratings of every (depth, width), kept on the device (``plan_averages.py``; ``TORCHSPEC_CONTROLLER_PLANS=last``: on
the last round's alone, ``RoundPlan.next_depth``, ``next_width``) -- widths beyond ``DENSE_WIDTHS`` only where the
table measured them. On CUDA that decision is one Triton kernel
(``decide_triton.py``, bit for bit the tensor version's; ~70 small kernels cost as much as a draft depth).
The plan is four ints in the round's output (its depth and width, and a probe's), read with the committed
tokens in the round's one sync: the host never waits inside a round, and every planned shape is a static
round that CUDA graphs capture. A planned width 0 starts a plain streak: its first round (a probe) drafts
depth 0 alone, verifies the root and its best candidate (``PROBE_WIDTH``: a probe that verified nothing gave
the calibration no evidence) and decides again (averaged plans: the probe drafts the table's best verifying
shape, ``plan_averages``; a probe whose rows committed its shape's break-even drafts that shape next, deciding,
whatever it planned); the next ``PROBE_EVERY - 1`` rounds are plain steps (twice as many after each
probe that plans width 0 again, up to ``PROBE_MOST - 1``; a round that verifies resets the streak) whose drafter entries are deferred
(``steps.plain_step_deferring_drafter``, ``pending_drafter.py``) until the next drafting round catches up on
them in one forward (``RoundCosts.flush``). ``"within"`` decides inside the round, after every depth, on the
host (one sync a depth), without CUDA graphs. Device-chained per-depth graphs are not built.

**Held plans** (``TORCHSPEC_CONTROLLER_PLANS=held``, the default: averaged plans, and holds): when a deciding
round plans the very (depth, width) it ran, the next ``held_plans.HOLD_ROUNDS - 1`` rounds run that plan as the
fixed shape (a chain's scoreless walk of ``width`` nodes, or the tree of ``depth`` keeping its ``width`` best),
with no scores, decision or calibration evidence, and the round after them decides again; a plan that changes,
or width 0, holds nothing; a hold starts only on a round that paid for its plan against a plain step and ends
early once its rounds' committed tokens fall short of that by more than their noise (``held_plans.py``). A
controlled chain round cost 2.7% more than the fixed chain of its shape at batch 64 (H100, twenty-eighth
session): where the averaged plan settles, most rounds need not pay that.

**Calibration** (``calibration.py``) scales the drafter's confidence by how far it has been borne out,
so an untrained drafter is verified for a round or two, then almost never.

Every decision keeps verification lossless: the verified set is the best ``width`` nodes by cumulative
score under a stable sort, which is ancestor-closed exactly as the fixed tree's ``num_nodes`` best are,
and greedy verification emits the target's own tokens whatever the tree
(``tests/unit/test_controlled_drafting.py`` checks outputs equal to plain decoding under every
decision the controller takes: widths 0 .. N and stops at every depth).
"""

from __future__ import annotations

import dataclasses

import torch

from torchspec.runtime.calibration import Calibration
from torchspec.runtime.controlled_rounds import decide_how
from torchspec.runtime.controller_policy import INITIAL_SAMPLED_DEPTH
from torchspec.runtime.cost_table import CostTable
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.held_plans import Hold
from torchspec.runtime.plan_averages import AVERAGED, plans_how
from torchspec.runtime.round_costs import DENSE_WIDTHS, RoundCosts, break_even_tokens, check_table_for

MODES = ("ahead", "within")
PLAIN_ROUND = (0, 0)  # ahead mode's plan for a round that drafts nothing (steps.plain_step_deferring_drafter)
PROBE_EVERY = 8  # while the plan is width 0, the first round and the PROBE_EVERY-th after draft depth 0 and decide
PROBE_WIDTH = 1  # a probe verifies this many nodes (an underconfident drafter is found out only by verifying it)
PROBE_MOST = 64  # ... the streak between probes doubling after each probe that plans width 0 again, up to this
CTX_STEP = 64  # a round's costs are looked up once per (shape, batch, price point: CTX_STEP tokens of context) and kept


class Controller:
    """The draft controller across rounds (``SpeculativeEngine.configure(controller=table)``): the cost table,
    the drafter's ``calibration``, each round's shape (``plan``), what the round decided for the next
    (``after``), and what it chose (``trace``: greedy rounds' (depths drafted, width); ``sampled_depths``: each
    sampled round's depth). ``mode``: "ahead" or "within" (module docstring). At a padded batch of
    ``chain_from_batch`` rows or more, greedy rounds draft a chain (k = 1, up to ``spec.depth``, verified to
    the width the criterion picks) instead of the k-wide tree: at high concurrency a k-wide frontier multiplies
    the drafter's rows by k (``tools/bench_controller.py`` measures where that pays)."""

    def __init__(self, table: CostTable, spec: SpecConfig, calibration: Calibration,
                 chain_from_batch: int | None = None, mode: str = "ahead"):
        check_table_for(table, spec)
        if chain_from_batch is not None and chain_from_batch < 1:
            raise ValueError(f"chain_from_batch={chain_from_batch} must be >= 1 (or None: always the tree).")
        if mode not in MODES:
            raise ValueError(f"controller mode={mode!r} must be one of {MODES}.")
        decide_how()  # a bad TORCHSPEC_CONTROLLER_DECIDE is refused at configure, not inside a round
        self.table, self.spec, self.calibration, self.chain_from_batch = table, spec, calibration, chain_from_batch
        self.mode = mode
        self.plans = plans_how() if mode == "ahead" else None  # "held" (the default), "average" or "last"
        self.averaged = self.plans in AVERAGED
        self.hold = Hold()  # plans "held": the rounds left that run the last plan undecided, and what they commit
        self._at = (0, 0)  # the last greedy round's (padded batch, context): where a hold's break-even is priced
        self._break_even: dict[tuple, float] = {}  # (shape, width, batch, price point) -> break_even_tokens
        self.held: tuple[int, int] | None = None  # the (depth, width) this round drafts held; None: decides or plain
        self.probing = False  # this greedy round is a width-0 plan's probe (a probe that pays drafts again: after)
        self.chain = dataclasses.replace(spec, shape="chain")
        self.trace: list[tuple[int, int]] = []
        self.sampled_depths: list[int] = []
        self.sampled_depth = min(INITIAL_SAMPLED_DEPTH, spec.depth)
        self.next_plan = (1, 0)  # ahead mode: a first greedy round drafts depth 0 and verifies nothing
        self.probe_plan = (1, PROBE_WIDTH)  # ... and what a probe drafts (plans "average": the table's best verifying)
        self.plain_left = 0  # ahead mode: plain rounds left before the next probe while the plan is width 0
        self.streak = PROBE_EVERY  # ... the rounds from the next probe to the one after it (doubling to PROBE_MOST)
        self.deferred = False  # plain rounds ran whose drafter entries no round has caught up on yet
        self._costs: dict[tuple, RoundCosts] = {}  # looked up on the device once (a lookup is ~0.4 ms of host time)
        self._shapes: dict[tuple, SpecConfig] = {}  # ahead mode: each planned (shape, depth, width) built once
        self._widths = sorted({*range(DENSE_WIDTHS + 1), *table.nodes})  # the widths ahead mode may verify
        empty = torch.zeros(0, device=calibration.accepted.device)  # a plain round reads no cost
        self._plain = RoundCosts(empty, empty, calibration, self.trace, plan=PLAIN_ROUND)

    def continue_from(self, last: Controller) -> None:
        """Go on where the ``last`` controller of the same table left its plans (an engine serving across several
        ``configure`` calls, as the bench's runs and a long-lived server do): the next greedy plan, the probe
        schedule of a plain streak and the sampled depth, when mode, spec and chain rule are the same. A fresh
        controller would start over with a probe and short streaks every call, as if nothing had been learnt
        about the drafter (the calibration, which is kept, already says what it is worth). With the same table and
        calibration it also keeps the rounds' looked-up costs and break-evens (each a ~0.4 ms lookup)."""
        if (last.mode, last.plans, last.spec, last.chain_from_batch) == (self.mode, self.plans, self.spec,
                                                                        self.chain_from_batch):
            self.next_plan, self.plain_left, self.streak = last.next_plan, last.plain_left, last.streak
            self.probe_plan = last.probe_plan
            self.sampled_depth = last.sampled_depth
            if last.table is self.table and last.calibration is self.calibration:  # the same prices: kept, not re-read
                self._costs, self._break_even = last._costs, last._break_even

    def _priced_at(self, ctx: int) -> int:
        """The context a round at ``ctx`` committed tokens is priced at: rounded down to ``CTX_STEP``, then clamped
        as the table clamps it (``CostTable.clamp_context``). Rounds past the table's last context share one price,
        so a run does not look up a table row (~0.4 ms of host time, more than a third of a SmolLM2 step) every
        ``CTX_STEP`` tokens for the same numbers (thirty-fourth session)."""
        return self.table.clamp_context(ctx // CTX_STEP * CTX_STEP)

    def _lookup(self, spec: SpecConfig, batch: int, ctx: int, sampled: bool) -> RoundCosts:
        """``RoundCosts.lookup`` (``lookup_sampled``) at ``ctx``'s price point (``_priced_at``), kept per key: each
        round gets a fresh ``RoundCosts`` over the kept device tensors."""
        at = self._priced_at(ctx)
        key = (spec.shape, sampled, batch, at)
        kept = self._costs.get(key)
        if kept is None:
            kept = self._costs[key] = (
                RoundCosts.lookup_sampled(self.table, spec, batch, at, self.calibration) if sampled else
                RoundCosts.lookup(self.table, spec, batch, at, self.calibration, measured_only=self.mode == "ahead"))
            if not sampled and self.averaged:  # one table a drafted shape, shared by every batch and ctx
                kept.averages_key = (spec.shape, kept.depth_ms.shape[0], kept.verify_ms.shape[0])
                self.calibration.averages_for(*kept.averages_key)  # made here, outside any capture
        return dataclasses.replace(kept, trace=self.trace)

    def plan(self, params, batch: int, ctx: int) -> tuple[SpecConfig, RoundCosts | None]:
        """The round's shape and costs: a greedy round chooses within ``spec`` (a chain from
        ``chain_from_batch`` rows on; ahead mode: the shape the previous greedy round planned, its depth and
        width as ``spec``'s depth and node count and in ``costs.plan``); a sampled tree drafts the depth the
        previous sampled round chose; deterministic candidates at T > 0 keep ``spec`` (no costs)."""
        self.held, self.probing = None, False
        if params.greedy:
            base = self._base(batch)
            if self.mode == "within":
                return base, self._lookup(base, batch, ctx, sampled=False)
            self._at = (batch, ctx)
            depth, width = self._allowed(self.next_plan, base, params)
            if width > 0:  # a verifying round: a later width-0 plan starts over with a probe and short streaks
                self.plain_left, self.streak = 0, PROBE_EVERY
                if not self.deferred and self.hold.take():  # a held plan: the fixed shape, undecided
                    shape = self._held_shape(base, depth, width)
                    self.held = (shape.depth, width)  # as drafted (a chain: its width alone)
                    self.trace.append(self.held)
                    return shape, None
            elif not self._probes():  # a plain round: no lookup, no shape (engine_forwards runs a plain step)
                self.deferred = True
                self.trace.append(PLAIN_ROUND)
                return base, self._plain
            elif self.averaged:  # a probe drafts the table's best verifying shape (module docstring)
                depth, width = self._allowed(self.probe_plan, base, params)
                width, self.probing = max(width, PROBE_WIDTH), True
            else:  # a probe verifies the drafter's best candidate: evidence for the calibration either way
                width, self.probing = PROBE_WIDTH, True
            costs = self._lookup(base, batch, ctx, sampled=False)
            costs.plan = (depth, width)
            self._flush_if_deferred(costs)
            self.trace.append(costs.plan)
            return self._shape(base, depth, width), costs
        if self.spec.sampled(params):
            self.sampled_depths.append(self.sampled_depth)
            costs = self._lookup(self.spec, batch, ctx, sampled=True)
            self._flush_if_deferred(costs)
            return dataclasses.replace(self.spec, depth=self.sampled_depth), costs
        return self.spec, None

    def _allowed(self, plan: tuple[int, int], base: SpecConfig, params) -> tuple[int, int]:
        """A planned (depth, width) within ``base`` and the widths ahead mode verifies (the largest allowed one)."""
        depth = min(plan[0], base.depth)
        fits = min(plan[1], base.proposed(depth), base.num_drafted(params))
        return depth, max(n for n in self._widths if n <= fits)

    def _base(self, batch: int) -> SpecConfig:
        """A greedy round's spec at padded ``batch``: the chain from ``chain_from_batch`` rows on, else ``spec``."""
        return self.chain if self.chain_from_batch is not None and batch >= self.chain_from_batch else self.spec

    def _shape(self, base: SpecConfig, depth: int, width: int) -> SpecConfig:
        """Ahead mode's shape of a planned (depth, width) of ``base``, built once (a graph key holds it)."""
        shape = self._shapes.get((base.shape, depth, width))
        if shape is None:
            shape = self._shapes[base.shape, depth, width] = dataclasses.replace(base, depth=max(depth, 1),
                                                                                 num_nodes=max(width, 1))
        return shape

    def _held_shape(self, base: SpecConfig, depth: int, width: int) -> SpecConfig:
        """A held plan's fixed shape: the tree of ``depth`` keeping its ``width`` best nodes, or the chain of
        ``width`` nodes (a chain's best ``width`` are its first: deeper nodes would be drafted only to decide)."""
        return self._shape(base, width if base.shape == "chain" else depth, width)

    def round_shapes(self, params, batch: int, ctx: int) -> list[tuple[SpecConfig, RoundCosts | None]]:
        """Every drafting round ``plan`` may return at padded ``batch`` for ``params``' kind of round (greedy:
        each planned depth and allowed width, probes included; sampled: each depth), each with and without the
        catch-up of deferred plain rounds (``flush``), and with plans "held" each one's held round (its fixed
        shape, no costs): what the engine captures as CUDA graphs before the first
        such round runs (``engine_forwards.capture_round_shapes``), so no round of a run or of serving pays a
        capture. Empty in "within" mode (no graphs) and for deterministic candidates at T > 0 (one shape). The
        host's state (plans, streaks, trace) is left as it was."""
        if self.mode != "ahead":
            return []
        out = []
        if params.greedy:
            base = self._base(batch)
            costs = self._lookup(base, batch, ctx, sampled=False)
            most = base.num_drafted(params)
            for depth in range(1, base.depth + 1):
                for width in (w for w in self._widths if 1 <= w <= min(most, base.proposed(depth))):
                    for flush in (False, True):
                        planned = dataclasses.replace(costs, plan=(depth, width), flush=flush, trace=[])
                        out.append((self._shape(base, depth, width), planned))
                    if self.plans == "held":  # its held round: the fixed shape, no costs (one graph a shape)
                        out.append((self._held_shape(base, depth, width), None))
        elif self.spec.sampled(params):
            costs = self._lookup(self.spec, batch, ctx, sampled=True)
            for depth in range(1, self.spec.depth + 1):
                for flush in (False, True):
                    out.append((dataclasses.replace(self.spec, depth=depth),
                                dataclasses.replace(costs, flush=flush, trace=[])))
        return out

    def _probes(self) -> bool:
        """Whether a width-0 round probes (drafts depth 0 and decides again) or runs plainly; a probe starts the
        next streak, twice as long as the last, up to ``PROBE_MOST`` (module docstring)."""
        if self.plain_left > 0:
            self.plain_left -= 1
            return False
        self.plain_left, self.streak = self.streak - 1, min(2 * self.streak, PROBE_MOST)
        return True

    def _flush_if_deferred(self, costs: RoundCosts) -> None:
        """A plain round defers its drafter entry; the next round that drafts catches up on all of them first."""
        if costs.plan == PLAIN_ROUND:
            self.deferred = True
        elif self.deferred:
            costs.flush, self.deferred = True, False

    def after(self, costs: RoundCosts | None, plan: list[int] | None, tokens: int, rows: int) -> None:
        """After the round's host sync, with the plan it wrote (``StepOut.plan``, read in that sync) and the tokens
        its ``rows`` live rows committed: the next greedy round's (depth, width) in ahead mode, the next sampled
        round's depth; with plans "held", whether a hold starts, goes on or ends (``held_plans.py``); a probe that
        committed its shape's break-even drafts that shape next whatever it planned (module docstring)."""
        if self.held is not None:  # a held round: its plan goes on only while it pays
            self.hold.observe(tokens, rows)
        if costs is None or plan is None:
            return
        if costs.plan is not None:
            self.next_plan = (int(plan[0]), int(plan[1]))
            if self.probing and self.next_plan[1] == 0 and tokens >= self._hold_need(*costs.plan) * rows:
                self.next_plan = tuple(costs.plan)  # a probe that paid drafts again, and decides (no hold)
                self.hold.stop()
            elif self.plans == "held" and self.next_plan == tuple(costs.plan) and self.next_plan[1] > 0:
                depth, width = self.next_plan
                self.hold.start(self._hold_need(depth, width), tokens, rows, most=1 + min(depth, width),
                                plan=self.next_plan)
            else:
                self.hold.stop()
            if len(plan) >= 4:
                self.probe_plan = (int(plan[2]), int(plan[3]))
        elif costs.max_sampled_depth:
            self.sampled_depth = int(plan[0])

    def _hold_need(self, depth: int, width: int) -> float:
        """The tokens a row-round the held shape of (depth, width) must commit at the last round's batch and
        context (``round_costs.break_even_tokens``), priced once per price point (``_priced_at``): a hold's bar,
        and a probe's (``after``; a chain probe is priced as the chain of its width, the shape a hold would draft)."""
        batch, ctx = self._at
        shape = self._held_shape(self._base(batch), depth, width)
        at = self._priced_at(ctx)
        key = (shape, width, batch, at)
        need = self._break_even.get(key)
        if need is None:
            need = self._break_even[key] = break_even_tokens(self.table, shape, width, batch, at)
        return need


__all__ = ["MODES", "PLAIN_ROUND", "PROBE_EVERY", "PROBE_MOST", "PROBE_WIDTH", "Controller"]
