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
same directory). "none" and "fsdp2" go through ``torch.distributed.checkpoint`` (DCP) into
``dir/engine/``: ``resume_state()`` = trainable drafter weights (fp32 at either precision; under
bf16 the masters) and persistent buffers, AdamW state, both keyed by the drafter's own parameter
names, and the scheduler. Every rank writes its own shard (nothing is gathered on rank 0) and DCP
reshards on load, so a checkpoint loads at any world size and precision into either of the two
kinds. ``save(dir, async_save=True)`` writes in a background thread (``checkpoint.py`` publishes
the checkpoint once it completed). DeepSpeed writes its own per-rank files (see ``engine_deepspeed.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from torchspec.train.engine_base import (
    ENGINES,
    PRECISIONS,
    PREFIX,
    OptimConfig,
    TrainingEngine,
    TTTModel,
    dp_world_size,
    trainable,
)
from torchspec.train.engine_deepspeed import DeepSpeedEngine
from torchspec.train.optim import build_adamw

__all__ = ["ENGINES", "DeepSpeedEngine", "FSDP2Engine", "OptimConfig", "TrainingEngine", "build_engine"]


class FSDP2Engine(TrainingEngine):
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
                 zero_stage: int = 2, compile_layer: bool = False) -> TrainingEngine:
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
        return TrainingEngine(wrapped, optim, scheduler_fn, precision)
    if kind == "fsdp2":
        return FSDP2Engine(wrapped, optim, scheduler_fn, precision, mesh)
    return DeepSpeedEngine(wrapped, optim, scheduler_fn, precision, mesh, ds_config, zero_stage)
