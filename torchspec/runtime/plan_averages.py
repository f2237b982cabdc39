"""Ahead-mode plans from an average of recent rounds' estimates: the draft controller's memory across rounds.

Ahead mode plans each greedy round in the round before (``controlled_drafting``). Planned from that one round
alone (``RoundPlan.next_depth``, ``next_width``: the best-rated among the depths it drafted and one more), the
plan follows every dip of the drafter's confidence: one unconfident round plans a shallow or plain next round
whatever the rounds before it said, and since a round that drafted d depths rates at most d + 1, the plan then
climbs back one depth a round. With the trained SmolLM2 drafter on MT-Bench at c = 1 that cost most of the
tree's speedup: x1.26 against the fixed tree's x1.36 on an H100, the calibration matching the accepted tokens
(docs/results.md, twenty-fourth session).

So every round's ratings are kept: ``RoundPlan.estimates`` [T, N_max + 1] holds the expected tokens a live
row gets from each (depths, width) the round rated (the depths it drafted, and one more with its children
predicted), and ``fold`` averages them into a table of the same shape that lives on the device across
rounds -- each entry only by rounds that rated it, so a deep entry keeps what earlier rounds said while the
plan is shallow:

    average = estimate                                                   (the entry's first estimate)
    average = average - (average >> SHIFT) + (estimate >> SHIFT)        (later: weight 2^-SHIFT to the newest)

Integers throughout (fixed point, units of 1 / PROB_ONE token): the same table on every device and in the
plain-Python reference. ``plan_from`` is the next round's plan: the (depths, width) of the highest expected
tokens per ns among the entries ever rated, costed as ``decide_every_depth`` costs them (width 0: a plain
round, ``verify_ms[0]``), the first maximum in (depths, width) order on a tie -- the shallower, then the
narrower. ``SHIFT = 1`` (half to the newest round) rated best in a replay of the trained drafter's rounds in
modeled time (twenty-fourth session, float weights): 1, 0.5 and 0.3 gave x1.23, x1.36 and x1.33 against the
fixed tree's x1.26; an untrained drafter stayed plain (x0.99 at 0.3).

**Probes.** A plain plan starts a streak of plain rounds whose probes (``controlled_drafting``) re-rate the
drafter. A probe of depth 0 alone rates only the shallow entries, and where only deep rounds pay (a round's
fixed cost, depth 0's, amortised over several depths: SmolLM2 at c = 1) no probe can show that the drafter is
worth drafting again, and the streak can double up to ``PROBE_MOST`` rounds (the fused run of the twenty-fifth
session: 819 plain rounds behind 24 probes). ``plan_from`` therefore
also names the probe: the entry of the best tokens per ns among those that verify (width >= 1). An untrained
drafter's entries all expect ~1 token, so its probe is the cheapest shape (depth 0, one node); a good drafter's
is the deep round its table rates highest.

**The averaged table is what every default has planned from** since the twenty-sixth session (from the
thirty-first on with holds, ``held_plans.py``). Served on an H100 (a 900-step SmolLM2 drafter, held-out chain
acceptance 2.97, MT-Bench, 8 prompts, fused decisions, two runs at c = 1): x1.26 and x1.31 against the last
round's plans' x1.12 and x1.19 (means of clean repeats) and the best fixed shape's x1.21 and x1.25 (the 5-deep
top-8 tree of 32 nodes); x1.07 at c = 8 (last: x1.07, best fixed: x1.07) and x1.04 at c = 64 (x1.05, x1.09);
an untrained drafter x0.98, x0.97, x0.98 (docs/results.md, twenty-sixth session). Before the probes above
(twenty-fifth session) it lost to the last round's plans (x1.00 against x1.16, 819 plain rounds of 932).
``TORCHSPEC_CONTROLLER_PLANS=last`` plans from the last round alone; ``tools/bench_controller.py --also-plans
last`` times it beside the default.

The table is ``Calibration.averages_for``'s (one per drafted shape, kept as long as the calibration: CUDA graphs
capture its address). On CUDA the fused decision (``decide_triton``) folds and plans in its plan kernel,
bit for bit these functions.
"""

from __future__ import annotations

import os

import torch

from torchspec.runtime.controller_policy import NS_PER_MS, cost_ns
from torchspec.runtime.controller_reference import reference_expected_tokens

SHIFT = 1  # the newest round's weight in the average: 2^-SHIFT
PLANS_ENV = "TORCHSPEC_CONTROLLER_PLANS"  # "held" (default), "average" or "last" (the last round's ratings alone)
DEFAULT_PLANS = "held"  # held_plans.py: faster than "average" or level in every H200 pair of the 31st session
PLANS = ("average", "held", "last")  # "held": averaged, and a plan a deciding round repeats is held (controlled_drafting)
AVERAGED = ("average", "held")  # the plans read from the averaged table (the decision kernel folds it)


def plans_how() -> str:
    """How ahead mode plans (``TORCHSPEC_CONTROLLER_PLANS``): "held" (the default since the thirty-first session:
    averaged, and a repeated plan then runs undecided for a few rounds, ``held_plans.py``), "average" (averaged,
    every round decided: module docstring) or "last"."""
    how = os.environ.get(PLANS_ENV, DEFAULT_PLANS)
    if how not in PLANS:
        raise ValueError(f"{PLANS_ENV}={how!r} is not a way to plan: set it to one of {PLANS} ({DEFAULT_PLANS!r} is "
                         f"the default).")
    return how


def fold(averages: torch.Tensor, estimates: torch.Tensor, shift: int = SHIFT) -> torch.Tensor:
    """The table after a round: ``averages`` and ``estimates`` [T, N + 1] int64 (-1: none yet / not rated)."""
    if averages.shape != estimates.shape or averages.dtype != torch.long or estimates.dtype != torch.long:
        raise ValueError(f"fold: averages {tuple(averages.shape)} {averages.dtype} and estimates "
                         f"{tuple(estimates.shape)} {estimates.dtype} must be int64 of one shape [T, N + 1].")
    mixed = averages - (averages >> shift) + (estimates >> shift)
    return torch.where(estimates >= 0, torch.where(averages >= 0, mixed, estimates), averages)


def plan_from(averages: torch.Tensor, depth_ms: torch.Tensor, verify_ms: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next round's (depths, width) and the probe's (the best entry that verifies, width >= 1; (1, 0) when
    none was rated), 0-d int64 tensors (no host read), from the averaged table [T, N + 1]."""
    t, w = averages.shape
    if depth_ms.shape != (t,) or verify_ms.shape != (w,):
        raise ValueError(f"plan_from: averages {tuple(averages.shape)} need depth_ms [{t}] and verify_ms [{w}], got "
                         f"{tuple(depth_ms.shape)} and {tuple(verify_ms.shape)}.")
    verify = cost_ns(verify_ms)  # [W]
    cost = torch.cumsum(cost_ns(depth_ms), 0)[:, None] + verify[None, :]  # [T, W] depths 0..c, then verify
    cost = torch.cat([verify[:1].expand(t, 1), cost[:, 1:]], 1)  # width 0: a plain round, which drafts nothing
    rate = torch.where(averages >= 0, averages.double() / cost.double(), -1.0)
    at = torch.argmax(rate.flatten())  # the first maximum: the shallower, then the narrower
    probe = torch.argmax(torch.where(torch.arange(w, device=rate.device) >= 1, rate, -1.0).flatten())
    return at // w + 1, at % w, probe // w + 1, probe % w


# --- CPU reference: plain Python over floats and ints, written apart from the tensor code above ---

def reference_round_estimates(pools: list[list[list[float]]], frontier: list[list[float]],
                              frontier_edge: list[list[float]], depth_ms: list[float], verify_ms: list[float],
                              row_valid: list[bool], scale: int | list[int] | None = None) -> list[list[int]]:
    """``RoundPlan.estimates``: ``pools[d]`` the pool after depth d (scores as the calibration reads them),
    ``frontier`` / ``frontier_edge`` those of the last depth drafted."""
    n_max, live = len(verify_ms) - 1, sum(row_valid)
    rated = list(pools)
    if len(pools) < len(depth_ms):  # one more depth, its children predicted
        rated.append([row + [c + e for c, e in zip(cs, es)] for row, cs, es in zip(pools[-1], frontier, frontier_edge)])
    out = []
    for c in range(len(depth_ms)):
        row = [-1] * (n_max + 1)
        if c < len(rated) and live:
            for n, tokens in enumerate(reference_expected_tokens(rated[c], n_max, row_valid, scale)):
                row[n] = tokens // live
        out.append(row)
    return out


def reference_fold(averages: list[list[int]], estimates: list[list[int]], shift: int = SHIFT) -> list[list[int]]:
    def one(a: int, e: int) -> int:
        if e < 0:
            return a
        return e if a < 0 else a - (a >> shift) + (e >> shift)
    return [[one(a, e) for a, e in zip(ra, re)] for ra, re in zip(averages, estimates)]


def reference_plan_from(averages: list[list[int]], depth_ms: list[float], verify_ms: list[float]
                        ) -> tuple[int, int, int, int]:
    """(depths, width, the probe's depths, its width), as ``plan_from``."""
    best, best_rate, probe, probe_rate, drafted = (1, 0), -1.0, (1, 0), -1.0, 0
    for c, row in enumerate(averages):
        drafted += round(depth_ms[c] * NS_PER_MS)
        for n, tokens in enumerate(row):
            if tokens < 0:
                continue
            rate = tokens / ((0 if n == 0 else drafted) + round(verify_ms[n] * NS_PER_MS))
            if rate > best_rate:  # strict: a tie keeps the shallower, then the narrower
                best, best_rate = (c + 1, n), rate
            if n >= 1 and rate > probe_rate:
                probe, probe_rate = (c + 1, n), rate
    return (*best, *probe)


__all__ = ["AVERAGED", "PLANS", "PLANS_ENV", "SHIFT", "fold", "plan_from", "plans_how", "reference_fold", "reference_plan_from",
           "reference_round_estimates"]
