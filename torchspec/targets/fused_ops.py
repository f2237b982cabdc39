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
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)
_COMPILE_OPTIONS = {"emulate_precision_casts": True}
# One compiled function serves every module instance: each (dtype, rank, eps) it meets is one more
# specialisation, so a process serving several models needs more than dynamo's default of 8.
RECOMPILE_LIMIT = 64


def fused(fn: Callable) -> Callable:
    """``fn`` compiled for CUDA inputs (lazily, dynamic shapes); ``fn`` itself for anything else, and
    for good (with one warning) if compiling ever fails: fusion is an optimisation, never a failure."""
    compiled = None
    failed = False

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled, failed
        if failed or not args[0].is_cuda:
            return fn(*args, **kwargs)
        if compiled is None:
            import torch._dynamo.config as dynamo_config

            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
            dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit,
                                                            4 * RECOMPILE_LIMIT)
            compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=_COMPILE_OPTIONS)
        try:
            return compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compile failure: run this chain eagerly from now on
            log.warning("fusing %s failed (%s: %s); running it eagerly.", fn.__name__, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            failed = True
            return fn(*args, **kwargs)

    return call


__all__ = ["fused"]
