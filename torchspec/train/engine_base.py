"""The training-engine interface and the "none" engine (one process, plain AdamW).

`TrainingEngine` is what the recipe and ``step.py`` talk to; ``engine.py`` (FSDP2, ``build_engine``)
and ``engine_deepspeed.py`` (ZeRO) subclass it. The shared story (one forward per micro-batch,
gradient averaging, precision, resume state) is in ``engine.py``'s docstring.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from torchspec.train.optim import MasterWeights, build_adamw, with_implementation
from torchspec.train.ttt import TTTResult, ttt_unroll

ENGINES = ("none", "deepspeed", "fsdp2")
PRECISIONS = ("fp32", "bf16")
PREFIX = "drafter."  # TTTModel's name for the drafter; checkpoints use the drafter's own names
ENGINE_FILE = "engine.pt"


@dataclass
class OptimConfig:
    """AdamW, clipping, and the batch shape DeepSpeed keeps its own books with."""

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0  # <= 0: no clipping (the norm is still returned)
    micro_batch_size: int = 1  # sequences per rank per micro-batch (DeepSpeed's bookkeeping only)
    grad_accum: int = 1  # micro-batches per optimizer step


class TTTModel(nn.Module):
    """The drafter plus its TTT unroll as ``forward``: what every engine wraps and shards."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, loss_mask, aux_hidden_states, teacher, denominators,
                num_steps: int, decay: float, **unroll_kwargs) -> dict[str, Any]:
        # A dict, not the TTTResult dataclass: FSDP2 finds the loss (to hook backward) by pytree.
        r = ttt_unroll(self.drafter, input_ids, loss_mask, aux_hidden_states, teacher, num_steps,
                       decay, denominators, **unroll_kwargs)
        return {f.name: getattr(r, f.name) for f in fields(r)}


def dp_world_size(mesh) -> int:
    if mesh is not None:
        return mesh.size()
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def trainable(module: nn.Module) -> list[nn.Parameter]:
    params = [p for p in module.parameters() if p.requires_grad]
    assert params, "the drafter has no trainable parameters"
    return params


def rekey(model_sd: dict, optim_sd: dict | None, fn: Callable[[str], str]) -> tuple[dict, dict | None]:
    """Rename the parameter keys of a model and an FQN-keyed optimizer state dict."""
    model_sd = {fn(k): v for k, v in model_sd.items()}
    if optim_sd:
        optim_sd = {"state": {fn(k): v for k, v in optim_sd["state"].items()},
                    "param_groups": [{**g, "params": [fn(k) for k in g["params"]]} for g in optim_sd["param_groups"]]}
    return model_sd, optim_sd


def fsync_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


class TrainingEngine:
    """The "none" engine, and the base the others share.

    ``module``: the `TTTModel` to call (an ``nn.Module``; ``module.train()/eval()`` as usual).
    ``drafter``: the drafter inside it (sharded under FSDP2; bf16 under "none" bf16: export through
    ``drafter_state_dict``). The optimizer and scheduler are built here, after any sharding.
    ``masters``: the fp32 master weights ("none" at bf16 only; None otherwise).
    """

    kind = "none"
    masters: MasterWeights | None = None

    def __init__(self, model: TTTModel, optim: OptimConfig, scheduler_fn: Callable[[int], float],
                 precision: str, dp_size: int = 1):
        self.module = model
        self.drafter = model.drafter
        self.precision = precision
        self.dp_size = dp_size
        self.max_grad_norm = optim.max_grad_norm
        self.optimizer = self._build_optimizer(optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, scheduler_fn)

    def _build_optimizer(self, optim: OptimConfig) -> torch.optim.Optimizer:
        """bf16: the module becomes bf16 and AdamW steps its fp32 masters; fp32: AdamW on the module."""
        if self.precision == "bf16":
            self.masters = MasterWeights(self.module, optim.lr, optim.betas, optim.weight_decay)
            return self.masters.optimizer
        return build_adamw(trainable(self.module), optim.lr, optim.betas, optim.weight_decay)

    # --- the training step -------------------------------------------------------------------
    def unroll(self, input_ids, loss_mask, aux_hidden_states, teacher, denominators,
               num_steps: int, decay: float, **unroll_kwargs) -> TTTResult:
        """One micro-batch's ``ttt_unroll`` (same arguments; keyword ones such as attention_mask,
        moe_aux_coef, lowrank_coef pass through). bf16: the captured states are cast to bf16 (no-op
        when the target produced bf16); the teacher passes as is (the fused loss casts its operands)."""
        if self.precision == "bf16":
            aux_hidden_states = [a.to(torch.bfloat16) for a in aux_hidden_states]
        out = self.module(input_ids, loss_mask, aux_hidden_states, teacher,
                          denominators.to(input_ids.device), num_steps, decay, **unroll_kwargs)
        return TTTResult(**out)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss * dp_size``: the engines average gradients over dp ranks, we want the sum."""
        (loss * self.dp_size).backward()

    def step(self) -> torch.Tensor:
        """Clip, optimizer step, scheduler step, zero grads. Returns the pre-clip global grad norm
        (a device tensor: no host sync). Clipping and AdamW read fp32 gradients: the masters' under
        "none" bf16, the sharded parameters' under FSDP2 (reduce_dtype fp32)."""
        stepped = self.masters.masters if self.masters is not None else self.module.parameters()
        params = [p for p in stepped if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):  # FSDP2: per-shard norms -> the global norm
            norm = norm.full_tensor()
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
        self.optimizer.step()
        if self.masters is not None:
            self.masters.copy_to_model()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # --- resume state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Full (unsharded) resume state on rank 0 (other ranks get ``{}``); collective.

        ``model``: trainable drafter weights, fp32 (the masters under bf16; frozen ones come back
        from the target); ``optimizer``: AdamW state keyed by parameter name; ``scheduler``: LambdaLR state.
        """
        if self.masters is not None:
            model_sd, optim_sd = self.masters.state_dict()
        else:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
            model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=options)
        if not is_rank0():
            return {}
        model_sd, optim_sd = rekey(model_sd, optim_sd, lambda k: k.removeprefix(PREFIX))
        return {"kind": self.kind, "model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore ``state_dict()``'s output, written at any world size by "none" or "fsdp2".
        Collective; only rank 0's ``state`` is read (others may pass ``None``)."""
        if is_rank0():
            expected = {n.removeprefix(PREFIX) for n, p in self.module.named_parameters() if p.requires_grad}
            got = set(state["model"])
            if state.get("kind") not in ("none", "fsdp2") or got != expected:
                raise ValueError(
                    f"engine state (kind {state.get('kind')!r}) does not match this {self.kind!r} drafter: missing "
                    f"{sorted(expected - got)[:8]}, unexpected {sorted(got - expected)[:8]}. Resume with the "
                    f"drafter config and engine it was written with, or start a new output_dir.")
            model_sd, optim_sd = rekey(state["model"], state["optimizer"], lambda k: PREFIX + k)
            optim_sd = with_implementation(optim_sd, self.optimizer)  # written fused (GPU) or foreach
            sched = state["scheduler"]
        else:
            model_sd, optim_sd, sched = {}, {}, None
        self._set_state(model_sd, optim_sd)
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [sched]
            dist.broadcast_object_list(box, src=0)
            sched = box[0]
        self.scheduler.load_state_dict(sched)

    def _set_state(self, model_sd: dict, optim_sd: dict) -> None:
        if self.masters is not None:  # one process ("none"): nothing to broadcast
            self.masters.load_state_dict(model_sd, optim_sd)
            return
        # strict=False: frozen weights are not in the checkpoint (the key check above is strict).
        # Two calls, not set_state_dict: that one skips the model on ranks passing an empty dict.
        options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=self.dp_size > 1)
        set_model_state_dict(self.module, model_sd, options=options)
        set_optimizer_state_dict(self.module, self.optimizer, optim_sd, options=options)

    def save(self, path: str | Path) -> None:
        """Write the resume state into the existing directory ``path`` (collective; rank 0 writes)."""
        state = self.state_dict()
        if is_rank0():
            fsync_save(state, Path(path) / ENGINE_FILE)

    def load(self, path: str | Path) -> None:
        """Restore what ``save`` wrote (collective; only rank 0 reads the file)."""
        file = Path(path) / ENGINE_FILE
        state = None
        if is_rank0():
            if not file.is_file():
                raise ValueError(f"{file} is missing: {path} was not written by the 'none' or 'fsdp2' engine.")
            state = torch.load(file, map_location="cpu", weights_only=False)
        self.load_state_dict(state)

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 drafter weights, frozen ones included, on rank 0 (for export); collective.
        Under "none" bf16 the trainable ones are the fp32 masters (never the bf16 copies); the
        frozen ones (the target's embedding, a frozen head) are their bf16 values, upcast."""
        out = {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()}
        if self.masters is None:
            return out
        out = {k: v.float() if v.is_floating_point() else v for k, v in out.items()}
        out.update({n.removeprefix(PREFIX): m.detach().cpu().clone() for n, m in self.masters.named_masters()})
        return out


