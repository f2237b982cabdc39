"""The draft controller's rounds on the drafter: a greedy tree drafted to its planned shape, then decided.

``controlled_drafting.Controller`` plans each round's (depth, width) on the host from what the round before wrote;
this module drafts a round to that plan and decides the next one, in one of the two modes
(``controlled_drafting`` module docstring):

- ``draft_ahead_tree`` ("ahead", the default): the planned shape drafted as a fixed tree, the criterion then
  evaluated after every depth at once on the GPU (``decide_triton.py`` on CUDA, else the tensor twin
  ``decide_every_depth_calibrated``), the next plan four ints on the device;
- ``draft_controlled_tree`` ("within"): the criterion after every depth on the host, one read a depth.

Both keep the calibration's evidence for the verified width (``calibration.pending``) and both verify an
ancestor-closed set of best nodes, so verification stays lossless whatever they decide.
"""

from __future__ import annotations

import logging
import os

import torch

from torchspec.runtime.calibration import Calibration
from torchspec.runtime.controller_policy import (
    RoundPlan,
    decide_after_depth,
    decide_every_depth,
    verify_width,
)
from torchspec.runtime.drafter_runner import DrafterRunner
from torchspec.runtime.drafting import DraftInputs, SpecConfig, TreePool, grow_dynamic_tree
from torchspec.runtime.paged_kv import PagedKVCache
from torchspec.runtime.plan_averages import fold, plan_from
from torchspec.runtime.round_costs import RoundCosts
from torchspec.runtime.sampling import SamplingParams
from torchspec.runtime.tree import DraftTree

DECIDE_ENV = "TORCHSPEC_CONTROLLER_DECIDE"  # "fused" (default: one Triton kernel on CUDA) or "tensor"
_UNBUILT: list[str] = []  # why the decision kernel could not be built here, once it could not (then: tensor ops)
log = logging.getLogger(__name__)


def draft_ahead_tree(runner: DrafterRunner, cache: PagedKVCache, inp: DraftInputs, spec: SpecConfig,
                     costs: RoundCosts) -> tuple[DraftTree, torch.Tensor]:
    """Ahead mode (module docstring): the greedy dynamic tree of ``spec`` (its depth planned), every depth
    drafted, its ``costs.plan`` width verified -> (tree, the next round's plan [4] int64: depth, width, and the
    probe's depth and width should it plan a plain round), the
    criterion evaluated after every depth on the GPU, all at once after the round (``decide_every_depth``:
    the decisions ``decide_after_depth`` takes depth by depth, in a fraction of the kernels; no host read)."""
    fronts, edges, sizes = [], [], []
    pool: TreePool | None = None
    for pool in grow_dynamic_tree(runner, cache, inp, spec, SamplingParams(), frontier_at_last=True):
        fronts.append(pool.front_sc)  # each frontier node's path; plus its best edge: its predicted child
        edges.append(pool.front_edge())
        sizes.append(sum(sc.shape[1] for sc in pool.sc))  # static: the nodes drafted up to this depth
    m = costs.plan[1]
    plan = _decide_ahead(torch.cat(pool.sc, 1), sizes, torch.stack(fronts), torch.stack(edges), costs,
                         inp.row_valid, m)
    return pool.tree(inp.root, m), torch.stack([plan.next_depth, plan.next_width, plan.probe_depth, plan.probe_width])


def decide_how() -> str:
    """How ahead mode decides on CUDA (``TORCHSPEC_CONTROLLER_DECIDE``): "fused" (default) or "tensor"."""
    how = os.environ.get(DECIDE_ENV, "fused")
    if how not in ("fused", "tensor"):
        raise ValueError(f"{DECIDE_ENV}={how!r} is not a way to decide: set it to 'fused' (the default) or 'tensor'.")
    return how


def _decide_ahead(pool_logp: torch.Tensor, sizes: list[int], fronts: torch.Tensor, edges: torch.Tensor,
                  costs: RoundCosts, row_valid: torch.Tensor, m: int) -> RoundPlan:
    """``decide_every_depth`` on the path probabilities as the calibration reads them (``Calibration.choice``:
    p^a, scaled), and the evidence the ``m`` verified nodes expect (``calibration.pending``): on CUDA in one
    Triton launch with the calibration's choice and evidence (``decide_triton.py``; the same decisions bit for
    bit), else as tensor operations; ``TORCHSPEC_CONTROLLER_DECIDE=tensor`` forces the latter (to compare)."""
    cal, averages = costs.calibration, costs.averages
    if decide_how() == "fused" and pool_logp.is_cuda and not _UNBUILT:
        from triton.errors import TritonError  # CUDA builds of torch ship Triton

        from torchspec.runtime.decide_triton import decide_every_depth_fused, fused_sizes
        if fused_sizes(sizes) is not None:
            try:  # built at the first call: a graph's warm-up, before any capture
                plan, cal.pending = decide_every_depth_fused(pool_logp, sizes, fronts, edges, costs.depth_ms,
                                                             costs.verify_ms, row_valid, cal, m, averages)
                return plan
            except (TritonError, RuntimeError) as e:  # cannot be built here (Triton's passes raise RuntimeError)
                log.warning("the controller's decision kernel could not be built (%s: %s); deciding with tensor "
                            "operations instead (slower by ~0.15 ms a round).", type(e).__name__, e)
                _UNBUILT.append(f"{type(e).__name__}: {e}")
    plan, cal.pending = decide_every_depth_calibrated(pool_logp, sizes, fronts, edges, costs.depth_ms, costs.verify_ms,
                                                      row_valid, cal, m, averages)
    return plan


def decide_every_depth_calibrated(pool_logp: torch.Tensor, sizes: list[int], fronts: torch.Tensor,
                                  edges: torch.Tensor, depth_ms: torch.Tensor, verify_ms: torch.Tensor,
                                  row_valid: torch.Tensor, cal: Calibration, verified: int,
                                  averages: torch.Tensor | None = None) -> tuple[RoundPlan, torch.Tensor]:
    """The tensor twin of ``decide_triton.decide_every_depth_fused`` (same arguments, same results): with the
    calibration's exponent and scale, ``decide_every_depth`` on the round's pool and its predicted children
    (frontier path plus best edge), and the calibration's evidence -> (RoundPlan, evidence [len(ALPHAS)]).
    ``averages`` (the averaged plan table, ``plan_averages``): the round's estimates are folded into it in place
    and the plan is the table's; None: the plan is the round's own."""
    alpha, scale = cal.choice()
    children = (fronts.double() + edges.double()) * alpha
    plan = decide_every_depth(pool_logp.double() * alpha, sizes, children, depth_ms, verify_ms, row_valid, scale,
                              verified)
    if averages is not None:
        averages.copy_(fold(averages, plan.estimates))
        fields = ("next_depth", "next_width", "probe_depth", "probe_width")
        plan = plan._replace(**dict(zip(fields, plan_from(averages, depth_ms, verify_ms))))
    return plan, cal.evidence(pool_logp, verified, row_valid)


def draft_controlled_tree(runner: DrafterRunner, cache: PagedKVCache, inp: DraftInputs, spec: SpecConfig,
                          costs: RoundCosts) -> DraftTree:
    """The greedy dynamic tree of ``spec`` (a chain when shape == 'chain', ``drafting.grow_dynamic_tree``),
    cut where the controller stops, keeping its chosen width of best nodes (module docstring)."""
    alpha, scale = costs.calibration.choice()  # the confidence as the calibration reads it: p^alpha, scaled
    for depth, pool in enumerate(grow_dynamic_tree(runner, cache, inp, spec, SamplingParams())):
        raw = torch.cat(pool.sc, 1)  # [B, P] every node drafted so far
        scores = raw.double() * alpha
        if pool.front_sc is None:  # spec's last depth: the width alone
            width = verify_width(scores, depth, costs.depth_ms, costs.verify_ms, inp.row_valid, scale)
            break
        decision = decide_after_depth(scores, pool.front_sc.double() * alpha, pool.front_edge().double() * alpha,
                                      depth, costs.depth_ms, costs.verify_ms, inp.row_valid, scale)
        width = decision.width
        if not bool(decision.go):  # host-chained: one read a depth
            break
    m = int(width)  # the round's one more host read: the verified shape
    costs.trace.append((depth + 1, m))
    costs.calibration.pending = costs.calibration.evidence(raw, m, inp.row_valid)
    return pool.tree(inp.root, m)


__all__ = ["DECIDE_ENV", "decide_every_depth_calibrated", "decide_how", "draft_ahead_tree", "draft_controlled_tree"]
