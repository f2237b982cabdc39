"""The Triton top-k (``runtime/select_triton.py``) equals a stable reference, exactly and in order.

Reference: a stable descending sort of the fp32 scores, first k -- the kernel's documented order
(best first, equal scores by ascending index). Runs on CUDA (the full grid: N 1/3/8/64, V 1000 /
49152 / 151936 / 248320, k 1/4/128, bf16/fp32), or on CPU under Triton's interpreter
(``TRITON_INTERPRET=1`` with triton importable; small V, few rows); skipped otherwise. On CPU pass
``--noconftest`` (tests/conftest.py skips tests/gpu/ without CUDA); tests/unit/test_fast_select.py
runs this file that way in a subprocess:

    TRITON_INTERPRET=1 python -m pytest --noconftest tests/gpu/test_select_triton.py

Inputs: Gaussian scores; scores drawn from 5 values (most entries tie with thousands of others, so
only the index rule decides); a third of the entries -inf, plus a row with fewer finite scores
than k (the rest must be -inf at the lowest indices, never padding). On CUDA also: CUDA-graph
capture and replay on new inputs, the launch count (<= 2), and ``EfficientLMHead.candidates``
with ``fast_select`` against the torch path.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA, or TRITON_INTERPRET=1 with triton")
DEV = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _select():
    from torchspec.runtime import select_triton

    return select_triton


def reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best per row: score descending, equal scores by ascending index."""
    return torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[..., :k]


def make_scores(n: int, v: int, kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(n, v, generator=g)
    elif kind == "ties":  # 5 values: a row's top k is decided by the index rule alone
        x = torch.tensor([-1.5, -0.0, 0.0, 0.25, 2.0])[torch.randint(0, 5, (n, v), generator=g)]
    elif kind == "neginf":
        x = torch.randn(n, v, generator=g)
        x[torch.rand(n, v, generator=g) < 1 / 3] = float("-inf")
        x[0] = float("-inf")  # row 0: 2 finite scores, every other pick is -inf
        x[0, [v // 2, v - 1]] = torch.tensor([1.0, -3.0])
    else:
        raise ValueError(kind)
    return x.to(dtype).to(DEV)


def check(scores: torch.Tensor, k: int, **kw) -> None:
    sel = _select()
    assert sel.supports(scores, k) or not CUDA
    got = sel.topk_indices_triton(scores, k, **kw)
    assert got.dtype == torch.int64 and got.shape == (*scores.shape[:-1], k)
    want = reference(scores, k)
    bad = (got != want).any(-1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:5]}: got {got[bad[0]][:8].tolist()} want {want[bad[0]][:8].tolist()}"


if CUDA:
    CASES = [(n, v, k, dtype, kind) for n in (1, 3, 8, 64) for v in (1000, 49152, 151936, 248320)
             for k in (1, 4, 128) for dtype in (torch.bfloat16, torch.float32) for kind in ("normal", "ties", "neginf")]
else:  # the interpreter runs programs one by one in numpy (~1 s per program at k = 128)
    CASES = [(1, 1000, 32, torch.float32, "normal"), (1, 5000, 128, torch.bfloat16, "ties"),
             (2, 5000, 4, torch.bfloat16, "normal"), (2, 5000, 4, torch.float32, "neginf"),
             (3, 5000, 1, torch.float32, "ties"), (2, 1000, 5, torch.bfloat16, "neginf")]


@pytest.mark.parametrize("n,v,k,dtype,kind", CASES)
def test_equals_stable_reference(n, v, k, dtype, kind):
    check(make_scores(n, v, kind, dtype, seed=n + v + k), k)


@pytest.mark.parametrize("block_v", [16, 64, 256] if CUDA else [256])
def test_forced_small_blocks(block_v):
    """Many blocks per row, blocks no wider than KP (merge of many padded candidates)."""
    for dtype in (torch.bfloat16, torch.float32):
        check(make_scores(2, 1000, "ties", dtype, seed=block_v), 16, block_v=block_v)


def test_nan_ranks_above_inf():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(2, 700, generator=torch.Generator().manual_seed(1))
        x[0, [5, 600]] = float("nan")
        x[0, 9] = float("inf")
        x[1, 3] = -float("nan")
        x = x.to(dtype).to(DEV)
        got = _select().topk_indices_triton(x, 4)
        assert got[0, :3].tolist() == [5, 600, 9] and got[1, 0].item() == 3


def test_leading_dims_are_rows():
    x = make_scores(6, 1000, "normal", torch.bfloat16).view(2, 3, 1000)
    got = _select().topk_indices_triton(x, 4)
    assert got.shape == (2, 3, 4) and torch.equal(got, reference(x, 4))


@cuda_only
@pytest.mark.parametrize("v", [1000, 49152, 248320])
def test_cuda_graph_replays_new_inputs(v):
    sel = _select()
    static = make_scores(8, v, "normal", torch.bfloat16, seed=1)
    sel.topk_indices_triton(static, 128)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sel.topk_indices_triton(static, 128)
    for seed, kind in ((2, "normal"), (3, "ties"), (4, "neginf")):
        static.copy_(make_scores(8, v, kind, torch.bfloat16, seed=seed))
        graph.replay()
        assert torch.equal(out, reference(static, 128)), (seed, kind)


@cuda_only
@pytest.mark.parametrize("v,launches", [(1000, 1), (49152, 2), (248320, 2)])
def test_launch_count(v, launches):
    from torch.profiler import ProfilerActivity, profile

    sel = _select()
    x = make_scores(8, v, "normal", torch.bfloat16)
    sel.topk_indices_triton(x, 128)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sel.topk_indices_triton(x, 128)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == launches, kernels


@cuda_only
def test_lm_head_fast_select_matches_torch_path():
    from torchspec.models.lm_head import EfficientLMHead

    head = EfficientLMHead(64, 49152, rank=16, topk=128, device="cuda", dtype=torch.float32)
    h = torch.randn(3, 4, 64, device="cuda")
    with torch.no_grad():
        ids_torch, logits_torch = head.candidates(h)
        head.fast_select = True
        ids_fast, logits_fast = head.candidates(h)
    order_t, order_f = ids_torch.sort(-1), ids_fast.sort(-1)
    assert torch.equal(order_t.values, order_f.values)
    assert torch.allclose(logits_torch.gather(-1, order_t.indices), logits_fast.gather(-1, order_f.indices))
