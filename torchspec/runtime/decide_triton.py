"""The draft controller's decision after a round, in two Triton launches (ahead mode, on the GPU).

``controller_policy.decide_every_depth`` evaluates the criterion after each of a round's D drafted depths and
plans the next round in ~60 tensor operations (~110 counted on the tiny pair, ``tools/count_round_ops.py``):
inside a CUDA graph each is a launch of a few microseconds, so at SmolLM2's size deciding cost about as much
GPU time as a draft depth. ``decide_every_depth_fused`` does it in two kernels:

- ``_rank_sums_kernel``, a grid of (row chunks) x (2 D + 1) programs: each sorts its rows' path
  probabilities in fixed point (path log-probability times the calibration's exponent) for one job -- depth
  t's pool, depth t's pool with its predicted children (frontier path plus best edge), or the calibration's
  evidence (the verified best under every exponent, by rank bucket) -- and adds them, rank by rank, into one
  zeroed int64 buffer;
- ``_plan_kernel``, one program: from those sums, weighted by each rank bucket's scale
  (``Calibration.choice``), the expected tokens of every width, their rates against the costs, the go
  flags, the chosen widths, the next round's (depth, width), and the evidence as ``Calibration.evidence``.

The sorts are the work (a k=8 tree's pool is 264 nodes, 512 columns): the first version ran them in a single
program, one row chunk and one depth after another -- 62 us a decision at batch 1 and 660 us at batch 8 on an
H200 (``tools/profile_round.py --spec controller``). Spread over the grid they run side by side.

**The same decisions bit for bit.** Every step is the tensor version's arithmetic in the same types: float64
``exp`` (libdevice's, which CUDA's own ``exp`` is), ``floor`` to int64 fixed point, costs rounded to integer
nanoseconds half to even (``torch.round``), exact int64 sums in any order (so the atomic adds of the grid
give the same sums whichever program lands first), one float64 division a rate, and the first maximum or
minimum on ties; the exponents are powers of two, so scaling a log-probability is exact in any order.
``tests/gpu/test_decide_triton.py`` checks it against the tensor version and the plain-Python reference on
random rounds and on the edge cases (dead rows, -inf nodes, tied rates, capped depths); under Triton's
interpreter (CPU) the ``exp`` is NumPy's, which may differ by one float64 ulp.

Shapes are static per graph: the pool's per-depth sizes must grow by the same step (the dynamic tree holds
``k`` nodes at depth 1 and adds all ``k * k`` children of its frontier a depth, the chain one node), which the
wrapper checks; anything else goes to the tensor version.

**Compiled once a table, in seconds.** The batch and the drafted depths are runtime values (the grid's size
and loop bounds), so the code is one row chunk's (at most ``ROW_CHUNK`` rows and ``CHUNK_NODES`` nodes) and
one job's whatever the round. A first version unrolled the depths and sorted every row at once: at batch 64
and 5 depths one variant took ~53 s to compile (5 MB of PTX) and an engine met dozens while it warmed its
graphs. ``tools/bench_decide_compile.py`` compiles every variant of a table ahead of time and reports it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from torchspec.runtime.calibration import ALPHAS, Calibration
from torchspec.runtime.controller_policy import NS_PER_MS, PROB_ONE, RANK_BUCKETS, SCALE_ONE, RoundPlan
from torchspec.runtime.plan_averages import SHIFT

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROW_CHUNK = 8  # rows a program at most (the code is one chunk's: compiled in seconds at any batch)
CHUNK_NODES = 512  # at most this many pool nodes a chunk: a k=8 tree's 6-depth pool (512 columns) goes a row a program
_PROB_ONE, _SCALE_ONE, _NS_PER_MS = tl.constexpr(PROB_ONE), tl.constexpr(SCALE_ONE), tl.constexpr(NS_PER_MS)  # in kernels


@triton.jit
def _exp64(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.exp(x)  # CUDA's double exp (torch.exp's on the GPU)
    return tl.exp(x)  # the interpreter's (NumPy)


@triton.jit
def _rint(y):
    """float64 -> int64, half to even (``torch.round``); exact for |y| < 2**52."""
    f = tl.floor(y)
    frac = y - f
    even = (f - 2.0 * tl.floor(f * 0.5)) == 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & ~even), f + 1.0, f).to(tl.int64)


@triton.jit
def _ranked_units(logp, keep, EXACT: tl.constexpr):
    """A chunk of rows' path log-probabilities [RB, BG] -> their probabilities in fixed point, each row sorted
    descending, summed over the rows [BG] (exact int64); ``keep`` False: 0."""
    units = tl.where(keep, tl.floor(_exp64(logp, EXACT) * _PROB_ONE).to(tl.int64), 0)
    return tl.sum(tl.sort(units, dim=1, descending=True), axis=0)


@triton.jit
def _bucket_of(n, R: tl.constexpr):
    """``controller_policy.bucket_of``: a rank's bucket (1, 2-3, 4-7, ...; the last takes the rest)."""
    bucket = tl.zeros_like(n)
    for i in tl.static_range(R - 1):
        bucket += (n >= (2 << i) - 1).to(bucket.dtype)
    return bucket


@triton.jit
def _best_width(per_rank, rank_scale, live_units, drafted_ns, verify_ns, size, NMAX, n):
    """One pool's rates: the n-th best node of every row summed, per_rank [BG] int64, times its rank's scale
    (units of SCALE_ONE) -> (best rate, its width, the unscaled expected drafted tokens of every width [BG]);
    widths up to the pool's ``size`` and ``NMAX``."""
    unscaled = tl.cumsum(per_rank, axis=0) - per_rank  # width n: the n best of every row
    weighted = per_rank * rank_scale
    tokens = live_units + (tl.cumsum(weighted, axis=0) - weighted) // _SCALE_ONE
    cost = tl.where(n == 0, verify_ns, drafted_ns + verify_ns)  # width 0: a plain round, which drafts nothing
    rate = tokens.to(tl.float64) / cost.to(tl.float64)
    rate = tl.where((n <= size) & (n <= NMAX), rate, -1.0)
    best = tl.max(rate, axis=0)
    width = tl.min(tl.where(rate == best, n, 1 << 30), axis=0)  # the first maximum: ties to the smaller width
    return best, width, unscaled


@triton.jit
def _choice(accepted_ptr, accepted_rank_ptr, expected_ptr, limits_ptr, alphas_ptr,
            A: tl.constexpr, R: tl.constexpr, BA: tl.constexpr, BR: tl.constexpr):
    """``Calibration.choice()`` -> (the exponent whose decayed expectation is nearest the accepted tokens, each
    rank bucket's scale [BR] in SCALE_ONE units)."""
    a_idx = tl.arange(0, BA)
    r_idx = tl.arange(0, BR)
    alphas = tl.load(alphas_ptr + a_idx, mask=a_idx < A, other=1.0)
    prior = tl.load(limits_ptr)
    # expected_ptr: Calibration.expected_block [A, R + 1], each exponent's expectation by rank bucket, then all
    total = tl.load(expected_ptr + a_idx * (R + 1) + R, mask=a_idx < A, other=0.0)
    ratio = (tl.load(accepted_ptr) + prior) / (total + prior)
    off = tl.where(a_idx < A, tl.maximum(ratio, 1.0 / ratio), float("inf"))
    at = tl.min(tl.where(off == tl.min(off, axis=0), a_idx, BA), axis=0)  # the first minimum
    alpha = tl.sum(tl.where(a_idx == at, alphas, 0.0), axis=0)
    expected_at = tl.load(expected_ptr + at * (R + 1) + r_idx, mask=r_idx < R, other=0.0)  # [BR]
    overall = tl.sum(tl.where(a_idx == at, ratio, 0.0), axis=0)  # a bucket without evidence: scaled as all
    by_rank = (tl.load(accepted_rank_ptr + r_idx, mask=r_idx < R, other=0.0) + prior * overall) / (expected_at + prior)
    return alpha, _rint(tl.minimum(by_rank, tl.load(limits_ptr + 1)) * _SCALE_ONE)


@triton.jit
def _rank_sums_kernel(
    pool_ptr, front_ptr, edge_ptr, valid_ptr,
    accepted_ptr, accepted_rank_ptr, expected_ptr, limits_ptr, alphas_ptr, sums_ptr,
    B, P, F, FIRST, STEP, VERIFIED, D,  # runtime: one compiled kernel serves every batch, depth and table
    A: tl.constexpr, R: tl.constexpr, CALIBRATED: tl.constexpr, EXACT: tl.constexpr,
    RB: tl.constexpr, BG: tl.constexpr, BT: tl.constexpr, BA: tl.constexpr, BR: tl.constexpr,
    AVERAGED: tl.constexpr, SHIFT: tl.constexpr,  # the plan kernel's (one variant's arguments for both)
):
    """Pass 1, program (c, j): rows c*RB.. of the batch, each sorted, summed by rank into ``sums`` (int64, zeroed;
    exact in any order). j < D: depth j's pool; D <= j < 2D: depth j-D's pool and its predicted children;
    j == 2D (calibrated only): the calibration's evidence, the verified best under every exponent by bucket."""
    r2 = (tl.program_id(0) * RB + tl.arange(0, RB))[:, None]
    n = tl.arange(0, BG)  # a pool column, and a rank
    c2 = n[None, :]
    j = tl.program_id(1)
    live = tl.load(valid_ptr + r2, mask=r2 < B, other=0) != 0
    raw = tl.load(pool_ptr + r2 * P + c2, mask=(r2 < B) & (c2 < P), other=float("-inf")).to(tl.float64)
    if j < 2 * D:
        if CALIBRATED:
            alpha, _scales = _choice(accepted_ptr, accepted_rank_ptr, expected_ptr, limits_ptr, alphas_ptr, A, R, BA, BR)
        else:
            alpha = 1.0
        t = j % D
        child_at = c2 - P
        at_child = (j >= D) & (r2 < B) & (child_at >= 0) & (child_at < F)  # each frontier path + its best edge
        front = tl.load(front_ptr + t * B * F + r2 * F + child_at, mask=at_child, other=float("-inf"))
        edge = tl.load(edge_ptr + t * B * F + r2 * F + child_at, mask=at_child, other=0.0)
        logp = tl.where(c2 < P, raw, front.to(tl.float64) + edge.to(tl.float64)) * alpha  # as the calibration reads it
        ranked = _ranked_units(logp, live & ((c2 < FIRST + STEP * t) | at_child), EXACT)
        tl.atomic_add(sums_ptr + j * BG + n, ranked, sem="relaxed")
    else:
        a_idx = tl.arange(0, BA)
        r_idx = tl.arange(0, BR)
        at_bucket = _bucket_of(n, R)[:, None] == r_idx[None, :]  # [BG, BR] rank n's bucket
        ranked_raw = tl.sort(raw, dim=1, descending=True)
        evidence = tl.zeros([BA, BR], tl.int64)
        for a in tl.static_range(A):  # Calibration.evidence(): under every exponent, by rank bucket
            units = tl.floor(_exp64(ranked_raw * tl.load(alphas_ptr + a), EXACT) * _PROB_ONE).to(tl.int64)
            per_rank = tl.sum(tl.where(live & (c2 < VERIFIED), units, 0), axis=0)  # [BG]
            part = tl.sum(tl.where(at_bucket, per_rank[:, None], 0), axis=0)  # [BR]
            evidence += tl.where(a_idx[:, None] == a, part[None, :], 0)
        tl.atomic_add(sums_ptr + 2 * D * BG + a_idx[:, None] * BR + r_idx[None, :], evidence, sem="relaxed")


@triton.jit
def _plan_kernel(
    valid_ptr, depth_ms_ptr, verify_ms_ptr, accepted_ptr, accepted_rank_ptr, expected_ptr, limits_ptr, alphas_ptr,
    sums_ptr, go_ptr, width_ptr, ints_ptr, pending_ptr, estimates_ptr, averages_ptr,
    B, F, T, NMAX, FIRST, STEP, VERIFIED, D,
    A: tl.constexpr, R: tl.constexpr, CALIBRATED: tl.constexpr, EXACT: tl.constexpr,
    RB: tl.constexpr, BG: tl.constexpr, BT: tl.constexpr, BA: tl.constexpr, BR: tl.constexpr,
    AVERAGED: tl.constexpr, SHIFT: tl.constexpr,
):
    """Pass 2, one program: from the batch's rank sums, every depth's rates, go flag and width, the next
    round's plan, the round's estimates per live row (AVERAGED: folded into the averaged table, which then
    plans), and the calibration's pending evidence."""
    n = tl.arange(0, BG)  # a rank, and a width
    chunk = tl.arange(0, RB)
    live = tl.zeros([], tl.int64)
    for r0 in range(0, B, RB):  # every live row emits the target's token
        rows = r0 + chunk
        live += tl.sum((tl.load(valid_ptr + rows, mask=rows < B, other=0) != 0).to(tl.int64), axis=0)
    live_units = live * _PROB_ONE
    if CALIBRATED:
        a_idx = tl.arange(0, BA)
        r_idx = tl.arange(0, BR)
        _alpha, scales = _choice(accepted_ptr, accepted_rank_ptr, expected_ptr, limits_ptr, alphas_ptr, A, R, BA, BR)
        rank_scale = tl.sum(tl.where(_bucket_of(n, R)[:, None] == r_idx[None, :], scales[None, :], 0), axis=1)
        # pending [A, R + 1]: by bucket, then the total (exact integer sums, as Calibration.evidence)
        evidence = tl.load(sums_ptr + 2 * D * BG + a_idx[:, None] * BR + r_idx[None, :])
        tl.store(pending_ptr + a_idx[:, None] * (R + 1) + r_idx[None, :], evidence.to(tl.float64) / _PROB_ONE,
                 mask=(a_idx[:, None] < A) & (r_idx[None, :] < R))
        tl.store(pending_ptr + a_idx * (R + 1) + R, tl.sum(evidence, axis=1).to(tl.float64) / _PROB_ONE,
                 mask=a_idx < A)
    else:
        rank_scale = tl.full([BG], _SCALE_ONE, tl.int64)
    t_idx = tl.arange(0, BT)
    depth_ns = _rint(tl.load(depth_ms_ptr + t_idx, mask=t_idx < T, other=0.0).to(tl.float64) * _NS_PER_MS)
    depth_ns = tl.where(t_idx < T, depth_ns, 0)
    verify_ns = _rint(tl.load(verify_ms_ptr + n, mask=n <= NMAX, other=1.0).to(tl.float64) * _NS_PER_MS)
    best_rate = tl.full([], -2.0, tl.float64)
    best_depth = tl.zeros([], tl.int32)
    best_width = tl.zeros([], tl.int32)
    deeper = tl.full([], -2.0, tl.float64)
    deeper_width = tl.zeros([], tl.int32)
    unscaled = tl.zeros([BG], tl.int64)
    for t in range(D):
        size = FIRST + STEP * t
        current = tl.load(sums_ptr + t * BG + n)  # each rank's node summed over the rows: the pool of depths 0..t
        grown = tl.load(sums_ptr + (D + t) * BG + n)  # ... and with each frontier node's predicted child
        drafted_ns = tl.sum(tl.where(t_idx <= t, depth_ns, 0), axis=0)  # depths 0..t
        rate, width, unscaled = _best_width(current, rank_scale, live_units, drafted_ns, verify_ns, size, NMAX, n)
        deeper_ns = tl.sum(tl.where(t_idx <= t + 1, depth_ns, 0), axis=0)  # depths 0..t+1 (0 beyond the table)
        deeper, deeper_width, _ = _best_width(grown, rank_scale, live_units, deeper_ns, verify_ns, size + F, NMAX,
                                              n)
        tl.store(go_ptr + t, (deeper > rate) & (t + 1 < T))  # the table's last depth never goes deeper
        tl.store(width_ptr + t, width)
        better = rate > best_rate  # strict: a tie keeps the shallower round
        best_depth = tl.where(better, t + 1, best_depth)
        best_width = tl.where(better, width, best_width)
        best_rate = tl.where(better, rate, best_rate)
    more = (deeper > best_rate) & (D < T)  # one more depth than drafted (within the table), its children predicted
    best_depth = tl.where(more, D + 1, best_depth)
    best_width = tl.where(more, deeper_width, best_width)
    avg_rate = tl.full([], -2.0, tl.float64)
    probe_rate = tl.full([], -2.0, tl.float64)
    probe_depth = best_depth  # a plan from this round alone: a probe is the plan itself (controlled_drafting probes)
    probe_width = best_width
    for c in range(T):  # plan_averages: the round's estimates per live row (c < D: drafted; c == D: one more)
        summed = tl.load(sums_ptr + tl.where(c < D, c, 2 * D - 1) * BG + n)
        weighted = summed * rank_scale
        tokens = live_units + (tl.cumsum(weighted, axis=0) - weighted) // _SCALE_ONE
        size = tl.where(c < D, FIRST + STEP * c, FIRST + STEP * (D - 1) + F)
        rated = (c <= D) & (n <= size) & (n <= NMAX) & (live > 0)
        estimate = tl.where(rated, tokens // tl.maximum(live, 1), -1)
        tl.store(estimates_ptr + c * (NMAX + 1) + n, estimate, mask=n <= NMAX)
        if AVERAGED:  # fold, then rate every entry ever rated; the first maximum (shallower, then narrower) plans
            old = tl.load(averages_ptr + c * (NMAX + 1) + n, mask=n <= NMAX, other=-1)
            mixed = old - (old >> SHIFT) + (estimate >> SHIFT)
            new = tl.where(estimate >= 0, tl.where(old >= 0, mixed, estimate), old)
            tl.store(averages_ptr + c * (NMAX + 1) + n, new, mask=n <= NMAX)
            drafted_ns = tl.sum(tl.where(t_idx <= c, depth_ns, 0), axis=0)
            cost = tl.where(n == 0, verify_ns, drafted_ns + verify_ns)
            rate = tl.where((new >= 0) & (n <= NMAX), new.to(tl.float64) / cost.to(tl.float64), -1.0)
            top = tl.max(rate, axis=0)
            better = top > avg_rate
            best_depth = tl.where(better, c + 1, best_depth)
            best_width = tl.where(better, tl.min(tl.where(rate == top, n, 1 << 30), axis=0), best_width)
            avg_rate = tl.where(better, top, avg_rate)
            verifying = tl.where(n >= 1, rate, -1.0)  # the probe: the best entry that verifies
            top = tl.max(verifying, axis=0)
            better = top > probe_rate
            probe_depth = tl.where(better, c + 1, probe_depth)
            probe_width = tl.where(better, tl.min(tl.where(verifying == top, n, 1 << 30), axis=0), probe_width)
            probe_rate = tl.where(better, top, probe_rate)
    tl.store(ints_ptr + 3, probe_depth.to(tl.int64))
    tl.store(ints_ptr + 4, probe_width.to(tl.int64))
    tl.store(ints_ptr, best_depth.to(tl.int64))
    tl.store(ints_ptr + 1, best_width.to(tl.int64))
    tl.store(ints_ptr + 2, tl.sum(tl.where(n == VERIFIED, unscaled, 0), axis=0))  # the last depth's; width 0: nothing


KERNELS = {"rank_sums": _rank_sums_kernel, "plan": _plan_kernel}  # what a variant compiles (bench_decide_compile)


def fused_sizes(sizes: list[int]) -> tuple[int, int] | None:
    """(first, step) when the per-depth pool sizes grow by one step (the dynamic tree, the chain), else None."""
    step = sizes[1] - sizes[0] if len(sizes) > 1 else 1
    if step < 1 or any(s != sizes[0] + step * t for t, s in enumerate(sizes)):
        return None
    return sizes[0], step


def kernel_variant(batch: int, first_step: tuple[int, int], frontier: int, table_depths: int,
                   calibrated: bool, averaged: bool = False, widths: int = 0) -> dict:
    """The kernels' compile-time arguments for a round (what a compiled variant is keyed by): the row chunk (the
    batch's power of two, at most ``ROW_CHUNK`` rows and ``CHUNK_NODES`` nodes) and blocks wide enough for the
    table's deepest pool and its children (widths past a pool's size are never rated, but the round's estimates
    and an averaged table cover every one of the table's verify ``widths``: a runtime table has no more), the
    table's depths (at least 8) and the exponents, and whether plans come from the averaged table
    (``plan_averages``; as ``TORCHSPEC_CONTROLLER_PLANS`` says, on by default) -- one variant per row chunk and
    calibration a table, whatever the round's depth or batch."""
    first, step = first_step
    columns = triton.next_power_of_2(max(first + step * (table_depths - 1) + frontier + 1, widths))
    rows = min(triton.next_power_of_2(batch), ROW_CHUNK, max(1, CHUNK_NODES // columns))
    return dict(A=len(ALPHAS), R=RANK_BUCKETS, CALIBRATED=calibrated, EXACT=not INTERPRET, RB=rows, BG=columns,
                BT=max(8, triton.next_power_of_2(table_depths)), BA=triton.next_power_of_2(len(ALPHAS)),
                BR=triton.next_power_of_2(RANK_BUCKETS), AVERAGED=averaged, SHIFT=SHIFT, num_warps=4)


def decide_every_depth_fused(pool_logp: torch.Tensor, sizes: list[int], front_logp: torch.Tensor,
                             edge_logp: torch.Tensor, depth_ms: torch.Tensor, verify_ms: torch.Tensor,
                             row_valid: torch.Tensor, calibration: Calibration | None,
                             verified: int, averages: torch.Tensor | None = None
                             ) -> tuple[RoundPlan, torch.Tensor | None]:
    """In two launches (module docstring): with ``alpha, scale = calibration.choice()``, ``decide_every_depth(pool_logp.double() * alpha,
    sizes, (front_logp.double() + edge_logp.double()) * alpha, depth_ms, verify_ms, row_valid, scale, verified)``
    and ``calibration.evidence(pool_logp, verified, row_valid)`` -> (the RoundPlan, that evidence [A, R + 1]);
    ``calibration`` None: the confidence as is (exponent 1, no scale; evidence None). front_logp / edge_logp
    [D, B, F]: each depth's frontier paths and their best edges. Sizes must grow by one step (``fused_sizes``);
    shapes are checked as the tensor version checks them. ``averages`` [T, N_max + 1] int64 (``plan_averages``):
    the round's estimates are folded into it in place and the plan is the table's (``fold``, ``plan_from``)."""
    d, (b, p) = len(sizes), pool_logp.shape
    f = front_logp.shape[-1]
    t, n_max, dev = depth_ms.shape[0], verify_ms.shape[0] - 1, pool_logp.device
    first_step = fused_sizes(sizes)
    if (first_step is None or front_logp.shape != (d, b, f) or edge_logp.shape != (d, b, f) or sizes[-1] != p
            or d > t or not 0 <= verified <= min(n_max, p)
            or (averages is not None and (averages.shape != (t, n_max + 1) or averages.dtype != torch.long))):
        raise ValueError(f"decide_every_depth_fused: sizes {sizes} (one step a depth, up to the pool's {p} nodes), "
                         f"frontier {tuple(front_logp.shape)} and edges {tuple(edge_logp.shape)} ([{d}, {b}, F]), "
                         f"{t} table depths (>= {d}), verified={verified} (<= {min(n_max, p)}) and averages "
                         f"(int64 [{t}, {n_max + 1}] or None) do not fit; use decide_every_depth.")
    go = torch.empty(d, dtype=torch.bool, device=dev)
    width = torch.empty(d, dtype=torch.long, device=dev)
    ints = torch.empty(5, dtype=torch.long, device=dev)  # next depth, next width, drafted, probe depth, probe width
    estimates = torch.empty(t, n_max + 1, dtype=torch.long, device=dev)
    a = len(ALPHAS)
    pending = torch.empty(a, RANK_BUCKETS + 1, dtype=torch.float64, device=dev)
    cal = calibration
    meta = kernel_variant(b, first_step, f, t, cal is not None, averages is not None, n_max + 1)
    state = ((cal.accepted, cal.accepted_by_rank, cal.expected_block, cal.limits, cal.alphas) if cal is not None
             else (pending,) * 5)
    jobs = 2 * d + (cal is not None)  # each depth's pool, each with its children, the calibration's evidence
    sums = torch.zeros(2 * d * meta["BG"] + meta["BA"] * meta["BR"], dtype=torch.long, device=dev)
    _rank_sums_kernel[(triton.cdiv(b, meta["RB"]), jobs)](
        pool_logp.contiguous(), front_logp.contiguous(), edge_logp.contiguous(), row_valid, *state, sums,
        b, p, f, first_step[0], first_step[1], verified, d, **meta)
    _plan_kernel[(1,)](
        row_valid, depth_ms, verify_ms, *state, sums, go, width, ints, pending, estimates,
        estimates if averages is None else averages, b, f, t, n_max, first_step[0], first_step[1], verified, d, **meta)
    return RoundPlan(go, width, ints[0], ints[1], ints[2], estimates, ints[3], ints[4]), pending if cal is not None else None


__all__ = ["decide_every_depth_fused", "fused_sizes", "kernel_variant", "KERNELS"]
