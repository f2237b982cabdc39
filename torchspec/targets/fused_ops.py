"""Elementwise chains of the decoder as one kernel each on CUDA (serving); the same ops eagerly elsewhere.

A plain decode step of a Qwen3-8B-shaped target at batch 1 ran ~2,300 kernels on an H200, ~2,000
of them elementwise pieces of RMSNorm (pow, mean, add, rsqrt, mul, cast, mul), RoPE (neg, cat,
mul, mul, add) and SwiGLU at ~1-3 us each: ~3 ms of an 8.6 ms step whose HBM floor is 3.6 ms
(``tools/profile_decode_step.py``). Each such chain is written once, as a plain function next to
its module, and ``fused(fn)`` compiles it with Inductor (dynamic shapes: one compilation serves
every batch size and tree width). ``emulate_precision_casts`` keeps every intermediate rounding of
the eager chain, so fused and eager outputs agree to rounding. The fused regions of a decoder layer:

    layers.add_rms_norm / add_offset_rms_norm   the residual add and the RMSNorm after it (the next
                                                layer's input norm, the post-attention norm, the final
                                                norm) -> (new residual stream, normed): ONE kernel
    layers.qk_norm_rope                         q and k: per-head RMSNorm (qk-norm families) + RoPE
                                                (partial for hybrids) -> ONE kernel for both
                                                (``ONE_LAUNCH``: Inductor's combo kernels put the q
                                                and k reductions, each with its RoPE epilogue, in one
                                                launch)
    layers.silu_mul                             SwiGLU's elementwise part: ONE kernel
    (layers.rms_norm, offset_rms_norm: a norm without a pending add -- layer 0's input norm)

Why combo kernels for q/k: q and k have different row counts (heads vs KV heads), so Inductor's
ordinary fusion cannot merge their norm reductions and emits one kernel per output; with
``combo_kernels`` both sub-kernels share one launch (program ids split between them). Inductor's
Triton code for these regions (torch 2.13, generated on a CPU machine through the Triton backend
with combo grouping let through for the check) is one kernel per region for Qwen3, Llama and the
hybrid's partial RoPE, at batch 1 and 8 and for prefill chunks; ``tests/gpu/test_target_fused_gpu.py``
counts them on the GPU. If a compile with these options fails, the region retries with the
defaults (a kernel or more per output), then runs eagerly.

The paged KV write (k and v in one launch) is a Triton kernel of the runtime
(``torchspec/runtime/kv_write_triton.py``). A Qwen3 layer's plain decode step is then 7 kernels
besides its 4 GEMMs (add+norm, q/k norm+RoPE, KV write, paged attention + its split-K combine,
add+norm, SwiGLU): 13 with cuBLAS's two split-K reductions at the Qwen3-8B shape on an H200, down
from 19 (separate residual adds, q/k norms, RoPE calls and K/V index_copy).

The speculation round's index bookkeeping uses the same ``fused``: the tree mask (``runtime.tree``), a
forward's write slots (``runtime.paged_kv``), the greedy walk (``runtime.verify``), the compaction plan and
the catch-up layout (``runtime.steps``), each ~10-45 integer ops that ran as as many kernels. These are
exact (integer and boolean work), so they compile on any CUDA input, with or without ``fuse_for_serving``.

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
# Extra Inductor options for a region with independent outputs (q and k), so that it is ONE launch:
# combo kernels (q's and k's reductions, each with its RoPE epilogue, side by side in one kernel);
# no peak-memory gate (newer Inductor refuses a combo that keeps a few KB alive a little longer);
# every cat as a pointwise select and a higher op-count bar before an intermediate is written out
# (emulate_precision_casts counts every cast), so rotate-half and the partial-rotary pass-through
# stay inside the norm's kernel instead of being written by kernels of their own. Keys this torch's
# Inductor lacks are dropped.
ONE_LAUNCH = {"combo_kernels": True, "combo_kernel_peak_memory_pct_threshold": None, "force_pointwise_cat": True,
              "realize_opcount_threshold": 100}
# One compiled function serves every module instance: each (dtype, rank, eps) it meets is one more
# specialisation, so a process serving several models needs more than dynamo's default of 8.
RECOMPILE_LIMIT = 64


def _known_options(options: dict) -> dict:
    """The options this torch's Inductor has (older ones lack some knobs; an unknown key fails the compile)."""
    import torch._inductor.config as inductor_config

    return {k: v for k, v in options.items() if hasattr(inductor_config, k)}


def fused(fn: Callable, options: dict | None = None) -> Callable:
    """``fn`` compiled for CUDA inputs (lazily, dynamic shapes, ``options`` on top of the defaults);
    ``fn`` itself for anything else. If compiling fails it retries without ``options``, then runs
    ``fn`` for good (one warning each): fusion is an optimisation, never a failure."""
    attempts: list[dict] | None = None  # option sets still to try (resolved on the first CUDA call)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal attempts, compiled
        if not args[0].is_cuda:
            return fn(*args, **kwargs)
        if attempts is None:
            extra = _known_options(options or {})
            attempts = [{**_COMPILE_OPTIONS, **extra}] + ([_COMPILE_OPTIONS] if extra else [])
        if not attempts:
            return fn(*args, **kwargs)
        if compiled is None:
            import torch._dynamo.config as dynamo_config

            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
            dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit,
                                                            4 * RECOMPILE_LIMIT)
            compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=attempts[0])
        try:
            return compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compile failure: fewer options, then eager from now on
            attempts, compiled = attempts[1:], None
            log.warning("fusing %s failed (%s: %s); %s.", fn.__name__, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "",
                        "retrying without its extra options" if attempts else "running it eagerly")
            return call(*args, **kwargs)

    return call


__all__ = ["ONE_LAUNCH", "fused"]
