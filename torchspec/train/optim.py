"""The optimizer side of training: AdamW built for the device, fp32 master weights for a bf16
module, the learning-rate schedule, and the precision choice.

**Precision** (``train.precision``): "auto" is bf16 where it is the faster (``fast_bf16``: CUDA,
CPUs with AMX) and fp32 elsewhere; "bf16" / "fp32" force one. bf16 means bf16 parameters with fp32 master weights in the
optimizer, in every engine:

* "none": ``MasterWeights`` below (the module holds bf16, AdamW steps fp32 copies);
* "fsdp2": the sharded parameters stay fp32 (they are the masters) and ``MixedPrecisionPolicy``
  (param_dtype=bf16, reduce_dtype=fp32) all-gathers them as bf16 for compute;
* "deepspeed": its ``bf16`` mode (``engine_deepspeed.py`` says what ZeRO-1/2 keep in fp32).

**Gradient accumulation in fp32** (``MasterWeights``). A backward leaves a bf16 gradient on each
bf16 parameter; a post-accumulate-grad hook adds it into the master's fp32 ``.grad`` and frees
it. So one micro-batch's gradient is rounded to bf16 once (as FSDP2's bf16 compute gradient is,
before its fp32 reduce-scatter), but the sum over micro-batches is fp32. Accumulating in bf16
instead (8 significant bits) rounds the running sum at every micro-batch, an error that grows
with the number of micro-batches, and drops outright any contribution below 2^-9 of the sum
(``tests/unit/test_precision.py`` has the 1 + 2^-10 + 2^-10 example) -- the precision the fp32
masters exist to keep. The fp32 buffer is the masters' ``.grad``, which AdamW on fp32 masters
needs anyway; the bf16 gradient lives only until its hook runs. Clipping reads the fp32 gradients.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
from torch import nn


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-indexed)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The drafter's parameter/compute dtype: bf16, or None for fp32. "auto" is bf16 where it is
    the faster (``fast_bf16``: CUDA, AMX CPUs), else fp32; "bf16" where the device lacks it is a
    ValueError."""
    if precision == "fp32":
        return None
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
    else:
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if precision == "bf16" and not supported:
        raise ValueError(f"train.precision=bf16 but {device.type} here has no bf16 support; use train.precision=fp32.")
    if precision == "auto":
        return torch.bfloat16 if fast_bf16(device) else None
    return torch.bfloat16


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls beat fp32 here: CUDA with bf16, or a CPU with AMX tiles. CPUs with only
    AVX-512 BF16 run bf16 GEMMs through slower paths (measured on the 2-core dev machine: 102 vs
    195 GFLOP/s for a [1920, 576] x [576, 49152] product)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def resolve_target_dtype(name: str, device: torch.device) -> torch.dtype:
    """``target.dtype``: "float32" | "bfloat16" | "auto" (bf16 where it is the faster, else fp32)."""
    if name == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def adamw_implementation(device_type: str) -> dict[str, bool | None]:
    """AdamW's implementation: fused on CUDA (one kernel for all parameters; FSDP2's DTensor shards
    included), foreach elsewhere."""
    return {"fused": True, "foreach": None} if device_type == "cuda" else {"fused": None, "foreach": True}


def build_adamw(params: list[torch.Tensor], lr: float, betas: Iterable[float], weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                             **adamw_implementation(params[0].device.type))


def with_implementation(optim_sd: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A saved optimizer state dict with ``optimizer``'s implementation flags (fused / foreach):
    ``load_state_dict`` takes every group key from the file, and a checkpoint written on the GPU
    (fused) must resume on the CPU and the other way round."""
    flags = {k: optimizer.param_groups[0][k] for k in ("fused", "foreach")}
    return {**optim_sd, "param_groups": [{**g, **flags} for g in optim_sd["param_groups"]]}


def _accumulate_into(master: torch.Tensor, param: nn.Parameter) -> None:
    """Post-accumulate-grad hook: param.grad (bf16, this backward's) -> master.grad (fp32, summed)."""
    if master.grad is None:
        master.grad = param.grad.to(torch.float32)
    else:
        master.grad.add_(param.grad)
    param.grad = None


class MasterWeights:
    """fp32 master copies of ``module``'s trainable parameters, which the module then holds in bf16.

    Built from the fp32 module: the masters copy the fp32 values, then EVERY parameter of the
    module (the frozen target embedding too) becomes bf16; floating buffers stay as they are (RoPE's
    inv_freq must stay fp32). ``optimizer`` (AdamW) steps the masters from their fp32 ``.grad``
    (the module docstring says how it accumulates); ``copy_to_model`` rounds them back into the
    bf16 parameters, so the bf16 weights are always the masters rounded to nearest.

    ``state_dict`` speaks the layout of ``torch.distributed.checkpoint``'s full state dicts (weights
    and AdamW state keyed by parameter name, fp32, on the CPU), so a checkpoint moves between this
    and an fp32 module or FSDP2 in either direction.
    """

    def __init__(self, module: nn.Module, lr: float, betas: Iterable[float], weight_decay: float):
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        assert named, "the module has no trainable parameters"
        assert all(p.dtype == torch.float32 for _, p in named), "MasterWeights starts from an fp32 module"
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.masters = [p.detach().clone() for p in self.params]  # [fp32], leaves owned by the optimizer
        for p in module.parameters():
            p.data = p.data.to(torch.bfloat16)
        for p, m in zip(self.params, self.masters):
            p.register_post_accumulate_grad_hook(functools.partial(_accumulate_into, m))
        self.optimizer = build_adamw(self.masters, lr, betas, weight_decay)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        torch._foreach_copy_(self.params, self.masters)  # fp32 -> bf16, round to nearest even

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(fp32 master weights, AdamW state), both keyed by parameter name, on the CPU."""
        weights = {n: m.detach().cpu().clone() for n, m in zip(self.names, self.masters)}
        sd = self.optimizer.state_dict()
        state = {self.names[i]: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in s.items()}
                 for i, s in sd["state"].items()}
        groups = [{**g, "params": [self.names[i] for i in g["params"]]} for g in sd["param_groups"]]
        return weights, {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, weights: dict[str, torch.Tensor], optim_sd: dict) -> None:
        """Restore ``state_dict``'s output (or an fp32/FSDP2 engine's, same layout; its AdamW flags
        already set for this device by ``with_implementation``); the bf16 parameters become the
        loaded masters rounded."""
        for name, master in zip(self.names, self.masters):
            master.copy_(weights[name])
        self.copy_to_model()
        index = {n: i for i, n in enumerate(self.names)}
        self.optimizer.load_state_dict({
            "state": {index[n]: s for n, s in optim_sd["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optim_sd["param_groups"]]})

    def named_masters(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.names, self.masters))
