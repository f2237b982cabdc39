"""Tensor parallelism for the frozen target: a plan per family, applied with DTensor, then sharded loading.

Megatron-style TP on every decoder layer: q/k/v and gate/up are column-parallel (each tp rank
computes whole heads / an equal slice of the MLP width, output stays local), o_proj and down_proj
are row-parallel (partial sums, all-reduced), so every decoder layer's output -- and therefore
every captured aux state and the last hidden state -- is a plain, full, replicated tensor.
Embedding, norms (incl. Qwen3's per-head q_norm / k_norm) and lm_head stay replicated.

Why no head-count surgery: Llama/Qwen3 attention in transformers reshapes projections with
``view(*input_shape, -1, head_dim)`` and the output with ``reshape(*input_shape, -1)``, and GQA
uses ``num_key_value_groups = heads / kv_heads``, which is the same per shard. So the local shard
of a column-parallel output is just "fewer heads" (tests pin the parity against one process).

Loading follows "build on meta, shard, then load": the model is built with empty (meta)
parameters, the plan turns them into DTensors (still meta, no communication), and each rank then
reads from the safetensors files only the slice its DTensor placements say it owns
(`safe_open(...).get_slice`), so no rank ever materialises the whole model.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoModelForCausalLM, PreTrainedModel

from torchspec.distributed import validate_tp_for_target
from torchspec.target.capture import TargetModel, default_aux_layer_ids, validate_aux_layer_ids
from torchspec.target.loader import load_target_config

# Per family (config.model_type): module pattern, relative to the decoder (hf_model.get_decoder()),
# -> style. "*" matches one path atom. Anything not listed stays replicated.
_DENSE_DECODER_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
TP_PLANS: dict[str, dict[str, str]] = {
    "llama": _DENSE_DECODER_PLAN,
    "qwen3": _DENSE_DECODER_PLAN,  # q_norm / k_norm act per head over head_dim: replicated
}

# use_local_output=True: modules see plain local tensors, so HF code runs unchanged; rowwise
# outputs are all-reduced to full replicated tensors before the residual add.
TP_STYLES = {
    "colwise": lambda: ColwiseParallel(use_local_output=True),
    "rowwise": lambda: RowwiseParallel(use_local_output=True),
}


def tp_plan_for(hf_config) -> dict[str, str]:
    model_type = hf_config.get_text_config().model_type
    if model_type not in TP_PLANS:
        raise ValueError(
            f"no tensor-parallel plan for target family model_type={model_type!r}; known: {sorted(TP_PLANS)}. "
            "Use parallel.target_tp=1, or add a plan to torchspec.target.parallelize.TP_PLANS."
        )
    return TP_PLANS[model_type]


def apply_tp(hf_model: PreTrainedModel, tp_mesh: DeviceMesh) -> None:
    """Shard `hf_model`'s decoder layers over the 1-D `tp_mesh` in place (meta or real weights).

    ``src_data_rank=None``: each rank chunks its own copy locally (no scatter from rank 0), which
    is free on meta weights and correct on real ones because every rank loaded the same weights.
    """
    assert tp_mesh.ndim == 1, f"apply_tp needs the 1-D tp submesh (mesh['tp']), got {tp_mesh.ndim}-D"
    validate_tp_for_target(hf_model.config, tp_mesh.size())
    plan = {pattern: TP_STYLES[style]() for pattern, style in tp_plan_for(hf_model.config).items()}
    parallelize_module(hf_model.get_decoder(), tp_mesh, plan, src_data_rank=None)


def load_tp_target(
    path: str,
    tp_mesh: DeviceMesh,
    aux_layer_ids: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> TargetModel:
    """Build the target on meta, apply the TP plan, load only this rank's shards; wrap in TargetModel.

    `path` is a resolved checkpoint directory (`resolve_target_path`). Config checks (aux ids,
    tp divisibility) run before any weight is read.
    """
    config = load_target_config(path)
    num_layers = config.get_text_config().num_hidden_layers
    if aux_layer_ids is None:
        aux_layer_ids = default_aux_layer_ids(num_layers)
    validate_aux_layer_ids(aux_layer_ids, num_layers)
    validate_tp_for_target(config, tp_mesh.size())
    tp_plan_for(config)  # an unknown family fails here, before anything is built
    # Parameters on meta; buffers (rotary inv_freq, computed from the config) stay real.
    with init_empty_weights(include_buffers=False):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # init_empty_weights re-creates every parameter, which unties lm_head from the embedding
    # (transformers 5); re-tie so the tied weight is one tensor, read once.
    hf_model.tie_weights()
    apply_tp(hf_model, tp_mesh)
    device = _mesh_device(tp_mesh)
    load_sharded_weights(hf_model, path, device)
    for module in hf_model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            setattr(module, name, buf.to(device))
    return TargetModel(hf_model, aux_layer_ids)


def load_sharded_weights(model: nn.Module, path: str, device: torch.device) -> None:
    """Fill `model`'s (meta) parameters from `path`'s safetensors: DTensors get only their local slice.

    Tied parameters (one tensor under several names, e.g. lm_head.weight = embed_tokens.weight)
    are read once from whichever name the checkpoint holds and stay tied.
    """
    key_to_file = _safetensors_key_to_file(path)
    by_tensor: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
        params[id(p)] = p
    missing = [names for names in by_tensor.values() if not any(n in key_to_file for n in names)]
    if missing:
        raise ValueError(f"checkpoint {path!r} has no weights for parameters {missing}")
    handles = {f: safe_open(f, framework="pt", device="cpu") for f in sorted(set(key_to_file.values()))}
    for pid, names in by_tensor.items():
        param = params[pid]
        key = next(n for n in names if n in key_to_file)
        stored = handles[key_to_file[key]].get_slice(key)
        if tuple(stored.get_shape()) != tuple(param.shape):
            raise ValueError(
                f"checkpoint {path!r}: {key} has shape {tuple(stored.get_shape())}, the model expects "
                f"{tuple(param.shape)} (does config.json match the weights?)"
            )
        if isinstance(param, DTensor):
            index = _local_index(param)
            local = stored[index].to(device=device, dtype=param.dtype)
            assert local.shape == param.to_local().shape, (key, local.shape, param.to_local().shape)
            value = DTensor.from_local(
                local,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        else:
            value = stored[:].to(device=device, dtype=param.dtype)
        loaded = nn.Parameter(value, requires_grad=False)
        for name in names:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, loaded)


def _local_index(param: DTensor) -> tuple[slice, ...]:
    """The global index range this rank's shard covers (1-D mesh, evenly divisible dims)."""
    (placement,) = param.placements
    index = [slice(None)] * param.ndim
    if isinstance(placement, Shard):
        n = param.device_mesh.size()
        size = param.shape[placement.dim]
        assert size % n == 0, f"dim {placement.dim} of size {size} does not split evenly over {n} tp ranks"
        chunk = size // n
        start = param.device_mesh.get_local_rank() * chunk
        index[placement.dim] = slice(start, start + chunk)
    else:
        assert isinstance(placement, Replicate), placement
    return tuple(index)


def _safetensors_key_to_file(path: str) -> dict[str, str]:
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(
            f"tensor-parallel loading reads *.safetensors, and {path!r} has none; re-save the checkpoint with "
            "save_pretrained() (safetensors is the default)."
        )
    key_to_file = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            key_to_file.update({k: file for k in f.keys()})
    return key_to_file


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
