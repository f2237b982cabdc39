"""Training engines: one small interface over plain AdamW, DeepSpeed ZeRO and FSDP2.

    engine = build_engine("fsdp2", drafter, OptimConfig(lr=1e-4, grad_accum=2), lr_multiplier, mesh)
    for mb in micro_batches:                      # denominators: GLOBAL valid counts (all-reduced)
        result = engine.unroll(ids, loss_mask, aux_states, teacher, denominators, num_steps, decay)
        engine.backward(result.loss)
    grad_norm = engine.step()                     # clip -> optimizer -> LR schedule -> zero_grad

Kinds (``ENGINES``): "none" (one process: AdamW + LambdaLR, what step.py did before engines),
"fsdp2" (``fully_shard`` over the dp mesh; this file) and "deepspeed"
(ZeRO stage 1/2; ``engine_deepspeed.py``, which says why ZeRO-3 is refused).

**One forward per micro-batch.** The drafter is wrapped in `TTTModel`, whose ``forward`` is the
whole TTT unroll. DeepSpeed and FSDP2 gather parameters and arm gradient reduction around
``forward()``, but the unroll calls ``fuse_target_states``/``step`` K times and reads
``lm_head.weight`` directly; wrapped, every engine sees one ordinary forward and one backward.

**Gradient averaging (contract 4).** The loss of each rank's micro-batch is already its SUM of
token losses divided by the GLOBAL valid-token count (all ranks, all micro-batches), so the
right gradient is the SUM of the ranks' gradients. DeepSpeed and FSDP2 AVERAGE over the dp
ranks, so ``backward`` multiplies the loss by the dp world size; nothing else rescales.

**Precision** (``torchspec/train/optim.py`` has the whole story). bf16 = bf16 parameters, fp32
master weights in the optimizer, fused AdamW on CUDA: "none" holds the module in bf16 and steps
fp32 copies (``MasterWeights``: micro-batch gradients accumulate in fp32); "fsdp2" keeps fp32
sharded parameters and computes in bf16 through ``MixedPrecisionPolicy``; "deepspeed" uses its
bf16 mode. No engine autocasts: ``unroll`` casts the captured target states to bf16 (a no-op on
the GPU, where the target produces bf16) and the parameters already are bf16 when the forward runs.

**Resume state.** ``save(dir)`` / ``load(dir)`` are collective (every rank calls them with the
same directory). "none" and "fsdp2" write one unsharded file, ``engine.pt`` = ``state_dict()``:
trainable drafter weights and AdamW state keyed by the drafter's parameter names, and the
scheduler; the weights are fp32 at either precision (under bf16, the masters). Being unsharded,
it loads at any world size and precision into either of the two kinds.
DeepSpeed writes its own per-rank files (see ``engine_deepspeed.py``).
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


class Engine:
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


class FSDP2Engine(Engine):
    """``fully_shard`` over the dp mesh: parameters, gradients and AdamW state sharded on dim 0.

    One FSDP group (the root `TTTModel`): the single decoder layer runs K times per unroll, so
    per-layer groups would all-gather it K times. bf16 (``MixedPrecisionPolicy``) IS fp32 masters
    with bf16 compute: the sharded parameters, their gradients and the AdamW state stay fp32 (the
    masters), each forward all-gathers bf16 copies, and gradients are reduce-scattered in fp32 and
    accumulated over micro-batches into the fp32 sharded gradients. Forward inputs are not cast
    by FSDP (``cast_forward_inputs=False``: the teacher keeps its dtype); ``unroll`` casts the
    captured states. AdamW is fused on CUDA (it steps the DTensor shards).
    """

    kind = "fsdp2"

    def __init__(self, model: TTTModel, optim: OptimConfig, scheduler_fn, precision: str, mesh):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            device_type = "cuda" if torch.cuda.is_available() else "cpu"
            mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp",))
        if mesh.ndim != 1:
            raise ValueError(f"the fsdp2 engine shards over a 1-D dp mesh; got a {mesh.ndim}-D mesh "
                             f"{mesh.mesh_dim_names}: pass the flattened data-parallel mesh (the whole world).")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
        fully_shard(model, mesh=mesh, mp_policy=mp if precision == "bf16" else MixedPrecisionPolicy())
        super().__init__(model, optim, scheduler_fn, precision, dp_size=mesh.size())

    def _build_optimizer(self, optim: OptimConfig) -> torch.optim.Optimizer:
        # The fp32 shards are the masters at either precision (the policy casts for compute).
        return build_adamw(trainable(self.module), optim.lr, optim.betas, optim.weight_decay)

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, _ = get_state_dict(self.module, [], options=options)
        return {k.removeprefix(PREFIX): v for k, v in model_sd.items()}


def apply_compile(drafter: nn.Module) -> None:
    """``torch.compile`` the drafter's decoder layer (norms, projections, MLP fused by Inductor;
    flex attention is compiled either way). Applied before sharding (torchtitan's order). The layer
    runs once per TTT step with a growing key list, so it compiles once per step count k."""
    drafter.layer.compile()


def build_engine(kind: str, model: nn.Module, optim: OptimConfig, scheduler_fn: Callable[[int], float],
                 mesh=None, precision: str = "fp32", ds_config: dict | None = None,
                 zero_stage: int = 2, compile_layer: bool = False) -> Engine:
    """Wrap ``model`` (the drafter, fp32, identical on every rank) in a training engine. At bf16
    the "none" engine turns ``model``'s parameters into bf16 in place (fp32 masters kept aside).

    mesh: the 1-D data-parallel ``DeviceMesh`` (the drafter is data-parallel over the WHOLE
    world; ``mesh=None``: the world). precision: "fp32" | "bf16" (already resolved, not "auto").
    ds_config / zero_stage: DeepSpeed only (a dict merged over the config built from ``optim``).
    """
    if kind not in ENGINES:
        raise ValueError(f"engine kind {kind!r} is not one of {list(ENGINES)}.")
    if precision not in PRECISIONS:
        raise ValueError(f"engine precision {precision!r} is not one of {list(PRECISIONS)} (resolve 'auto' first).")
    if kind != "deepspeed" and ds_config:
        raise ValueError(f"a DeepSpeed config was given but the engine is {kind!r}; drop it or use 'deepspeed'.")
    if compile_layer:
        apply_compile(model)
    wrapped = TTTModel(model)
    world = dp_world_size(mesh)
    if kind == "none":
        if world != 1:
            raise ValueError(f"engine 'none' keeps one unsharded copy and does not reduce gradients, but the dp "
                             f"world has {world} ranks; use 'fsdp2' or 'deepspeed'.")
        return Engine(wrapped, optim, scheduler_fn, precision)
    if kind == "fsdp2":
        return FSDP2Engine(wrapped, optim, scheduler_fn, precision, mesh)
    from torchspec.train.engine_deepspeed import DeepSpeedEngine

    return DeepSpeedEngine(wrapped, optim, scheduler_fn, precision, mesh, ds_config, zero_stage)
