"""Experiment: ahead-mode plans from recent rounds' estimates instead of the last round's alone (CPU, modeled time).

The draft controller plans each greedy round from the round before: the (depth, width) of the highest expected
tokens per ms among the depths that round drafted and one more (``controller_policy.decide_every_depth``). With
a trained drafter on real text, two things follow (docs/results.md, twenty-fourth session): one unconfident
round plans a shallow or plain next round whatever the rounds before it said, and a round that drafted d depths
can plan at most d + 1, so after a dip the plan climbs back one depth a round. This tool replays
``tools/replay_controller.py`` with the plan replaced by the argmax over an exponential average of every
(depths, width)'s expected tokens per live row, each entry updated only by rounds that estimated it (the depths
drafted and the predicted one more; a deeper entry keeps what earlier rounds said), ``--smooth`` the weight of
the newest round (1.0: the last round alone, as the runtime, except that older deeper entries stay eligible).

A planning aid in float64 on the host (the runtime's decision is exact fixed point on the GPU): it reports the
modeled speedups the replay prints, nothing more. Every other argument is ``replay_controller``'s.

    python tools/replay_smoothed_plans.py --smooth 0.3 --target <gguf> --drafter <export> --costs <table> \\
        --num-prompts 8 --max-new-tokens 128 --chains 1 --trees 5x8x32 --out replay_smoothed.json
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import replay_controller  # noqa: E402

from torchspec.runtime import controlled_drafting  # noqa: E402
from torchspec.runtime.controller_policy import NS_PER_MS, PROB_ONE, RoundPlan, expected_tokens  # noqa: E402


class SmoothedPlans:
    """The exponential average of each (depths, width)'s expected tokens per live row, and the plan it gives."""

    def __init__(self, weight: float):
        if not 0 < weight <= 1:
            raise ValueError(f"--smooth {weight} must lie in (0, 1] (the newest round's weight).")
        self.weight, self.tokens = weight, {}  # (depths, width) -> expected tokens a live row

    def observe(self, pools: list[torch.Tensor], row_valid: torch.Tensor, scale, n_max: int) -> None:
        live = max(int(row_valid.sum()), 1)
        for c, pool in enumerate(pools, start=1):  # c depths drafted (the last: predicted children)
            per_width = expected_tokens(pool, n_max, row_valid, scale).double() / PROB_ONE / live
            for w, t in enumerate(per_width.tolist()):
                old = self.tokens.get((c, w))
                self.tokens[c, w] = t if old is None else (1 - self.weight) * old + self.weight * t

    def plan(self, depth_ms: torch.Tensor, verify_ms: torch.Tensor) -> tuple[int, int]:
        drafted = torch.cumsum(depth_ms.double(), 0).tolist()
        verify = verify_ms.double().tolist()
        best, best_rate = (1, 0), -1.0
        for (c, w), t in sorted(self.tokens.items()):  # ties: the shallower, then the narrower
            if c > len(drafted) or w >= len(verify):
                continue
            cost = verify[0] if w == 0 else drafted[c - 1] + verify[w]
            rate = t / round(cost * NS_PER_MS)
            if rate > best_rate:
                best, best_rate = (c, w), rate
        return best


def install(weight: float) -> None:
    """Replace the runtime's tensor decision with one whose plan comes from ``SmoothedPlans`` (one per calibration)."""
    original = controlled_drafting.decide_every_depth_calibrated
    states: dict[int, SmoothedPlans] = {}

    def decide(pool_logp, sizes, fronts, edges, depth_ms, verify_ms, row_valid, cal, verified):
        plan, evidence = original(pool_logp, sizes, fronts, edges, depth_ms, verify_ms, row_valid, cal, verified)
        alpha, scale = cal.choice()
        scores = pool_logp.double() * alpha
        pools = [scores[:, :n] for n in sizes]
        if len(sizes) < depth_ms.shape[0]:  # one more depth, its children predicted as the runtime predicts them
            pools.append(torch.cat([scores, (fronts[-1].double() + edges[-1].double()) * alpha], 1))
        state = states.setdefault(cal.serial, SmoothedPlans(weight))
        state.observe(pools, row_valid, scale, verify_ms.shape[0] - 1)
        depth, width = state.plan(depth_ms, verify_ms)
        planned = RoundPlan(plan.go, plan.width, torch.tensor(depth), torch.tensor(width), plan.drafted)
        return planned, evidence

    controlled_drafting.decide_every_depth_calibrated = decide


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--smooth", type=float, default=0.3)
    own, rest = p.parse_known_args(argv)
    install(own.smooth)
    return replay_controller.main(rest)


if __name__ == "__main__":
    main()
