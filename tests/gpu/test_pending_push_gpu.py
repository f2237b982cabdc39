"""The one-launch deferral of a plain round's drafter entry (``pending_push_triton``, skipped without a GPU):
bit for bit what ``PendingDrafter.push_reference`` writes -- tokens, aux states (strided inputs, cast to the
buffer's dtype), counts bumped only for live rows, positions clamped at the capacity -- and inside a CUDA graph.

    python -m pytest -q tests/gpu/test_pending_push_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from torchspec.runtime.pending_drafter import PendingDrafter

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def twins(slots: int, capacity: int, num_aux: int, hidden: int, dtype: torch.dtype, seed: int):
    """Two buffers in the same random state (the reference's and the kernel's)."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    a = PendingDrafter(slots, capacity, num_aux, hidden, dtype, CUDA)
    a.tokens.random_(0, 1000, generator=g)
    a.aux.normal_(generator=g)
    a.count.random_(0, capacity + 2, generator=g)  # some at or past the capacity: the last position is rewritten
    b = PendingDrafter(slots, capacity, num_aux, hidden, dtype, CUDA)
    b.tokens.copy_(a.tokens), b.aux.copy_(a.aux), b.count.copy_(a.count)
    return a, b


@pytest.mark.parametrize("num_aux,hidden,dtype,state_dtype", [(3, 576, torch.bfloat16, torch.bfloat16),
                                                               (1, 4096, torch.bfloat16, torch.float32),
                                                               (4, 100, torch.float32, torch.float32)])
def test_the_kernel_writes_what_the_tensor_ops_write(num_aux, hidden, dtype, state_dtype):
    for seed in range(4):
        g = torch.Generator(device=CUDA).manual_seed(100 + seed)
        slots_total, rows = 9, [1, 3, 9][seed % 3]
        ref, got = twins(slots_total, 5, num_aux, hidden, dtype, seed)
        slots = torch.randperm(slots_total, device=CUDA, generator=g)[:rows]
        tokens = torch.randint(0, 1000, (rows,), device=CUDA, generator=g)
        wide = torch.randn(rows, num_aux, 2 * hidden, device=CUDA, generator=g).to(state_dtype)
        aux = [wide[:, i:i + 1, ::2] for i in range(num_aux)]  # strided: every other element, rows apart
        valid = torch.rand(rows, device=CUDA, generator=g) < 0.7
        ref.push_reference(slots, tokens, aux, valid)
        got.push(slots, tokens, aux, valid)
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.count, ref.count)
        assert torch.equal(got.aux, ref.aux)


def test_the_kernel_runs_inside_a_cuda_graph():
    ref, got = twins(4, 8, 3, 256, torch.bfloat16, 0)
    got.count.zero_(), ref.count.zero_()
    slots = torch.arange(4, device=CUDA)
    tokens = torch.zeros(4, dtype=torch.long, device=CUDA)
    aux = [torch.zeros(4, 1, 256, dtype=torch.bfloat16, device=CUDA) for _ in range(3)]
    valid = torch.tensor([True, True, False, True], device=CUDA)
    got.push(slots, tokens, aux, valid)  # builds the kernel before the capture
    got.count.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got.push(slots, tokens, aux, valid)
    got.count.zero_()
    for step in range(3):
        tokens.copy_(torch.arange(4, device=CUDA) + 10 * step)
        for a in aux:
            a.copy_(torch.randn(a.shape, device=CUDA).to(a.dtype))
        graph.replay()
        ref.push_reference(slots, tokens, aux, valid)
    torch.cuda.synchronize()
    assert got.count.tolist() == ref.count.tolist() == [3, 3, 0, 3]
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.aux, ref.aux)
