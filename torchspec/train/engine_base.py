"""The training-engine interface and the "none" engine (one process, plain AdamW).

`TrainingEngine` is what the recipe and ``step.py`` talk to; ``engine.py`` (FSDP2, ``build_engine``)
and ``engine_deepspeed.py`` (ZeRO) subclass it. The shared story (one forward per micro-batch,
gradient averaging, precision, resume state) is in ``engine.py``'s docstring.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor

from torchspec.train.optim import MasterWeights, build_adamw, with_implementation
from torchspec.train.ttt import TTTResult, ttt_unroll

ENGINES = ("none", "deepspeed", "fsdp2")
PRECISIONS = ("fp32", "bf16")
PREFIX = "drafter."  # TTTModel's name for the drafter; checkpoints use the drafter's own names
ENGINE_DIR = "engine"  # the DCP checkpoint of "none"/"fsdp2": .metadata + one __<rank>_0.distcp per rank
LEGACY_ENGINE_FILE = "engine.pt"  # the unsharded file of torchspec before DCP (refused with a message)


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


@contextlib.contextmanager
def _one_process_is_meant():
    """DCP warns at every save/load without a process group that it assumes one process: we mean that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


_CHECKPOINT_GROUP: list = []  # [the gloo group background (async) checkpoint writes use], once created


def _checkpoint_group():
    """A gloo group over the whole world for DCP's background writes: its collectives run in another
    thread, and must not interleave with the training thread's on the default group. Created on the
    first async save (collective, like the save itself); None without torch.distributed."""
    if not dist.is_initialized():
        return None
    if not _CHECKPOINT_GROUP:
        _CHECKPOINT_GROUP.append(dist.new_group(backend="gloo"))
    return _CHECKPOINT_GROUP[0]


@torch.no_grad()
def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped its state (AdamW: step 1, zero moments) through one step
    at lr 0 on zero gradients, as ``get_state_dict`` does for module parameters; the masters of
    ``MasterWeights`` are plain tensors (no ``requires_grad``), which that helper skips."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(p.grad is None for p in params), "optimizer state initialised with gradients pending"
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _saved_weight_names(path: str | Path) -> set[str]:
    """The ``model`` names of the DCP checkpoint under ``path/engine/`` (from its metadata; no tensor read)."""
    source = Path(path) / ENGINE_DIR
    if not (source / ".metadata").is_file():
        if (Path(path) / LEGACY_ENGINE_FILE).is_file():
            raise ValueError(f"{path} holds {LEGACY_ENGINE_FILE}, the unsharded layout of an older torchspec; this "
                             f"version reads DCP checkpoints ({ENGINE_DIR}/). Resume it with the torchspec that "
                             f"wrote it, or start a new output_dir.")
        raise ValueError(f"{source}/.metadata is missing: {path} was not written by the 'none' or 'fsdp2' engine.")
    paths = dcp.FileSystemReader(source).read_metadata().planner_data.values()
    return {p[1] for p in paths if p[0] == "model"}


def read_engine_state(path: str | Path, part: str | None = None) -> dict[str, Any]:
    """The whole resume state of a "none"/"fsdp2" checkpoint directory as plain CPU tensors, in this
    process (no process group; for export and inspection, not for resuming): ``{"model": {name:
    tensor}, "optimizer": {...}, "scheduler": {...}}``, or only ``part`` of it (e.g. "model")."""
    _saved_weight_names(path)  # a clear error if there is no DCP checkpoint there
    # DCP's own "load without a template" (format_utils.dcp_to_torch_save uses the same two calls).
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(Path(path) / ENGINE_DIR),
                     planner=_EmptyStateDictLoadPlanner(keys=None if part is None else {part}), no_dist=True)
    return state


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
    def resume_state(self) -> dict[str, Any]:
        """This rank's part of the resume state, as DCP saves it and loads it in place; collective.

        ``model``: the trainable drafter weights, fp32 at either precision (the masters under "none"
        bf16; this rank's DTensor shards under FSDP2), and the persistent buffers (EAGLE-3's d2t/t2d);
        frozen weights come back from the target. ``optimizer``: the AdamW state. Both keyed by the
        drafter's own parameter names, so the "none" and "fsdp2" layouts are one (DCP reshards).
        ``scheduler``: the LambdaLR state. An optimizer that has not stepped yet gets its state
        initialised (zero moments, as ``get_state_dict`` does), so there is always one to save or fill.
        """
        if self.masters is not None:
            _init_state(self.optimizer)
            model_sd, optim_sd = self.masters.state_dict()
            params = dict(self.module.named_parameters())
            model_sd.update({k: v for k, v in self.module.state_dict().items() if k not in params})  # buffers
        else:
            options = StateDictOptions(ignore_frozen_params=True)
            model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=options)
        model_sd, optim_sd = rekey(model_sd, optim_sd, lambda k: k.removeprefix(PREFIX))
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}

    def save(self, path: str | Path, async_save: bool = False) -> Future | None:
        """Write the resume state into ``path/engine/`` through DCP: every rank writes its own shard
        (``__<rank>_0.distcp``), rank 0 the ``.metadata``; collective, ``path`` must exist.
        ``async_save``: stage a copy in memory and write it in a background thread; returns the
        future, which the caller waits on before publishing the checkpoint (``checkpoint.py``)."""
        target = Path(path) / ENGINE_DIR
        state = self.resume_state()
        with _one_process_is_meant():
            if not async_save:
                dcp.save(state, checkpoint_id=target, no_dist=not dist.is_initialized())
                return None
            return dcp.async_save(state, checkpoint_id=target, no_dist=not dist.is_initialized(),
                                  process_group=_checkpoint_group())

    def load(self, path: str | Path) -> None:
        """Restore what ``save`` wrote, at this world size (DCP reads the slices each rank needs);
        collective. Written by "none" or "fsdp2" at any world size and precision."""
        source = Path(path) / ENGINE_DIR
        saved = _saved_weight_names(path)
        state = self.resume_state()  # the template DCP loads into: this engine's shapes and shards
        if set(state["model"]) != saved:
            expected = set(state["model"])
            raise ValueError(
                f"engine state in {source} does not match this {self.kind!r} drafter: missing "
                f"{sorted(expected - saved)[:8]}, unexpected {sorted(saved - expected)[:8]}. Resume with the "
                f"drafter config it was written with, or start a new output_dir.")
        with _one_process_is_meant():
            dcp.load(state, checkpoint_id=source, no_dist=not dist.is_initialized())
        model_sd, optim_sd = rekey(state["model"], state["optimizer"], lambda k: PREFIX + k)
        optim_sd = with_implementation(optim_sd, self.optimizer)  # written fused (GPU) or foreach
        if self.masters is not None:
            params = dict(self.module.named_parameters())
            self.masters.load_state_dict({k: v for k, v in model_sd.items() if k in params}, optim_sd)
            self.module.load_state_dict({k: v for k, v in model_sd.items() if k not in params}, strict=False)
        else:
            # strict=False: frozen weights are not in the checkpoint (the name check above is strict).
            options = StateDictOptions(strict=False)
            set_model_state_dict(self.module, model_sd, options=options)
            set_optimizer_state_dict(self.module, self.optimizer, optim_sd, options=options)
        self.scheduler.load_state_dict(state["scheduler"])

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


