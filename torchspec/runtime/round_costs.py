"""A round's measured costs on the device, as the draft controller reads them (``controlled_drafting.py``).

``RoundCosts.lookup`` turns the cost table's rows (``cost_table.CostTable``: a drafter depth per width and a
verify forward per node count, at a padded batch and context) into the two vectors the policy weighs
(``controller_policy``): what each draft depth costs and what verifying each number of nodes costs, both with
the host's time a round. ``lookup_sampled`` does the same for a sampled tree's levels. ``check_table_for``
refuses, at configuration, a table that lacks what a spec's rounds look up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchspec.runtime.calibration import Calibration
from torchspec.runtime.cost_table import CostTable
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.sampling import SamplingParams
from torchspec.runtime.scheduler import host_to_device

DENSE_WIDTHS = 8  # ahead mode verifies any width up to this; beyond it, only the node counts the table measured
UNMEASURED_MS = 1e9  # the verify cost of a width beyond DENSE_WIDTHS the table did not measure (never chosen)


@dataclass
class RoundCosts:
    """One round's measured costs (ms) on the round's device: ``depth_ms`` [D] (depth 0: what any
    speculating round pays beyond its verify forward -- the root's candidates, the decision, acceptance
    and the drafter's catch-up -- the table's whole width-0 round less its plain step; depth d >= 1: a
    drafter depth over the k-node frontier) and ``verify_ms`` [N + 1] (index: drafted nodes verified; 0
    is a plain step; each with the table's host time a round, ``CostTable.overhead_ms``). ``trace`` collects
    (depths drafted, width) per round; ``calibration`` scales the drafter's confidence (module docstring). A
    round's ``plan`` (ahead mode: the (depth, width) it drafts) is part of its graph's key; the tensors are its
    graph's inputs."""

    depth_ms: torch.Tensor
    verify_ms: torch.Tensor
    calibration: Calibration
    trace: list[tuple[int, int]] = field(default_factory=list)
    max_sampled_depth: int = 0  # sampled rounds: the deepest they may grow (spec's depth)
    plan: tuple[int, int] | None = None  # ahead mode: this greedy round's (depths drafted, width verified)
    averages_key: tuple[str, int, int] | None = None  # ahead mode: which averaged plan table the round folds into
    flush: bool = False  # the first round drafting after plain rounds: it catches the drafter up on them first

    @property
    def averages(self) -> torch.Tensor | None:
        """The averaged plan table the round folds into and plans from (``plan_averages``), reached through the
        calibration (``Calibration.averages_for``), so every round and every CUDA graph of a shape reads and
        writes the one table: a graph's static inputs are copies of its tensor fields (``graphs.py``), and a
        table held here as a field was copied per graph, each folding only the rounds of its own plan."""
        return None if self.averages_key is None else self.calibration.averages_for(*self.averages_key)

    @classmethod
    def lookup(cls, table: CostTable, spec: SpecConfig, batch: int, ctx: int, calibration: Calibration,
               trace: list[tuple[int, int]] | None = None, measured_only: bool = False) -> RoundCosts:
        """The costs of a round of ``spec``'s shape at padded ``batch`` and ``ctx`` committed tokens
        (``trace``: the list the round's decision is appended to; ``measured_only``: widths above
        ``DENSE_WIDTHS`` the table did not measure cost ``UNMEASURED_MS``, so the policy picks every small
        width (a chain grows one node a depth) and otherwise the measured node counts: ahead mode's graphs
        are one per planned (depth, width), a few dozen at most)."""
        depth_ms, verify_ms = host_costs(table, spec, batch, ctx)
        device = calibration.accepted.device
        if measured_only:
            measured = torch.arange(verify_ms.shape[0]) <= DENSE_WIDTHS
            measured[[n for n in table.nodes if n < verify_ms.shape[0]]] = True
            verify_ms = torch.where(measured, verify_ms, UNMEASURED_MS)
        return cls(host_to_device(depth_ms, depth_ms.dtype, device), host_to_device(verify_ms, verify_ms.dtype, device),
                   calibration, [] if trace is None else trace)

    @classmethod
    def lookup_sampled(cls, table: CostTable, spec: SpecConfig, batch: int, ctx: int, calibration: Calibration
                       ) -> RoundCosts:
        """A sampled round's costs for every depth ``spec`` allows: level d >= 1 is a drafter forward over
        the previous level's prod(widths[:d]) nodes (the nearest measured width at or above it, else the
        widest), level 0 the width-1 step; verification up to every node of the deepest tree."""
        sampled = SamplingParams(temperature=1.0)
        widths = spec.widths(sampled)
        depth_row, device = table.depth_ms(batch, ctx), calibration.accepted.device
        most = min(spec.num_drafted(sampled), table.nodes[-1])
        verify_ms = table.verify_ms(batch, ctx)[: most + 1]
        levels, front = [table.spec_extra_ms(batch, ctx)], widths[0]
        verify_ms = verify_ms + table.overhead_ms(batch)  # every round pays the host's time
        for d in range(1, spec.depth):
            fits = [i for i, w in enumerate(table.widths) if w >= front]
            levels.append(depth_row[fits[0] if fits else -1])
            front *= widths[d]
        depth_ms = torch.stack(levels)
        return cls(host_to_device(depth_ms, depth_ms.dtype, device), host_to_device(verify_ms, verify_ms.dtype, device),
                   calibration, max_sampled_depth=spec.depth)


def host_costs(table: CostTable, spec: SpecConfig, batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``RoundCosts.lookup``'s two vectors on the host, every width as measured or interpolated: ``depth_ms``
    [spec.depth] and ``verify_ms`` [nodes + 1], each verify time with the host's time a round."""
    k = 1 if spec.shape == "chain" else spec.topk
    wide = table.depth_ms(batch, ctx)[table.widths.index(k)]  # [len(table.widths)] -> k's
    verify_ms = table.verify_ms(batch, ctx)[: spec.num_drafted(SamplingParams()) + 1]
    depth_ms = torch.cat([table.spec_extra_ms(batch, ctx)[None], wide.expand(spec.depth - 1)])
    return depth_ms, verify_ms + table.overhead_ms(batch)  # every round, plain or not, pays the host's time


def break_even_tokens(table: CostTable, shape: SpecConfig, width: int, batch: int, ctx: int) -> float:
    """The tokens a row-round that a fixed round of ``shape`` (its depth drafted, ``width`` nodes verified) must
    commit to match plain decoding's one token a row-round at its cost: its modeled ms (``host_costs``: depth 0,
    with the table's decision in it, and each later depth, plus the verify forward of ``width`` nodes) over a
    plain step's."""
    depth_ms, verify_ms = host_costs(table, shape, batch, ctx)
    return float((depth_ms[: shape.depth].sum() + verify_ms[width]) / verify_ms[0])


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


__all__ = ["DENSE_WIDTHS", "UNMEASURED_MS", "RoundCosts", "check_table_for"]
