"""The fused decision kernel (``decide_triton.decide_every_depth_fused``) decides as the tensor version and the reference.

Runs on CUDA, or on CPU under Triton's interpreter (``TRITON_INTERPRET=1`` with triton importable; the CPU torch
wheel has none), e.g.

    PYTHONPATH=<dir holding triton> TRITON_INTERPRET=1 python -m pytest --noconftest -q tests/gpu/test_decide_triton.py

Random rounds (trees and chains, 1-64 rows, dead rows, tables as deep as the round or deeper, calibrated by a
Calibration's decayed sums -- any exponent and scale per rank bucket -- or not, every verified width) and edge cases (-inf
nodes, tied rates, every row dead, a width-0 table, the smallest exponent): the go flags, widths, the next
round's plan and the verified nodes' expectation equal ``controller_policy.decide_every_depth`` on the
path log-probabilities times the calibration's exponent (``Calibration.choice()``) and
``reference_next_plan`` bit for bit, and the calibration's evidence ``Calibration.evidence``; with an averaged plan
table (``plan_averages``, half the random rounds and every edge case), the round's estimates, the table folded in
place and the plan from it equal ``fold`` / ``plan_from`` and their references.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA, or TRITON_INTERPRET=1 with triton")
DEV = torch.device("cuda" if CUDA else "cpu")

if INTERPRET and not CUDA:  # the interpreter reads a loop bound (a runtime scalar, one-element array) with int(),
    from triton.runtime import interpreter  # which NumPy 2 refuses for arrays of one dimension

    def _patch_lang_tensor(tensor, _patch=interpreter._patch_lang_tensor):
        _patch(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    interpreter._patch_lang_tensor = _patch_lang_tensor


def _calibration(gen: torch.Generator, accepted: float | None = None):
    """Random decayed evidence (expectations rising as the exponent falls, as they do): any exponent, any scale."""
    from torchspec.runtime.calibration import ALPHAS, Calibration

    cal = Calibration(DEV)
    cal.accepted.fill_(float(torch.rand(1, generator=gen)) * 6 if accepted is None else accepted)
    cal.expected.copy_(torch.sort(torch.rand(len(ALPHAS), generator=gen, dtype=torch.float64) * 6).values)
    shape = cal.expected_by_rank.shape  # and by rank bucket: any scale per bucket, some without evidence
    cal.accepted_by_rank.copy_(torch.rand(shape[1], generator=gen, dtype=torch.float64) * 3)
    cal.expected_by_rank.copy_(torch.sort(torch.rand(shape, generator=gen, dtype=torch.float64) * 3, dim=0).values
                               * (torch.rand(shape[1], generator=gen) < 0.8))
    return cal


def _round(gen: torch.Generator, i: int, rows: int, k: int, drafted: int, sharp: float):
    from test_controller_policy import draft_scores

    pools, fronts, edges, sizes, each_pool = None, [], [], [], []
    for depth in range(drafted):  # depth d's tree is the prefix of the next one's (the same seed)
        pool, front, edge = draft_scores(torch.Generator().manual_seed(i), rows, k, depth, 50, sharp)
        each_pool.append(pool.tolist())
        fronts.append(front)
        edges.append(edge)
        sizes.append(pool.shape[1])
        pools = pool
    return pools, sizes, torch.stack(fronts), torch.stack(edges), each_pool, front, edge


def _averages(gen: torch.Generator, depths: int, widths: int) -> torch.Tensor:
    """A random averaged plan table (``plan_averages``): 1 to 8 tokens a row, a third of the entries never rated."""
    from torchspec.runtime.controller_policy import PROB_ONE

    table = torch.randint(PROB_ONE, 8 * PROB_ONE, (depths, widths), generator=gen)
    return torch.where(torch.rand(depths, widths, generator=gen) < 0.33, -1, table)


def _compare(pools, sizes, fronts, edges, depth_ms, verify_ms, valid, cal, verified, averages=None):
    """The fused decision against the tensor version; ``averages`` (a table or None): folded and planned from
    by both (the tensor version as ``decide_every_depth_calibrated`` does it), the tables equal after."""
    from torchspec.runtime.controller_policy import decide_every_depth
    from torchspec.runtime.decide_triton import decide_every_depth_fused
    from torchspec.runtime.plan_averages import fold, plan_from

    pools, fronts, edges, valid = pools.to(DEV), fronts.to(DEV), edges.to(DEV), valid.to(DEV)
    alpha, scale = (torch.tensor(1.0, dtype=torch.float64, device=DEV), None) if cal is None else cal.choice()
    children = (fronts.double() + edges.double()) * alpha
    want = decide_every_depth(pools.double() * alpha, sizes, children, depth_ms.to(DEV), verify_ms.to(DEV), valid,
                              scale, verified)
    folded = in_place = None
    if averages is not None:
        folded, in_place = fold(averages.to(DEV), want.estimates), averages.clone().to(DEV)
        fields = ("next_depth", "next_width", "probe_depth", "probe_width")
        want = want._replace(**dict(zip(fields, plan_from(folded, depth_ms.to(DEV), verify_ms.to(DEV)))))
    got, pending = decide_every_depth_fused(pools, sizes, fronts, edges, depth_ms.to(DEV), verify_ms.to(DEV), valid,
                                            cal, verified, in_place)
    assert got.estimates.tolist() == want.estimates.tolist()
    if averages is not None:
        assert in_place.tolist() == folded.tolist()
    if cal is None:
        assert pending is None
    else:  # the calibration's evidence, under every exponent
        assert pending.tolist() == cal.evidence(pools, verified, valid).tolist()
    assert got.go.tolist() == want.go.tolist()
    assert got.width.tolist() == want.width.tolist()
    assert (int(got.next_depth), int(got.next_width)) == (int(want.next_depth), int(want.next_width))
    assert (int(got.probe_depth), int(got.probe_width)) == (int(want.probe_depth), int(want.probe_width))
    assert int(got.drafted) == int(want.drafted)
    return want, float(alpha), None if scale is None else scale.tolist()


def test_random_rounds_decide_as_the_tensor_version_and_the_reference():
    from torchspec.runtime.controller_reference import reference_next_plan
    from torchspec.runtime.plan_averages import reference_fold, reference_plan_from, reference_round_estimates

    gen = torch.Generator().manual_seed(7)
    seen_plan, seen_go, seen_alpha = set(), set(), set()
    for i in range(40):  # ~8 compiles in all (row chunks of 1, 2, 4, 8; calibrated or not), a few seconds each
        rows = int(torch.randint(1, 65 if i % 4 == 0 else 9, (1,), generator=gen))
        k = 1 if i % 5 == 0 else int(torch.randint(2, 9, (1,), generator=gen))  # a chain, or a k-wide tree
        drafted = int(torch.randint(1, 6, (1,), generator=gen))
        d_max = drafted + int(torch.randint(0, 2, (1,), generator=gen))
        n_max = int(torch.randint(0, 40, (1,), generator=gen))
        depth_ms = (0.02 + torch.rand(d_max, generator=gen) * 0.5).double()
        verify_ms = (1 + torch.cumsum(torch.rand(n_max + 1, generator=gen) * 0.3 - 0.05, 0).clamp(min=0.01)).double()
        valid = torch.rand(rows, generator=gen) < 0.85
        cal = None if i % 3 == 0 else _calibration(gen)
        sharp = float(torch.rand(1, generator=gen)) * 8
        pools, sizes, fronts, edges, each_pool, front, edge = _round(gen, i, rows, k, drafted, sharp)
        verified = int(torch.randint(0, min(pools.shape[1], n_max) + 1, (1,), generator=gen))
        averages = _averages(gen, d_max, n_max + 1) if i % 2 else None  # plans averaged, or the round's own
        want, a, scale = _compare(pools, sizes, fronts, edges, depth_ms, verify_ms, valid, cal, verified, averages)
        args = ([[[x * a for x in row] for row in pool] for pool in each_pool], (front.double() * a).tolist(),
                (edge.double() * a).tolist(), depth_ms.tolist(), verify_ms.tolist(), valid.tolist(), scale)
        if averages is None:
            plan = reference_next_plan(*args)
        else:
            folded = reference_fold(averages.tolist(), reference_round_estimates(*args))
            plan = reference_plan_from(folded, depth_ms.tolist(), verify_ms.tolist())
            assert (int(want.probe_depth), int(want.probe_width)) == plan[2:]
            plan = plan[:2]
        assert (int(want.next_depth), int(want.next_width)) == plan
        seen_plan.add(plan)
        seen_alpha.add(a)
        seen_go.update(want.go.tolist())
    assert seen_go == {True, False} and len({d for d, _ in seen_plan}) >= 3 and len({w for _, w in seen_plan}) > 5
    assert len(seen_alpha) >= 3  # the calibration's exponents, not only a = 1


@pytest.mark.parametrize("averaged", [False, True])
@pytest.mark.parametrize("case", ["minus_inf", "ties", "all_dead", "width_0_table", "smallest_exponent"])
def test_edge_cases(case, averaged):
    gen = torch.Generator().manual_seed(11)
    rows, k, drafted = 4, 3, 3
    pools, sizes, fronts, edges, *_ = _round(gen, 3, rows, k, drafted, 4.0)
    depth_ms = torch.full((drafted + 1,), 0.1, dtype=torch.float64)
    verify_ms = 1 + 0.01 * torch.arange(17, dtype=torch.float64)
    valid = torch.ones(rows, dtype=torch.bool)
    cal, verified = _calibration(gen), 4
    if case == "minus_inf":  # nodes a round never drafted (masked rows of the pool) and children with no edge
        pools[:, 1::2] = float("-inf")
        fronts[:, :, 0] = float("-inf")
    elif case == "ties":  # every node equally likely and every depth free: equal rates everywhere
        pools.fill_(-1.0)
        fronts.fill_(-1.0)
        edges.fill_(-1.0)
        depth_ms.fill_(0.0)
        verify_ms.fill_(1.0)
    elif case == "all_dead":
        valid.fill_(False)
    elif case == "width_0_table":
        verify_ms, verified = verify_ms[:1], 0
    else:  # an underconfident drafter's evidence: path probabilities read as p^0.125
        cal = _calibration(gen, accepted=40.0)
        assert float(cal.choice()[0]) == 0.125
    averages = _averages(gen, depth_ms.shape[0], verify_ms.shape[0]) if averaged else None
    _compare(pools, sizes, fronts, edges, depth_ms, verify_ms, valid, cal, verified, averages)


def test_sizes_that_do_not_grow_by_one_step_are_refused():
    from torchspec.runtime.decide_triton import decide_every_depth_fused, fused_sizes

    assert fused_sizes([8, 16, 24]) == (8, 8) and fused_sizes([1, 2, 3]) == (1, 1) and fused_sizes([4]) == (4, 1)
    assert fused_sizes([4, 12, 16]) is None
    pool = torch.zeros(2, 16, device=DEV)
    with pytest.raises(ValueError, match="one step a depth"):
        decide_every_depth_fused(pool, [4, 12, 16], torch.zeros(3, 2, 4, device=DEV), torch.zeros(3, 2, 4, device=DEV),
                                 torch.ones(3, device=DEV), torch.ones(9, device=DEV),
                                 torch.ones(2, dtype=torch.bool, device=DEV), None, 0)


def test_every_variant_argument_is_a_constexpr_of_both_kernels():
    """``kernel_variant``'s arguments go to both kernels: a compiled launch refuses one a kernel does not declare
    (``KeyError: Keyword argument AVERAGED was specified but unrecognised``, the twenty-fifth session's H100),
    while Triton's interpreter ignores it -- so the CPU run checks the signatures themselves."""
    import inspect

    from torchspec.runtime.decide_triton import KERNELS, kernel_variant

    def constexprs(kernel) -> set[str]:  # the jitted (or interpreted) function's tl.constexpr parameters
        params = inspect.signature(kernel.fn).parameters.values()
        return {p.name for p in params if "constexpr" in str(p.annotation)}

    launch_options = {"num_warps", "num_stages"}
    for calibrated in (False, True):
        for averaged in (False, True):
            meta = kernel_variant(3, (8, 64), 8, 5, calibrated, averaged, 33)
            for name, kernel in KERNELS.items():
                declared = constexprs(kernel)
                assert set(meta) - launch_options == declared, (name, set(meta) ^ declared)


def test_a_table_compiles_one_variant_per_row_chunk_and_calibration():
    """Whatever a round's batch or drafted depths, a table's rounds meet one variant per row chunk (1, 2, 4, 8
    rows, at most 512 nodes a chunk) and calibration: 2 for a k=8 tree's 512 columns (a row a program), 8 for
    narrower pools."""
    from torchspec.runtime.decide_triton import kernel_variant

    for k, table_depths, columns, variants in ((8, 6, 512, 2), (1, 6, 8, 8), (4, 3, 64, 8)):
        first_step = (k, k * k)  # the dynamic tree's pool: k nodes, then k * k a depth (a chain: one)
        seen = {tuple(sorted(kernel_variant(b, first_step, k, table_depths, cal).items()))
                for b in range(1, 65) for cal in (False, True)}
        assert len(seen) == variants
        assert {v["BG"] for v in map(dict, seen)} == {columns}
        assert all(v["RB"] * v["BG"] <= 512 or v["RB"] == 1 for v in map(dict, seen))


@pytest.mark.skipif(not CUDA or INTERPRET, reason="compiles the kernel itself (not under the interpreter)")
def test_the_compile_bench_compiles_small_kernels(tmp_path):
    """tools/bench_decide_compile.py: every variant of a k=8 tree's and a chain's table compiles to two kernels
    of at most ~1.5 MB of PTX together (the unrolled first version's largest was 5.4 MB with 64 columns, not 512)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.tool_loader import load_tool

    out = tmp_path / "compile.json"
    load_tool("bench_decide_compile").main(["--batches", "1,64", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["variants"] == 6 and len(data["rows"]) == 8  # k 8 (a row a program) and 1, batch 1 and 64, calibrated or not
    assert all(r["ptx_bytes"] < 1_500_000 and r["cubin_bytes"] > 0 for r in data["rows"])
