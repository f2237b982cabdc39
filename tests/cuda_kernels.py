"""Counting the CUDA kernels a call launches (torch.profiler), for the GPU tests' kernel budgets."""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch


def kernel_counts(fn: Callable[[], object], reps: int = 1) -> collections.Counter:
    """CUDA kernels (name -> launches per call) of ``fn``, after one warm-up call (which compiles)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    names = collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return collections.Counter({k: n / reps for k, n in names.items()})


def kernel_total(fn: Callable[[], object]) -> int:
    """How many CUDA kernels one call of ``fn`` launches (after a warm-up call)."""
    return round(sum(kernel_counts(fn).values()))
