"""The DeepSpeed engine: ZeRO stage 1 or 2 behind the `TrainingEngine` interface of ``engine_base.py``.

ZeRO-3 is refused (``ZERO3_REFUSED`` says why); FSDP2 is the parameter-sharding engine.

Config: ours (batch shape, clipping, bf16, ZeRO stage) with the user's ``ds_config`` merged on
top; a user value that contradicts ours is a ValueError naming both. DeepSpeed gets OUR AdamW
and LambdaLR (a DeepSpeed "optimizer"/"scheduler" section is refused), so every engine steps
the same optimizer with the same schedule.

Accumulation: DeepSpeed counts micro-steps itself; ``backward`` advances it on every
micro-batch but the last, and ``step`` (the boundary) insists on exactly ``grad_accum``
micro-batches. ``scale_wrt_gas=False``: our loss is already normalised over the whole step.

bf16 = bf16 parameters, fp32 masters, fp32 gradient accumulation and reduction, as in the other
engines (DeepSpeed 0.19.8): DeepSpeed casts the module's PARAMETERS to bf16 and keeps floating
buffers fp32 (RoPE's inv_freq stays exact). ZeRO-1 with ``data_types.grad_accum_dtype=fp32`` runs
its ``BF16_Optimizer`` (fp32 master partitions and fp32 gradient buffers); ZeRO-2 its
``DeepSpeedZeroOptimizer`` with fp32 master partitions. Both step OUR AdamW (fused on CUDA) on the
fp32 masters. ``communication_data_type=fp32`` is set too: without it DeepSpeed reduces gradients
in the parameter dtype, and ZeRO-1 rounds its fp32-accumulated gradients to bf16 in the boundary
all-reduce (measured with one rank: micro-batch gradients 1, 2^-10, 2^-10 stepped as 1.0 instead
of 1 + 2^-9; fp32 with this setting, on either stage), which undoes the fp32 accumulation. FSDP2's
``reduce_dtype=fp32`` is the same choice; it doubles the gradient bytes on the wire.

Resume: DeepSpeed's own ``save_checkpoint`` / ``load_checkpoint`` (every rank writes its ZeRO
partition; fp32 master weights come back from the optimizer partitions, so resume is exact),
plus ``engine.json`` recording the stage and dp world size. A checkpoint only resumes with the
same dp world size and stage (refused with a message otherwise; DeepSpeed's ``ds_to_universal``
converts one for another world size). Saving is synchronous (``train.async_checkpoint`` is for
"none"/"fsdp2"); ``checkpoint.py`` seals these files with its manifest like any other.

CPU note: DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce kernel on first use
on CPU (~100 s, cached per TORCH_EXTENSIONS_DIR), used only by DeepSpeed's inference all-reduce,
never by ZeRO training. On the CPU accelerator we mark that op unavailable before DeepSpeed
builds its comm backend (``deepspeed.ops.__compatible_ops__`` is the dict DeepSpeed consults),
so it falls back to torch.distributed (gloo) without compiling anything.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchspec.distributed import is_rank0
from torchspec.io import atomic_write_text
from torchspec.train.engine_base import (
    OptimConfig,
    TrainingEngine,
    TTTModel,
    dp_world_size,
    trainable,
)
from torchspec.train.optim import build_adamw

TAG = "deepspeed"  # the sub-directory DeepSpeed writes into
META_FILE = "engine.json"
ZERO3_REFUSED = (
    "zero_stage=3 is refused: DeepSpeed ZeRO-3 (0.19.8) computes wrong gradients for this drafter, whose decoder "
    "layer runs ttt_steps times per forward (measured on 2 ranks against one process: gradients off by up to 17%; "
    "exact with ttt_steps=1; marking the layer a ZeRO-3 leaf module trips a DeepSpeed assertion instead). Use "
    "zero_stage=1 or 2, or the fsdp2 engine, which shards parameters like ZeRO-3 and matches one process.")
OWNED_SECTIONS = {"optimizer": "the engine passes its own AdamW (train.lr, train.betas, train.weight_decay)",
                  "scheduler": "the engine passes its own warmup-cosine LambdaLR (train.warmup_steps, ...)",
                  "fp16": "precision comes from train.precision (fp32 | bf16)"}


def deepspeed_config(optim: OptimConfig, precision: str, zero_stage: int, user: dict | None) -> dict:
    """Our DeepSpeed config with ``user`` merged on top; ValueError where they disagree."""
    if zero_stage == 3:
        raise ValueError(ZERO3_REFUSED)
    if zero_stage not in (1, 2):
        raise ValueError(f"zero_stage={zero_stage} is not one of [1, 2] (3 is refused, see engine_deepspeed.py).")
    ours = {  # key path -> (value, the setting it comes from)
        ("train_micro_batch_size_per_gpu",): (optim.micro_batch_size, f"train.micro_batch_size={optim.micro_batch_size}"),
        ("gradient_accumulation_steps",): (optim.grad_accum, f"train.grad_accum={optim.grad_accum}"),
        ("gradient_clipping",): (max(optim.max_grad_norm, 0.0), f"train.max_grad_norm={optim.max_grad_norm}"),
        ("bf16", "enabled"): (precision == "bf16", f"train.precision={precision!r}"),
        ("zero_optimization", "stage"): (zero_stage, f"zero_stage={zero_stage}"),
    }
    if precision == "bf16":  # fp32 gradient accumulation and reduction (module docstring)
        ours[("data_types", "grad_accum_dtype")] = ("fp32", "train.precision='bf16' (fp32 gradient accumulation)")
        ours[("communication_data_type",)] = ("fp32", "train.precision='bf16' (fp32 gradient reduction)")
    config: dict[str, Any] = {"steps_per_print": 2**62, "wall_clock_breakdown": False}  # we log ourselves
    for path, (value, _) in ours.items():
        node = config
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    user = copy.deepcopy(user or {})
    for section, why in OWNED_SECTIONS.items():
        if section in user and not (section == "fp16" and not user[section].get("enabled", False)):
            raise ValueError(f"deepspeed config section {section!r} is not allowed: {why}.")
    for path, (value, source) in ours.items():
        node = user
        for key in path:
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            if node != value:
                raise ValueError(f"deepspeed config {'.'.join(path)}={node!r} disagrees with {source}; "
                                 f"remove it from the DeepSpeed config or make the two equal.")
    return _merge(config, user)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def _skip_cpu_shm_comm_build() -> None:
    """See the module docstring: avoid the ~100 s JIT build of an op ZeRO training never uses."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class DeepSpeedEngine(TrainingEngine):
    kind = "deepspeed"

    def __init__(self, model: TTTModel, optim: OptimConfig, scheduler_fn, precision: str, mesh,
                 user_config: dict | None, zero_stage: int):
        import deepspeed

        world = dp_world_size(mesh)
        if world != (dist.get_world_size() if dist.is_initialized() else 1):
            raise ValueError(f"the deepspeed engine is data-parallel over the whole world ({dist.get_world_size()} "
                             f"ranks), but the mesh given has {world}; pass mesh=None or the flattened world mesh.")
        config = deepspeed_config(optim, precision, zero_stage, user_config)
        _skip_cpu_shm_comm_build()
        optimizer = build_adamw(trainable(model), optim.lr, optim.betas, optim.weight_decay)
        self.ds, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, scheduler_fn))
        self.module = self.ds  # calling it runs TTTModel.forward under DeepSpeed's hooks
        self.drafter = model.drafter
        self.precision = precision
        self.dp_size = world
        self.zero_stage = zero_stage
        self.grad_accum = optim.grad_accum
        self.optimizer, self.scheduler = self.ds.optimizer, self.ds.lr_scheduler
        self.micro_batches = 0  # backward calls since the last step

    def backward(self, loss: torch.Tensor) -> None:
        """``loss * dp_size`` as in `TrainingEngine.backward`; DeepSpeed's micro-step advances in between."""
        if self.micro_batches == self.grad_accum:
            raise ValueError(f"backward called {self.grad_accum + 1} times without step(); the deepspeed engine "
                             f"was built for grad_accum={self.grad_accum} micro-batches per step.")
        self.ds.backward(loss * self.dp_size, scale_wrt_gas=False)
        self.micro_batches += 1
        if self.micro_batches < self.grad_accum:
            self.ds.step()  # not a boundary: DeepSpeed only counts the micro-step

    def step(self) -> torch.Tensor:
        if self.micro_batches != self.grad_accum:
            raise ValueError(f"step() after {self.micro_batches} micro-batches; the deepspeed engine was built for "
                             f"grad_accum={self.grad_accum} (DeepSpeed steps only on that boundary).")
        assert self.ds.is_gradient_accumulation_boundary()
        self.ds.step()
        self.micro_batches = 0
        return torch.as_tensor(self.ds.get_global_grad_norm())

    @property
    def lr(self) -> float:
        return self.ds.get_lr()[0]

    def resume_state(self) -> dict[str, Any]:
        raise NotImplementedError("the deepspeed engine's resume state is per-rank files: use save(dir) / load(dir).")

    def save(self, path: str | Path, async_save: bool = False) -> None:
        """Every rank writes its part under ``path/deepspeed/`` (collective; ``path`` must exist)."""
        if async_save:
            raise ValueError("train.async_checkpoint=true needs parallel.engine=none or fsdp2: DeepSpeed writes its "
                             "checkpoints synchronously.")
        self.ds.save_checkpoint(str(path), tag=TAG, client_state={}, save_latest=False,
                                exclude_frozen_parameters=True)
        if is_rank0():
            meta = {"kind": self.kind, "zero_stage": self.zero_stage, "dp_world_size": self.dp_size}
            atomic_write_text(Path(path) / META_FILE, json.dumps(meta) + "\n")

    def load(self, path: str | Path) -> None:
        file = Path(path) / META_FILE
        if not file.is_file():
            raise ValueError(f"{file} is missing: {path} was not written by the deepspeed engine.")
        meta = json.loads(file.read_text())
        now = {"kind": self.kind, "zero_stage": self.zero_stage, "dp_world_size": self.dp_size}
        if meta != now:
            raise ValueError(f"checkpoint {path} was written by {meta} but this run is {now}. DeepSpeed ZeRO "
                             f"checkpoints resume with the same stage and dp world size; convert it with "
                             f"DeepSpeed's ds_to_universal to change them.")
        loaded, _ = self.ds.load_checkpoint(str(path), tag=TAG, load_module_strict=False,
                                            load_optimizer_states=True, load_lr_scheduler_states=True)
        assert loaded is not None, f"DeepSpeed found no checkpoint under {path}/{TAG}"

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 drafter weights on rank 0 (master copies where ZeRO keeps them); collective."""
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for name, p in self.drafter.named_parameters():  # ZeRO-1/2: every rank holds whole (bf16) weights
            full = safe_get_full_fp32_param(p) if p.requires_grad else None
            out[name] = (p.detach().float() if full is None else full).cpu().clone()
        for name, b in self.drafter.state_dict().items():  # persistent buffers
            if name not in out:
                out[name] = b.detach().cpu().clone()
        return out if is_rank0() else {}
