"""The draft controller's policy: how deep to draft and how many drafted nodes to verify, per batch.

A greedy round drafts the dynamic tree of ``drafting.py``: depth 0 is the top-k of the root's draft
distribution, each later depth expands the k-node frontier and keeps the best k of its k*k children.
After drafting depths 0..d, every row holds a pool of nodes, each with its cumulative draft
log-probability ``logp`` (the sum of its path's edge log-probabilities). The rows of a batch share one
static shape (CUDA graphs), so every decision is made for the whole batch from sums over its rows.

**Model.** The drafter's own confidence estimates acceptance: a node is accepted with probability
``exp(logp)``. Verifying the best ``n`` nodes of each row by ``logp`` (a stable sort: ``logp`` never
rises along a path, so the set is ancestor-closed) is expected to emit, over the batch's live rows,

    tokens(n) = sum_rows (1 + sum of the row's n largest exp(logp))    (1: the target's bonus token)
    cost(n)   = sum_{j <= d} depth_ms[j] + verify_ms[n]                (measured, ms)
    rate(n)   = tokens(n) / cost(n)

**Width.** ``n* = argmax rate(n)`` over ``n = 0 .. min(N_max, pool size)``, the smallest ``n`` on a
tie; ``n = 0`` is a plain decode step. An untrained drafter (flat distributions) adds ~0 tokens per
node while every node costs verify time, so it gets ``n* = 0``. Decided inside the round (the host-chained
mode), the depths drafted are spent whatever the width, so ``cost(0)`` includes them; planned for the next
round (``ahead``), width 0 is a plain round that drafts nothing: ``cost(0) = verify_ms[0]`` (charging it the
depths made a barely-confident drafter look worth a width-1 verify: an untrained one at batch 8 on an H200
verified one node in 753 of 762 rounds, x0.70 of plain).

**Go deeper.** One more depth would add children to the k frontier nodes. Their probabilities are
predicted without running it: a frontier node with path log-probability ``c`` whose last edge had
log-probability ``e`` is given one child of ``exp(c + e)``, i.e. the next edge is assumed as confident
as the last (drafter confidence persists over runs of easy tokens). The estimate reads only tensors the
round already holds on the GPU, never exceeds its parent (the predicted pool stays ancestor-closed) and
ignores the other children (it errs towards stopping). The predicted round is scored like the real
one: ``rate'`` = best ``tokens'(n) / (sum_{j <= d+1} depth_ms[j] + verify_ms[n])`` over the pool plus
the predicted children, and the controller goes deeper iff ``rate' > rate(n*)``. With the marginal
gain ``g = tokens'(n') - tokens(n*)`` and marginal cost ``m = depth_ms[d+1] + verify_ms[n'] -
verify_ms[n*]`` this is the rule ``g / m > tokens(n*) / cost(n*)`` (mediant: ``(T + g) / (C + m) >
T / C`` iff ``g / m > T / C`` for ``m > 0``), written so that ``m <= 0`` needs no special case. The last
depth of the cost table never goes deeper (``go`` and ``stop`` both False: the cap ended drafting).

**Sampled rounds** (T > 0) draft a depth fixed before their draws: ``next_sampled_depth`` of the go
flags of the previous evaluation (the depth where the criterion stopped; one deeper if it never did),
``INITIAL_SAMPLED_DEPTH`` before any. **High concurrency** drafts a chain whose depth comes from a
measured ``{padded batch: depth}`` table (``chain_depth_for_batch``).

**Exact decisions.** The tensor versions run as the on-GPU decision (no ``.item()``, static shapes);
the ``reference_*`` versions (``controller_reference.py``) are plain Python loops. They must decide identically, but fp32 sums
depend on the reduction order. So probabilities become fixed point, ``floor(exp(logp) * PROB_ONE)``
(``exp`` in float64), and costs integer nanoseconds, ``round(ms * 1e6)``: every sum is exact int64 in
any order. Each rate is one IEEE float64 division of exact integers, the same number everywhere;
equal rates go to the smaller width. The one op that may round differently is ``exp`` (1 float64 ulp):
a probability's unit flips only within 2^-32 of a grid point, and flips a decision only at a near-tie.

**Calibrated.** Every function takes an optional ``scale`` (int64, units of ``SCALE_ONE``): one for all nodes, or
one per bucket of a node's rank among its row's best (``rank_bucket``: 1, 2-3, 4-7, 8-15, 16-31, 32+) as the
calibration keeps them (``calibration.py``); the expectation of width n is ``sum_{j<n} per_rank_j * s_j //
SCALE_ONE``, integers again, so one scale in every bucket is exactly the single scale.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

PROB_ONE = 1 << 20  # fixed-point units per expected token
SCALE_ONE = 1 << 16  # fixed-point units of the calibration scale (1.0: the drafter's confidence taken as is)
NS_PER_MS = 1_000_000
INITIAL_SAMPLED_DEPTH = 1  # depth 0 alone; grows by one per round while the criterion keeps going
RANK_BUCKETS = 6  # a calibration scale per bucket of ranks: 1, 2-3, 4-7, 8-15, 16-31, 32 and beyond (rank 0 best)


class Decision(NamedTuple):
    """The controller's output after a draft depth, as 0-d GPU tensors."""

    width: torch.Tensor  # int64: nodes per row to verify if drafting ends here
    stop: torch.Tensor  # bool: the criterion ends drafting (one more depth would lower tokens/ms)
    go: torch.Tensor  # bool: draft another depth


def check_costs(depth_ms: torch.Tensor, verify_ms: torch.Tensor) -> None:
    """Once, when a cost table is loaded (it reads the values: never inside a round)."""
    for name, ms in (("depth_ms", depth_ms), ("verify_ms", verify_ms)):
        if ms.dim() != 1 or ms.numel() == 0:
            raise ValueError(f"{name} has shape {tuple(ms.shape)}; pass a non-empty 1-D tensor of times in ms.")
        if not bool(torch.isfinite(ms).all()) or bool((ms < 0).any()):
            raise ValueError(f"{name}={ms.tolist()} holds negative or non-finite times; re-measure the cost table.")
    if bool((verify_ms == 0).any()):
        raise ValueError(f"verify_ms={verify_ms.tolist()} holds a zero time; a forward is never free, re-measure it.")


def _check_shapes(pool_logp: torch.Tensor, depth: int, depth_ms: torch.Tensor, verify_ms: torch.Tensor,
                  row_valid: torch.Tensor | None) -> None:
    """Static checks only (shapes and ints): free inside a captured round."""
    if pool_logp.dim() != 2 or pool_logp.shape[1] == 0:
        raise ValueError(f"pool_logp has shape {tuple(pool_logp.shape)}; pass [rows, pool nodes] with >= 1 node.")
    if depth_ms.dim() != 1 or verify_ms.dim() != 1 or verify_ms.numel() == 0:
        raise ValueError(f"depth_ms / verify_ms have shapes {tuple(depth_ms.shape)} / {tuple(verify_ms.shape)}; "
                         f"pass 1-D cost rows (verify_ms[0] the plain decode step).")
    if not 0 <= depth < depth_ms.shape[0]:
        raise ValueError(f"depth={depth} is outside the cost table's depths 0..{depth_ms.shape[0] - 1}; "
                         f"stop drafting at its last depth.")
    if row_valid is not None and (row_valid.shape != pool_logp.shape[:1] or row_valid.dtype != torch.bool):
        raise ValueError(f"row_valid has shape {tuple(row_valid.shape)} and dtype {row_valid.dtype}; "
                         f"pass a bool tensor of shape [{pool_logp.shape[0]}] (one flag per row).")


def _units(logp: torch.Tensor) -> torch.Tensor:
    """Log-probabilities -> probabilities in fixed point (int64, same shape)."""
    return torch.floor(torch.exp(logp.double()) * PROB_ONE).long()


def cost_ns(ms: torch.Tensor) -> torch.Tensor:
    """Costs in ms -> integer nanoseconds, half to even (the decision's integers, on every device)."""
    return torch.round(ms.double() * NS_PER_MS).long()


def rank_bucket(rank: int) -> int:
    """The calibration bucket of a node's rank among its row's verified nodes (0 = the best)."""
    return min((rank + 1).bit_length() - 1, RANK_BUCKETS - 1)


def bucket_of(ranks: torch.Tensor) -> torch.Tensor:
    """``rank_bucket`` of every rank of a tensor (int64, same shape; no host read)."""
    return sum((ranks >= (2 << i) - 1).long() for i in range(RANK_BUCKETS - 1))


def rank_buckets(n: int, dev: torch.device) -> torch.Tensor:
    """[n] int64 ``rank_bucket`` of ranks 0 .. n-1, built on the device (capturable: no host copy)."""
    return bucket_of(torch.arange(n, device=dev))


def _scaled_cumsum(per_rank: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """per_rank [..., W] int64 (the rank-j node of every row, summed) -> [..., W] the expected drafted tokens of
    widths 1..W: ``cumsum(per_rank * s_j) // SCALE_ONE`` with ``s_j`` the scale (0-d: every rank alike, the same
    as scaling the sum; [RANK_BUCKETS]: rank j's bucket's) -- integers, exact in any order, on every device."""
    if scale is None:
        return torch.cumsum(per_rank, -1)
    if scale.dim() == 1:
        scale = scale.gather(0, rank_buckets(per_rank.shape[-1], per_rank.device))
    return torch.cumsum(per_rank * scale, -1) // SCALE_ONE


def _tokens(units: torch.Tensor, max_width: int, row_valid: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """units [B, P] -> tokens(n) for n = 0 .. max_width, summed over live rows (fixed point) [W + 1];
    ``scale`` (int64, units of SCALE_ONE: 0-d, or one a rank bucket) multiplies the drafted tokens' expectation."""
    ranked = torch.sort(units, dim=-1, descending=True).values[:, :max_width] * row_valid[:, None]  # [B, W]
    per_width = _scaled_cumsum(ranked.sum(0), scale)  # [W]
    bonus = row_valid.sum() * PROB_ONE  # every live row emits the target's token
    return bonus + torch.cat([per_width.new_zeros(1), per_width])


def _best(units: torch.Tensor, depth: int, depth_ms: torch.Tensor, verify_ms: torch.Tensor,
          row_valid: torch.Tensor, scale: torch.Tensor | None = None, ahead: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The best width over the pool ``units`` [B, P] after drafting depths 0..depth, and its rate (``ahead``:
    width 0 is a plain round, which drafts nothing)."""
    max_width = min(verify_ms.shape[0] - 1, units.shape[1])
    cost = cost_ns(depth_ms[: depth + 1]).sum() + cost_ns(verify_ms[: max_width + 1])  # [W + 1] ns
    if ahead:  # static
        cost = torch.cat([cost_ns(verify_ms[:1]), cost[1:]])
    rate = _tokens(units, max_width, row_valid, scale).double() / cost.double()  # [W + 1]
    return torch.argmax(rate), rate.max()  # argmax: the first maximum, so ties go to the smaller width


def expected_tokens(pool_logp: torch.Tensor, max_width: int, row_valid: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """pool_logp [B, P] -> tokens(n) [min(max_width, P) + 1] int64 in units of 1 / PROB_ONE token."""
    valid = torch.ones_like(pool_logp[:, 0], dtype=torch.bool) if row_valid is None else row_valid
    return _tokens(_units(pool_logp), min(max_width, pool_logp.shape[1]), valid, scale)


def verify_width(pool_logp: torch.Tensor, depth: int, depth_ms: torch.Tensor, verify_ms: torch.Tensor,
                 row_valid: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 ahead: bool = False) -> torch.Tensor:
    """The width (0-d int64) maximising tokens / ms after drafting depths 0..depth of pool ``pool_logp`` [B, P]."""
    _check_shapes(pool_logp, depth, depth_ms, verify_ms, row_valid)
    valid = torch.ones_like(pool_logp[:, 0], dtype=torch.bool) if row_valid is None else row_valid
    return _best(_units(pool_logp), depth, depth_ms, verify_ms, valid, scale, ahead)[0]


def decide_after_depth(pool_logp: torch.Tensor, frontier_logp: torch.Tensor, frontier_edge_logp: torch.Tensor,
                       depth: int, depth_ms: torch.Tensor, verify_ms: torch.Tensor,
                       row_valid: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                       ahead: bool = False) -> Decision:
    """The decision after drafting depths 0..depth (``ahead``: planning the next round, module docstring).

    pool_logp [B, P] every drafted node's cumulative log-probability; frontier_logp [B, F] those of the
    nodes the next depth would expand, frontier_edge_logp [B, F] their last edge's log-probability;
    depth_ms [D_max], verify_ms [N_max + 1] this batch's measured costs; row_valid [B] live rows; scale
    (0-d int64, SCALE_ONE = 1.0) the calibration of the drafter's confidence (module docstring)."""
    _check_shapes(pool_logp, depth, depth_ms, verify_ms, row_valid)
    if frontier_logp.shape != frontier_edge_logp.shape or frontier_logp.shape[:1] != pool_logp.shape[:1]:
        raise ValueError(f"frontier_logp {tuple(frontier_logp.shape)} and frontier_edge_logp "
                         f"{tuple(frontier_edge_logp.shape)} must both be "
                         f"[{pool_logp.shape[0]}, F] (one row per pool row).")
    valid = torch.ones_like(pool_logp[:, 0], dtype=torch.bool) if row_valid is None else row_valid
    units = _units(pool_logp)  # [B, P]
    width, rate = _best(units, depth, depth_ms, verify_ms, valid, scale, ahead)
    if depth + 1 == depth_ms.shape[0]:  # static: the table's last depth
        capped = torch.zeros((), dtype=torch.bool, device=pool_logp.device)
        return Decision(width, capped, capped)
    children = _units(frontier_logp.double() + frontier_edge_logp.double())  # [B, F] one predicted child each
    _, deeper = _best(torch.cat([units, children], 1), depth + 1, depth_ms, verify_ms, valid, scale, ahead)
    stop = deeper <= rate
    return Decision(width, stop, ~stop)


class RoundPlan(NamedTuple):
    """``decide_every_depth``'s output, as GPU tensors."""

    go: torch.Tensor  # [D] bool: the criterion after each drafted depth (False at the table's last depth)
    width: torch.Tensor  # [D] int64: the width chosen had drafting ended there
    next_depth: torch.Tensor  # 0-d int64: the depths the next round drafts (ahead mode's plan)
    next_width: torch.Tensor  # 0-d int64: ... and the width it verifies
    drafted: torch.Tensor  # 0-d int64: the drafted tokens the ``verified`` best nodes expect, unscaled (fixed point)
    estimates: torch.Tensor  # [T, N_max + 1] int64: tokens a live row expects of each (depths, width) the round
    #                          estimated (the depths drafted and one more; fixed point), -1 where it estimated none
    probe_depth: torch.Tensor  # 0-d int64: what a probe drafts if the plan is a plain round (plan_averages; here
    probe_width: torch.Tensor  # the plan itself: a plan from one round alone probes depth 0, PROBE_WIDTH)


def decide_every_depth(pool_logp: torch.Tensor, sizes: list[int], children_logp: torch.Tensor,
                       depth_ms: torch.Tensor, verify_ms: torch.Tensor, row_valid: torch.Tensor,
                       scale: torch.Tensor | None, verified: int) -> RoundPlan:
    """``decide_after_depth(..., ahead=True)`` after each of a round's D drafted depths, evaluated at once after
    the round (ahead mode plans the next round from all of them): the same integers and float64 divisions, so
    the same decisions bit for bit, in a few dozen operations instead of ~100 a depth.

    pool_logp [B, P] every node drafted, by depth (depth d's pool: the first ``sizes[d]`` columns); children_logp
    [D, B, F] the predicted child of each node of depth d's frontier (its path plus its last edge, in float64);
    ``verified``: the width the round verifies (``drafted``: what its nodes' confidence expects, unscaled, for
    the calibration). ``estimates``: the expected tokens of every (depths, width) rated, per live row, which
    ``plan_averages`` averages over rounds."""
    d, (b, p) = len(sizes), pool_logp.shape
    f = children_logp.shape[-1]
    if children_logp.shape != (d, b, f) or sizes[0] <= 0 or sorted(sizes) != sizes or sizes[-1] != p:
        raise ValueError(f"decide_every_depth: sizes {sizes} must rise to the pool's {p} nodes and children_logp "
                         f"{tuple(children_logp.shape)} must be [{d}, {b}, F].")
    if d > depth_ms.shape[0]:
        raise ValueError(f"{d} depths drafted but the cost table has {depth_ms.shape[0]}; stop at its last depth.")
    n_max, dev = verify_ms.shape[0] - 1, pool_logp.device
    if not 0 <= verified <= min(n_max, p):
        raise ValueError(f"verified={verified} must lie in [0, {min(n_max, p)}] (the pool's nodes and the table's widths).")
    current = torch.where(_below(p, sizes, dev)[:, None], _units(pool_logp)[None], 0)  # [D, B, P]
    grown = torch.cat([current, _units(children_logp)], 2)  # [D, B, P + F]
    cur_w, grown_w = min(n_max, p), min(n_max, p + f)

    def rates(units: torch.Tensor, width: int, widest: list[int], drafted_ns: torch.Tensor):
        ranked = torch.sort(units, dim=-1, descending=True).values[..., :width] * row_valid[:, None]  # [D, B, W]
        unscaled = torch.cumsum(ranked.sum(1), 1)  # [D, W]
        scaled = _scaled_cumsum(ranked.sum(1), scale)
        tokens = row_valid.sum() * PROB_ONE + torch.cat([scaled.new_zeros(d, 1), scaled], 1)  # [D, W + 1]
        verify = cost_ns(verify_ms[: width + 1])  # [W + 1]
        cost = torch.cat([verify[:1].expand(d, 1), drafted_ns[:, None] + verify[1:]], 1)  # width 0: a plain round
        rate = tokens.double() / cost.double()
        rated = _below(width + 1, [w + 1 for w in widest], dev)
        return torch.where(rated, rate, -1.0), unscaled, torch.where(rated, tokens, -1)

    drafted_ns = torch.cumsum(cost_ns(depth_ms), 0)  # [T] ns of depths 0..t
    rate, unscaled, tokens = rates(current, cur_w, [min(n_max, n) for n in sizes], drafted_ns[:d])
    deeper_ns = torch.cat([drafted_ns, drafted_ns[-1:]])[1:d + 1]  # depths 0..d+1 (the table's last: never used)
    deeper, _, grown_tokens = rates(grown, grown_w, [min(n_max, n + f) for n in sizes], deeper_ns)
    capped = torch.arange(d, device=dev) + 1 >= depth_ms.shape[0]  # the table's last depth never goes deeper
    go = (deeper.max(1).values > rate.max(1).values) & ~capped
    drafted = unscaled[-1, verified - 1] if verified > 0 else unscaled.new_zeros(())
    # the next round: the depth count whose best round rates highest among the D drafted and one more (its
    # children predicted; not past the table's last depth), ties to the shallower, with that round's best width
    options = torch.cat([rate.max(1).values, torch.where(capped[-1:], -1.0, deeper[-1:].max(1).values)])  # [D + 1]
    at = torch.argmax(options)  # the first maximum
    widths = torch.cat([torch.argmax(rate, 1), torch.argmax(deeper[-1:], 1)])  # [D + 1]
    rated = [tokens] + ([grown_tokens[-1:]] if d < depth_ms.shape[0] else [])  # the depths drafted, one more
    rated = torch.cat([torch.nn.functional.pad(t, (0, n_max + 1 - t.shape[1]), value=-1) for t in rated])
    rated = torch.nn.functional.pad(rated, (0, 0, 0, depth_ms.shape[0] - rated.shape[0]), value=-1)  # [T, N + 1]
    live = row_valid.sum()
    estimates = torch.where((rated >= 0) & (live > 0), rated // live.clamp(min=1), -1)  # per live row
    width = widths.gather(0, at.view(1))[0]  # widths[at] would sync
    return RoundPlan(go, widths[:d], at + 1, width, drafted, estimates, at + 1, width)


def _below(n: int, limits: list[int], dev: torch.device) -> torch.Tensor:
    """[len(limits), n] bool: column < limits[i], built on the device from static ints (a host-to-device copy
    would not be capturable)."""
    col = torch.arange(n, device=dev)
    return torch.stack([col < limit for limit in limits])


def next_sampled_depth(go_flags: torch.Tensor, max_depth: int) -> torch.Tensor:
    """go_flags [L] the previous evaluation's go flags after depths 0..L-1 -> the depths (0-d int64) a
    sampled round drafts: up to the first that stopped, or one more than L when none did, at most max_depth."""
    if go_flags.dim() != 1 or go_flags.numel() == 0 or go_flags.dtype != torch.bool:
        raise ValueError(f"go_flags has shape {tuple(go_flags.shape)} and dtype {go_flags.dtype}; "
                         f"pass the 1-D bool go flags of depths 0..L-1.")
    if max_depth < 1:
        raise ValueError(f"max_depth={max_depth} must be >= 1 (depth 0 is always drafted).")
    stopped = ~go_flags  # [L]
    first = torch.argmax(stopped.long())  # the first stop (0 when none)
    return torch.where(stopped.any(), first + 1, go_flags.shape[0] + 1).clamp(max=max_depth)


def chain_depth_for_batch(table: dict[int, int], batch: int) -> int:
    """The chain depth of the smallest table batch >= ``batch`` (the largest batch's beyond the table)."""
    if not table:
        raise ValueError("chain depth table is empty; measure it or pass at least one {padded batch: depth}.")
    bad = {b: d for b, d in table.items() if not isinstance(b, int) or not isinstance(d, int) or b < 1 or d < 0}
    if bad:
        raise ValueError(f"chain depth table entries {bad} are invalid; use int batch >= 1 and int depth >= 0.")
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1 (the padded batch size of the round).")
    fits = [b for b in table if b >= batch]
    return table[min(fits) if fits else max(table)]


__all__ = ["PROB_ONE", "RANK_BUCKETS", "SCALE_ONE", "INITIAL_SAMPLED_DEPTH", "Decision", "RoundPlan", "check_costs",
           "cost_ns", "expected_tokens",
           "verify_width", "decide_after_depth", "decide_every_depth", "next_sampled_depth", "chain_depth_for_batch",
           "bucket_of", "rank_bucket", "rank_buckets"]
