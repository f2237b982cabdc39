"""Elementwise chains of the decoder as one kernel each on CUDA (serving); the same ops eagerly elsewhere.

A plain decode step of a Qwen3-8B-shaped target at batch 1 ran ~2,300 kernels on an H200, ~2,000
of them elementwise pieces of RMSNorm (pow, mean, add, rsqrt, mul, cast, mul), RoPE (neg, cat,
mul, mul, add) and SwiGLU at ~1-3 us each: ~3 ms of an 8.6 ms step whose HBM floor is 3.6 ms
(``tools/profile_decode_step.py``). Each such chain is written once, as a plain function next to
its module (``layers.rms_norm``, ``rope.apply_rope``, ``layers.silu_mul``), and ``fused(fn)``
compiles it with Inductor into one Triton kernel (dynamic shapes: one compilation serves every
batch size and tree width). ``emulate_precision_casts`` keeps every intermediate rounding of the
eager chain, so fused and eager outputs agree to rounding.

Modules opt in per instance (``module.fused = True``, set by `TargetDecoder.fuse_for_serving`);
training capture and the CPU never compile anything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

_COMPILE_OPTIONS = {"emulate_precision_casts": True}


def fused(fn: Callable) -> Callable:
    """``fn`` compiled for CUDA inputs (lazily, once, dynamic shapes); ``fn`` itself for anything else."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=_COMPILE_OPTIONS)
        return compiled(*args, **kwargs)

    return call


__all__ = ["fused"]
