"""A greedy round whose depth and verification width the draft controller chooses (host-chained).

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
evaluated after the round on its own tree (``sampled_go_flags``: each level's nodes scored by the
probability their draft distribution gave them) and verifies every drafted node, as the fixed sampled
tree does. Rounds with deterministic candidates at T > 0 keep ``spec``'s fixed shape.

**Host-chained.** The go flag is read on the host after every depth (one sync a depth) and the width
once per round: the fallback the issue keeps behind a flag. The device-chained rounds (the flags read
by a one-thread kernel that launches the next depth's graph) need per-depth CUDA graphs and land with
them; until then the controller runs without graphs (``SpeculativeEngine(cuda_graphs=False)``).

**Calibration.** The drafter's confidence is the controller's only estimate of acceptance, and a
drafter can be confidently wrong (an untrained one whose head is the target's). ``Calibration`` keeps,
on the device, decayed sums of the drafted tokens the verified nodes' confidence expected and of those
actually accepted; their ratio (with a small prior at 1, so that without evidence it drifts back to 1
and the controller probes again) scales the expectation in every decision
(``controller_policy``'s ``scale``). An untrained drafter is verified for a round or two, then almost
never.

Every decision keeps verification lossless: the verified set is the best ``width`` nodes by cumulative
score under a stable sort, which is ancestor-closed exactly as the fixed tree's ``num_nodes`` best are,
and greedy verification emits the target's own tokens whatever the tree
(``tests/unit/test_controlled_drafting.py`` checks outputs equal to plain decoding under every
decision the controller takes: widths 0 .. N and stops at every depth).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from torchspec.runtime.controller_policy import (
    INITIAL_SAMPLED_DEPTH,
    PROB_ONE,
    SCALE_ONE,
    decide_after_depth,
    expected_tokens,
    next_sampled_depth,
    verify_width,
)
from torchspec.runtime.cost_table import CostTable
from torchspec.runtime.drafter_runner import DrafterRunner
from torchspec.runtime.drafting import DraftInputs, SpecConfig, grow_dynamic_tree
from torchspec.runtime.paged_kv import PagedKVCache
from torchspec.runtime.sampling import SamplingParams
from torchspec.runtime.tree import DraftTree


class Calibration:
    """Decayed evidence of how far the drafter's confidence is borne out (module docstring): per round
    ``accepted = decay * accepted + drafted tokens accepted`` and ``expected = decay * expected + their
    expectation by confidence``; the scale is ``(accepted + prior) / (expected + prior)``, at most
    ``most``. Defaults: evidence halves in ~14 rounds; an untrained drafter that expected ~3 tokens and got
    none is scaled to ~0.08 and probed again after ~50 rounds."""

    def __init__(self, device: torch.device, decay: float = 0.95, prior: float = 0.25, most: float = 4.0):
        if not (0 < decay < 1 and prior > 0 and most >= 1):
            raise ValueError(f"Calibration(decay={decay}, prior={prior}, most={most}): need 0 < decay < 1, "
                             f"prior > 0 and most >= 1.")
        self.decay, self.prior, self.most = decay, prior, most
        self.accepted = torch.zeros((), dtype=torch.float64, device=device)
        self.expected = torch.zeros((), dtype=torch.float64, device=device)
        self.pending: torch.Tensor | None = None  # this round's expectation, until its verification

    def scale(self) -> torch.Tensor:
        """0-d int64 in units of SCALE_ONE (no host read)."""
        ratio = ((self.accepted + self.prior) / (self.expected + self.prior)).clamp(max=self.most)
        return torch.round(ratio * SCALE_ONE).long()

    def observe(self, accepted: torch.Tensor, row_valid: torch.Tensor) -> None:
        """After verification: ``accepted`` [B] drafted tokens accepted per row (live rows count)."""
        assert self.pending is not None, "observe follows a controlled round's draft"
        self.accepted.mul_(self.decay).add_((accepted * row_valid).sum().double())
        self.expected.mul_(self.decay).add_(self.pending)
        self.pending = None


@dataclass
class RoundCosts:
    """One round's measured costs (ms) on the round's device: ``depth_ms`` [D] (depth 0: the root's
    candidates plus the catch-up forward any speculating round pays, timed as a width-1 depth; depth
    d >= 1: a drafter depth over the k-node frontier) and ``verify_ms`` [N + 1] (index: drafted nodes
    verified; 0 is a plain step). ``trace`` collects (depths drafted, width) per round; ``calibration``
    scales the drafter's confidence (module docstring)."""

    depth_ms: torch.Tensor
    verify_ms: torch.Tensor
    calibration: Calibration
    trace: list[tuple[int, int]] = field(default_factory=list)
    max_sampled_depth: int = 0  # sampled rounds: the deepest they may grow (spec's depth)
    sampled_next: torch.Tensor | None = None  # sampled rounds: the next round's depth (0-d, set by speculate)

    @classmethod
    def lookup(cls, table: CostTable, spec: SpecConfig, batch: int, ctx: int, calibration: Calibration,
               trace: list[tuple[int, int]] | None = None) -> RoundCosts:
        """The costs of a round of ``spec``'s shape at padded ``batch`` and ``ctx`` committed tokens
        (``trace``: the list the round's decision is appended to)."""
        k = 1 if spec.shape == "chain" else spec.topk
        depth_row = table.depth_ms(batch, ctx)  # [len(table.widths)]
        one, wide = depth_row[table.widths.index(1)], depth_row[table.widths.index(k)]
        device = calibration.accepted.device
        depth_ms = torch.cat([one[None], wide.expand(spec.depth - 1)]).to(device)
        verify_ms = table.verify_ms(batch, ctx)[: spec.num_drafted(SamplingParams()) + 1].to(device)
        return cls(depth_ms, verify_ms, calibration, [] if trace is None else trace)

    @classmethod
    def lookup_sampled(cls, table: CostTable, spec: SpecConfig, batch: int, ctx: int, calibration: Calibration
                       ) -> RoundCosts:
        """A sampled round's costs for every depth ``spec`` allows: level d >= 1 is a drafter forward over
        the previous level's prod(widths[:d]) nodes (the nearest measured width at or above it, else the
        widest), level 0 the width-1 step; verification up to every node of the deepest tree."""
        sampled = SamplingParams(temperature=1.0)
        widths = spec.widths(sampled)
        depth_row, device = table.depth_ms(batch, ctx), calibration.accepted.device
        levels, front = [], 1
        for d in range(spec.depth):
            fits = [i for i, w in enumerate(table.widths) if w >= front]
            levels.append(depth_row[fits[0] if fits else -1])
            front *= widths[d]
        most = min(spec.num_drafted(sampled), table.nodes[-1])
        verify_ms = table.verify_ms(batch, ctx)[: most + 1]
        return cls(torch.stack(levels).to(device), verify_ms.to(device), calibration, max_sampled_depth=spec.depth)


def check_table_for(table: CostTable, spec: SpecConfig) -> None:
    """At configuration: the table must hold what ``spec``'s rounds look up (one-line ValueErrors)."""
    k = 1 if spec.shape == "chain" else spec.topk
    for w in sorted({1, k}):
        if w not in table.widths:
            raise ValueError(f"cost table widths {table.widths} lack the drafter width {w} of spec shape={spec.shape!r}"
                             f" topk={spec.topk}; re-run torchspec-profile with --widths including {w}.")
    most = spec.num_drafted(SamplingParams())
    if table.nodes[-1] < most:
        raise ValueError(f"cost table nodes go up to {table.nodes[-1]} but spec verifies up to {most}; re-run "
                         f"torchspec-profile with --nodes up to {most} or lower spec num_nodes.")


class Controller:
    """The draft controller across rounds (``SpeculativeEngine.configure(controller=table)``): the cost table,
    the drafter's ``calibration``, each round's shape (``plan``) and what it chose (``trace``: greedy rounds'
    (depths drafted, width); ``sampled_depths``: each sampled round's depth). At a padded batch of
    ``chain_from_batch`` rows or more, greedy rounds draft a chain (k = 1, up to ``spec.depth``, verified to
    the width the criterion picks) instead of the k-wide tree: at high concurrency a k-wide frontier multiplies
    the drafter's rows by k (``tools/bench_controller.py`` measures where that pays)."""

    def __init__(self, table: CostTable, spec: SpecConfig, calibration: Calibration,
                 chain_from_batch: int | None = None):
        check_table_for(table, spec)
        if chain_from_batch is not None and chain_from_batch < 1:
            raise ValueError(f"chain_from_batch={chain_from_batch} must be >= 1 (or None: always the tree).")
        self.table, self.spec, self.calibration, self.chain_from_batch = table, spec, calibration, chain_from_batch
        self.chain = dataclasses.replace(spec, shape="chain")
        self.trace: list[tuple[int, int]] = []
        self.sampled_depths: list[int] = []
        self.sampled_depth = min(INITIAL_SAMPLED_DEPTH, spec.depth)

    def plan(self, params, batch: int, ctx: int) -> tuple[SpecConfig, RoundCosts | None]:
        """The round's shape and costs: a greedy round chooses within ``spec`` (a chain from
        ``chain_from_batch`` rows on); a sampled tree drafts the depth the previous sampled round chose;
        deterministic candidates at T > 0 keep ``spec`` (no costs)."""
        if params.greedy:
            chain = self.chain_from_batch is not None and batch >= self.chain_from_batch
            spec = self.chain if chain else self.spec
            return spec, RoundCosts.lookup(self.table, spec, batch, ctx, self.calibration, self.trace)
        if self.spec.sampled(params):
            self.sampled_depths.append(self.sampled_depth)
            costs = RoundCosts.lookup_sampled(self.table, self.spec, batch, ctx, self.calibration)
            return dataclasses.replace(self.spec, depth=self.sampled_depth), costs
        return self.spec, None

    def after(self, costs: RoundCosts | None) -> None:
        """After the round's host sync: a sampled round's choice of the next depth (one more host read)."""
        if costs is not None and costs.sampled_next is not None:
            self.sampled_depth = int(costs.sampled_next)


def draft_controlled_tree(runner: DrafterRunner, cache: PagedKVCache, inp: DraftInputs, spec: SpecConfig,
                          costs: RoundCosts) -> DraftTree:
    """The greedy dynamic tree of ``spec`` (a chain when shape == 'chain', ``drafting.grow_dynamic_tree``),
    cut where the controller stops, keeping its chosen width of best nodes (module docstring)."""
    scale = costs.calibration.scale()
    for depth, pool in enumerate(grow_dynamic_tree(runner, cache, inp, spec, SamplingParams())):
        scores = torch.cat(pool.sc, 1)  # [B, P] every node drafted so far
        if pool.front_sc is None:  # spec's last depth: the width alone
            width = verify_width(scores, depth, costs.depth_ms, costs.verify_ms, inp.row_valid, scale)
            break
        decision = decide_after_depth(scores, pool.front_sc, pool.front_edge(), depth, costs.depth_ms,
                                      costs.verify_ms, inp.row_valid, scale)
        width = decision.width
        if not bool(decision.go):  # host-chained: one read a depth
            break
    m = int(width)  # the round's one more host read: the verified shape
    costs.trace.append((depth + 1, m))
    drafted = expected_tokens(scores, m, inp.row_valid)[-1] - inp.row_valid.sum() * PROB_ONE  # for the calibration
    costs.calibration.pending = drafted.double() / PROB_ONE
    return pool.tree(inp.root, m)


def sampled_go_flags(tree: DraftTree, depth: int, costs: RoundCosts, row_valid: torch.Tensor) -> torch.Tensor:
    """The criterion after each of a sampled tree's ``depth`` levels, on the tree just drafted -> go flags
    [depth] (bool, no host read): a node's confidence is the probability its parent's processed draft
    distribution gave its token, cumulative along its path; levels beyond the table's are not evaluated."""
    b, n = tree.tokens.shape
    v = tree.dists.shape[-1]
    parent = tree.parents.clamp(min=0)
    row_of = tree.dist_index.gather(1, parent).clamp(min=0)  # [B, N] the parent's distribution row
    q = tree.dists.reshape(b, -1).gather(1, row_of * v + tree.tokens)  # [B, N]
    drafted = (tree.depths > 0) & tree.valid
    edge = torch.where(drafted, torch.log(q.float()), float("-inf"))
    cum = torch.where(drafted, edge, 0.0)
    for _ in range(depth):  # pointer passes: after k, every node of depth <= k + 1 holds its path's sum
        cum = torch.where(tree.depths > 1, edge + cum.gather(1, parent), cum)
    cum = torch.where(drafted, cum, float("-inf"))
    scale, flags = costs.calibration.scale(), []
    for level in range(1, min(depth, costs.depth_ms.shape[0]) + 1):
        pool = torch.where(tree.depths <= level, cum, float("-inf"))[:, 1:]  # [B, N - 1] the levels so far
        at = tree.depths[:, 1:] == level
        front = torch.where(at, cum[:, 1:], float("-inf"))
        decision = decide_after_depth(pool, front, torch.where(at, edge[:, 1:], float("-inf")), level - 1,
                                      costs.depth_ms, costs.verify_ms, row_valid, scale)
        flags.append(decision.go)
    return torch.stack(flags)


def next_depth_after_sampled(tree: DraftTree, depth: int, costs: RoundCosts, row_valid: torch.Tensor) -> torch.Tensor:
    """The next sampled round's depth (0-d int64) from this round's tree (module docstring)."""
    return next_sampled_depth(sampled_go_flags(tree, depth, costs, row_valid), costs.max_sampled_depth)


__all__ = ["Calibration", "Controller", "RoundCosts", "next_depth_after_sampled", "sampled_go_flags", "check_table_for", "draft_controlled_tree"]
