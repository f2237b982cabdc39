"""The draft controller's decision after a round, in one Triton kernel (ahead mode, on the GPU).

``controller_policy.decide_every_depth`` evaluates the criterion after each of a round's D drafted depths and
plans the next round in ~60 tensor operations (~110 counted on the tiny pair, ``tools/count_round_ops.py``):
inside a CUDA graph each is a launch of a few microseconds, so at SmolLM2's size deciding cost about as much
GPU time as a draft depth (on an H200, 190-236 us a decision against 7-35 us fused at batch 1-8,
``tools/bench_controller_decide.py``). ``decide_every_depth_fused`` does it in one program: the calibration's
choice (``Calibration.choice``: the exponent whose decayed expectation is nearest the accepted tokens, and
the remaining scale of each rank bucket), every drafted node's probability in fixed point (its path log-probability times that
exponent), each depth's pool (and its predicted children: frontier path plus best edge) sorted per row and
summed over the live rows and weighted by its rank's scale, the expected tokens of every width, their rates
against the costs, the go flags, the chosen widths, the next round's (depth, width), and the calibration's
evidence (``Calibration.evidence``: the verified nodes' expectation under every exponent, by rank bucket).

**The same decisions bit for bit.** Every step is the tensor version's arithmetic in the same types: float64
``exp`` (libdevice's, which CUDA's own ``exp`` is), ``floor`` to int64 fixed point, costs rounded to integer
nanoseconds half to even (``torch.round``), exact int64 sums in any order, one float64 division a rate, and
the first maximum or minimum on ties; the exponents are powers of two, so scaling a log-probability is exact
in any order. ``tests/gpu/test_decide_triton.py`` checks it against the tensor version and the
plain-Python reference on random rounds and on the edge cases (dead rows, -inf nodes, tied rates, capped
depths); under Triton's interpreter (CPU) the ``exp`` is NumPy's, which may differ by one float64 ulp.

Shapes are static per graph: the pool's per-depth sizes must grow by the same step (the dynamic tree holds
``k`` nodes at depth 1 and adds all ``k * k`` children of its frontier a depth, the chain one node), which the
wrapper checks; anything else goes to the tensor version.

**Compiled once a table, in seconds.** The batch and the drafted depths are runtime values: rows go through
a chunk at a time (at most ``ROW_CHUNK`` rows and ``CHUNK_NODES`` nodes) and depths one a loop step, so the code
is one chunk's and one depth's whatever the round. The first version unrolled the depths and sorted every row
at once: at batch 64 and 5 depths one variant took ~53 s to compile even at 64 columns (5 MB of PTX;
``triton.compile`` for sm_90 on a 2-core CPU; a real k=8 pool needs 512), an engine met dozens while it warmed
its graphs, and a call on the H200 spent its 10 minutes compiling. Now a k=8 tree's table compiles 4 variants
of 2.6-6.8 s, the chain's 8 of about a second (``tools/bench_decide_compile.py``). The price is a serial row
loop: at batch 64 a decision takes 75-217 us (1-5 depths, H200) against 46-135 us unrolled, on the bench's
rounds of k nodes a depth (the real pool is k + k*k a depth: not yet timed).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from torchspec.runtime.calibration import ALPHAS, Calibration
from torchspec.runtime.controller_policy import NS_PER_MS, PROB_ONE, RANK_BUCKETS, SCALE_ONE, RoundPlan

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROW_CHUNK = 8  # rows a step of the kernel's row loop (its code is one chunk's: compiled in seconds at any batch)
CHUNK_NODES = 1024  # at most this many pool nodes a chunk: a k=8 tree's 6-depth pool (512 columns) goes 2 rows a step
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
def _decide_kernel(
    pool_ptr, front_ptr, edge_ptr, depth_ms_ptr, verify_ms_ptr, valid_ptr,
    accepted_ptr, accepted_rank_ptr, expected_ptr, limits_ptr, alphas_ptr,
    go_ptr, width_ptr, ints_ptr, pending_ptr,
    B, P, F, T, NMAX, FIRST, STEP, VERIFIED, D,  # runtime: one compiled kernel serves every batch, depth and table
    A: tl.constexpr, R: tl.constexpr, CALIBRATED: tl.constexpr, EXACT: tl.constexpr,
    RB: tl.constexpr, BG: tl.constexpr, BT: tl.constexpr, BA: tl.constexpr, BR: tl.constexpr,
):
    # Rows go RB at a time (a runtime loop: the code is one chunk's, whatever the batch), depths one at a time.
    chunk = tl.arange(0, RB)
    n = tl.arange(0, BG)  # a pool column, and a width
    c2 = n[None, :]
    a_idx = tl.arange(0, BA)
    r_idx = tl.arange(0, BR)
    at_bucket = _bucket_of(n, R)[:, None] == r_idx[None, :]  # [BG, BR] rank n's bucket
    live_units = tl.zeros([], tl.int64)
    for r0 in range(0, B, RB):  # every live row emits the target's token
        rows = r0 + chunk
        live_units += tl.sum((tl.load(valid_ptr + rows, mask=rows < B, other=0) != 0).to(tl.int64), axis=0)
    live_units = live_units * _PROB_ONE
    if CALIBRATED:  # Calibration.choice(): the exponent whose expectation is nearest, then each rank bucket's scale
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
        scales = _rint(tl.minimum(by_rank, tl.load(limits_ptr + 1)) * _SCALE_ONE)  # [BR]
        rank_scale = tl.sum(tl.where(at_bucket, scales[None, :], 0), axis=1)  # [BG]
        evidence = tl.zeros([BA, BR], tl.int64)  # Calibration.evidence(): the verified best of each row ...
        for r0 in range(0, B, RB):
            r2 = (r0 + chunk)[:, None]
            live = tl.load(valid_ptr + r2, mask=r2 < B, other=0) != 0
            ranked_raw = tl.sort(tl.load(pool_ptr + r2 * P + c2, mask=(r2 < B) & (c2 < P), other=float("-inf"))
                                 .to(tl.float64), dim=1, descending=True)
            for a in tl.static_range(A):  # ... under every exponent, by rank bucket
                units = tl.floor(_exp64(ranked_raw * tl.load(alphas_ptr + a), EXACT) * _PROB_ONE).to(tl.int64)
                per_rank = tl.sum(tl.where(live & (c2 < VERIFIED), units, 0), axis=0)  # [BG]
                part = tl.sum(tl.where(at_bucket, per_rank[:, None], 0), axis=0)  # [BR]
                evidence += tl.where(a_idx[:, None] == a, part[None, :], 0)
        # pending [A, R + 1]: by bucket, then the total (exact integer sums, as Calibration.evidence)
        ev = evidence.to(tl.float64) / _PROB_ONE
        tl.store(pending_ptr + a_idx[:, None] * (R + 1) + r_idx[None, :], ev, mask=(a_idx[:, None] < A) & (r_idx[None, :] < R))
        tl.store(pending_ptr + a_idx * (R + 1) + R, tl.sum(evidence, axis=1).to(tl.float64) / _PROB_ONE, mask=a_idx < A)
    else:
        alpha = 1.0
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
        current = tl.zeros([BG], tl.int64)  # each rank's node summed over the rows: the pool of depths 0..t ...
        grown = tl.zeros([BG], tl.int64)  # ... and with each frontier node's predicted child (path + best edge)
        for r0 in range(0, B, RB):
            r2 = (r0 + chunk)[:, None]
            live = tl.load(valid_ptr + r2, mask=r2 < B, other=0) != 0
            logp = tl.load(pool_ptr + r2 * P + c2, mask=(r2 < B) & (c2 < P), other=float("-inf")).to(tl.float64)
            logp = logp * alpha  # every path log-probability as the calibration reads it
            child_at = c2 - P
            at_child = (r2 < B) & (child_at >= 0) & (child_at < F)
            front = tl.load(front_ptr + t * B * F + r2 * F + child_at, mask=at_child, other=float("-inf"))
            edge = tl.load(edge_ptr + t * B * F + r2 * F + child_at, mask=at_child, other=0.0)
            child = (front.to(tl.float64) + edge.to(tl.float64)) * alpha
            current += _ranked_units(logp, live & (c2 < size), EXACT)
            grown += _ranked_units(tl.where(c2 < P, logp, child), live & ((c2 < size) | ((child_at >= 0) & (child_at < F))), EXACT)
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
    tl.store(ints_ptr, best_depth.to(tl.int64))
    tl.store(ints_ptr + 1, best_width.to(tl.int64))
    tl.store(ints_ptr + 2, tl.sum(tl.where(n == VERIFIED, unscaled, 0), axis=0))  # the last depth's; width 0: nothing


def fused_sizes(sizes: list[int]) -> tuple[int, int] | None:
    """(first, step) when the per-depth pool sizes grow by one step (the dynamic tree, the chain), else None."""
    step = sizes[1] - sizes[0] if len(sizes) > 1 else 1
    if step < 1 or any(s != sizes[0] + step * t for t, s in enumerate(sizes)):
        return None
    return sizes[0], step


def kernel_variant(batch: int, first_step: tuple[int, int], frontier: int, table_depths: int,
                   calibrated: bool) -> dict:
    """The kernel's compile-time arguments for a round (what a compiled variant is keyed by): the row chunk (the
    batch's power of two, at most ``ROW_CHUNK`` rows and ``CHUNK_NODES`` nodes) and blocks wide enough for the
    table's deepest pool and its children (widths past a pool's size are never chosen, so the table's verify
    widths need none), the table's depths (at least 8) and the exponents -- one variant per row chunk and
    calibration a table, whatever the round's depth or batch."""
    first, step = first_step
    columns = triton.next_power_of_2(first + step * (table_depths - 1) + frontier + 1)
    rows = min(triton.next_power_of_2(batch), ROW_CHUNK, max(1, CHUNK_NODES // columns))
    return dict(A=len(ALPHAS), R=RANK_BUCKETS, CALIBRATED=calibrated, EXACT=not INTERPRET, RB=rows, BG=columns,
                BT=max(8, triton.next_power_of_2(table_depths)), BA=triton.next_power_of_2(len(ALPHAS)),
                BR=triton.next_power_of_2(RANK_BUCKETS), num_warps=4)


def decide_every_depth_fused(pool_logp: torch.Tensor, sizes: list[int], front_logp: torch.Tensor,
                             edge_logp: torch.Tensor, depth_ms: torch.Tensor, verify_ms: torch.Tensor,
                             row_valid: torch.Tensor, calibration: Calibration | None,
                             verified: int) -> tuple[RoundPlan, torch.Tensor | None]:
    """In one launch: with ``alpha, scale = calibration.choice()``, ``decide_every_depth(pool_logp.double() * alpha,
    sizes, (front_logp.double() + edge_logp.double()) * alpha, depth_ms, verify_ms, row_valid, scale, verified)``
    and ``calibration.evidence(pool_logp, verified, row_valid)`` -> (the RoundPlan, that evidence [A, R + 1]);
    ``calibration`` None: the confidence as is (exponent 1, no scale; evidence None). front_logp / edge_logp
    [D, B, F]: each depth's frontier paths and their best edges. Sizes must grow by one step (``fused_sizes``);
    shapes are checked as the tensor version checks them."""
    d, (b, p) = len(sizes), pool_logp.shape
    f = front_logp.shape[-1]
    t, n_max, dev = depth_ms.shape[0], verify_ms.shape[0] - 1, pool_logp.device
    first_step = fused_sizes(sizes)
    if (first_step is None or front_logp.shape != (d, b, f) or edge_logp.shape != (d, b, f) or sizes[-1] != p
            or d > t or not 0 <= verified <= min(n_max, p)):
        raise ValueError(f"decide_every_depth_fused: sizes {sizes} (one step a depth, up to the pool's {p} nodes), "
                         f"frontier {tuple(front_logp.shape)} and edges {tuple(edge_logp.shape)} ([{d}, {b}, F]), "
                         f"{t} table depths (>= {d}) and verified={verified} (<= {min(n_max, p)}) do not fit; use "
                         f"decide_every_depth.")
    go = torch.empty(d, dtype=torch.bool, device=dev)
    width = torch.empty(d, dtype=torch.long, device=dev)
    ints = torch.empty(3, dtype=torch.long, device=dev)  # next depth, next width, drafted
    a = len(ALPHAS)
    pending = torch.empty(a, RANK_BUCKETS + 1, dtype=torch.float64, device=dev)
    cal = calibration
    _decide_kernel[(1,)](
        pool_logp.contiguous(), front_logp.contiguous(), edge_logp.contiguous(), depth_ms, verify_ms, row_valid,
        *((cal.accepted, cal.accepted_by_rank, cal.expected_block, cal.limits, cal.alphas)
          if cal is not None else (pending,) * 5),
        go, width, ints, pending,
        b, p, f, t, n_max, first_step[0], first_step[1], verified, d,
        **kernel_variant(b, first_step, f, t, cal is not None),
    )
    return RoundPlan(go, width, ints[0], ints[1], ints[2]), pending if cal is not None else None


__all__ = ["decide_every_depth_fused", "fused_sizes", "kernel_variant"]
