"""The draft controller's policy as plain Python over floats and ints: the CPU reference.

Written apart from the tensor code of ``controller_policy.py`` (same model, same fixed-point units: its module
docstring), so that the two can be compared decision by decision: the tensor versions (and the Triton kernel of
``decide_triton.py``) must return exactly what these loops return on any input.
"""

from __future__ import annotations

import math

from torchspec.runtime.controller_policy import NS_PER_MS, PROB_ONE, SCALE_ONE, rank_bucket


def _ref_units(logp: float) -> int:
    return int(math.floor(math.exp(logp) * PROB_ONE))


def reference_expected_tokens(pool: list[list[float]], max_width: int, row_valid: list[bool],
                              scale: int | list[int] | None = None) -> list[int]:
    """``scale``: one for every rank, or one a rank bucket (``rank_bucket``)."""
    width = min(max_width, len(pool[0]))
    totals = [0] * (width + 1)
    for row, live in zip(pool, row_valid):
        if not live:
            continue
        probs = sorted((_ref_units(lp) for lp in row), reverse=True)
        running = 0
        for n in range(width + 1):
            totals[n] += running
            if n < width:
                running += probs[n]
    if scale is None:
        return [sum(row_valid) * PROB_ONE + t for t in totals]
    per_rank = [totals[n + 1] - totals[n] for n in range(width)]  # the rank-n nodes of the live rows, summed
    scales = [scale] * width if isinstance(scale, int) else [scale[rank_bucket(n)] for n in range(width)]
    weighted = [0]
    for x, sc in zip(per_rank, scales):
        weighted.append(weighted[-1] + x * sc)
    return [sum(row_valid) * PROB_ONE + w // SCALE_ONE for w in weighted]


def _ref_best(tokens: list[int], depth: int, depth_ms: list[float], verify_ms: list[float],
              ahead: bool = False) -> tuple[int, float]:
    drafted = sum(round(ms * NS_PER_MS) for ms in depth_ms[: depth + 1])
    best, best_rate = 0, -1.0
    for n, t in enumerate(tokens):
        rate = t / ((0 if ahead and n == 0 else drafted) + round(verify_ms[n] * NS_PER_MS))
        if rate > best_rate:  # strict: a tie keeps the smaller width
            best, best_rate = n, rate
    return best, best_rate


def reference_verify_width(pool: list[list[float]], depth: int, depth_ms: list[float], verify_ms: list[float],
                           row_valid: list[bool], scale: int | list[int] | None = None, ahead: bool = False) -> int:
    return _ref_best(reference_expected_tokens(pool, len(verify_ms) - 1, row_valid, scale), depth, depth_ms,
                     verify_ms, ahead)[0]


def reference_decide_after_depth(pool: list[list[float]], frontier: list[list[float]],
                                 frontier_edge: list[list[float]], depth: int, depth_ms: list[float],
                                 verify_ms: list[float], row_valid: list[bool], scale: int | list[int] | None = None,
                                 ahead: bool = False) -> tuple[int, bool, bool]:
    """(width, stop, go), as ``decide_after_depth``."""
    tokens = reference_expected_tokens(pool, len(verify_ms) - 1, row_valid, scale)
    width, rate = _ref_best(tokens, depth, depth_ms, verify_ms, ahead)
    if depth + 1 == len(depth_ms):
        return width, False, False
    grown = [row + [c + e for c, e in zip(cs, es)] for row, cs, es in zip(pool, frontier, frontier_edge)]
    deeper = _ref_best(reference_expected_tokens(grown, len(verify_ms) - 1, row_valid, scale), depth + 1, depth_ms,
                       verify_ms, ahead)[1]
    go = deeper > rate
    return width, not go, go


def reference_next_plan(pools: list[list[list[float]]], frontier: list[list[float]],
                        frontier_edge: list[list[float]], depth_ms: list[float], verify_ms: list[float],
                        row_valid: list[bool], scale: int | list[int] | None = None) -> tuple[int, int]:
    """(depths, width) of the next round planned ahead (``RoundPlan.next_depth``, ``next_width``): ``pools[d]``
    the pool after depth d, ``frontier`` / ``frontier_edge`` those of the last depth drafted."""
    best, best_rate = (1, 0), -1.0
    for d, pool in enumerate(pools):
        width, rate = _ref_best(reference_expected_tokens(pool, len(verify_ms) - 1, row_valid, scale), d, depth_ms,
                                verify_ms, True)
        if rate > best_rate:  # strict: a tie keeps the shallower round
            best, best_rate = (d + 1, width), rate
    if len(pools) < len(depth_ms):  # one more depth, its children predicted
        grown = [row + [c + e for c, e in zip(cs, es)] for row, cs, es in zip(pools[-1], frontier, frontier_edge)]
        width, rate = _ref_best(reference_expected_tokens(grown, len(verify_ms) - 1, row_valid, scale), len(pools),
                                depth_ms, verify_ms, True)
        if rate > best_rate:
            best = (len(pools) + 1, width)
    return best


def reference_next_sampled_depth(go_flags: list[bool], max_depth: int) -> int:
    for d, go in enumerate(go_flags):
        if not go:
            return min(d + 1, max_depth)
    return min(len(go_flags) + 1, max_depth)


__all__ = ["reference_decide_after_depth", "reference_expected_tokens", "reference_next_plan",
           "reference_next_sampled_depth", "reference_verify_width"]
