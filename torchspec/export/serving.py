"""Drafter -> serving export: one directory a runtime loads, tied to the target it was trained on.

Layout of an export directory::

    config.json         the drafter's own config (every architecture flag + ``flag_meanings``,
                        exactly what ``save_pretrained`` writes, contract 6), plus
                        "target": {vocab_size, hidden_size, num_hidden_layers, aux_layer_ids,
                                   model_type, fingerprint}   the target it must be served with
                        "torchspec_export_version": 1
                        "training": {step, train_tokens}   how far it was trained (absent in exports
                                   converted from elsewhere); train_tokens: real (non-padding) tokens
    model.safetensors   every drafter tensor under the drafter's own names, in the export dtype;
                        integer/bool buffers (EAGLE-3's d2t/t2d) keep their dtype

**The frozen embedding is included.** A runtime needs it, and a self-contained file is what the
SGLang/vLLM EAGLE-3 checkpoints ship too. It costs V*H elements (248K x 5120 in bf16: 2.5 GB);
the fingerprint below lets a runtime check it belongs to the target it is paired with.

**Target fingerprint** (``weights_fingerprint``): the first 16 hex digits of sha256 over
``"V,H"`` and then, for the embedding and for the lm_head in that order, the rows at
``linspace(0, V-1, 64)`` (rounded down; first and last rows always included), each rounded to
bf16 and written as little-endian fp32 bytes. It reads 2 x 64 rows, so it is cheap for a
248K x 5120 target, and depends on weight values only: a tied target (lm_head *is* the
embedding) and an untied checkpoint holding equal copies hash alike, and the bf16 rounding makes
an fp32-loaded and a bf16-loaded copy of one checkpoint hash alike too.

Loading is strict (``load_exported_drafter``): unknown/missing config keys, unknown/missing/
mis-shaped tensors and a target that does not match are refused with their names; nothing is
ever skipped or initialised silently. A training run writes its final drafter in this format
(``<output_dir>/drafter``, recipes/train.py); ``export_from_checkpoint`` (``checkpoint_export.py``,
``torchspec-export``) rebuilds the drafter of any step of a run (``<run_dir>/config.yaml`` +
``checkpoints/step_N``) and exports it, reading only the embedding and lm_head of the target.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from torchspec.io import atomic_save_dir
from torchspec.models import DRAFTERS

EXPORT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FINGERPRINT_ROWS = 64
# What a target must agree on for a drafter to be served with it.
IDENTITY_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "fingerprint")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


# --- target identity ---------------------------------------------------------------------------------

@torch.no_grad()
def weights_fingerprint(embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> str:
    """Short stable hash of a target's embedding and lm_head, both [V, H] (see module docstring)."""
    v, h = embed_weight.shape
    if tuple(lm_head_weight.shape) != (v, h):
        raise ValueError(f"target fingerprint: embedding {tuple(embed_weight.shape)} and lm_head "
                         f"{tuple(lm_head_weight.shape)} must both be [vocab, hidden].")
    rows = torch.linspace(0, v - 1, FINGERPRINT_ROWS, dtype=torch.float64).long().unique()
    digest = hashlib.sha256(f"{v},{h}".encode())
    for weight in (embed_weight, lm_head_weight):
        sample = weight.detach().index_select(0, rows.to(weight.device)).to("cpu", torch.bfloat16).float()
        digest.update(sample.numpy().astype("<f4").tobytes())
    return digest.hexdigest()[:16]


def target_identity(target_model) -> dict[str, Any]:
    """The identity block of an export, from a ``torchspec.targets.TargetDecoder`` or the
    `TargetEmbeddings` of its checkpoint (equal for the same checkpoint: tested)."""
    return {
        "vocab_size": int(target_model.vocab_size),
        "hidden_size": int(target_model.hidden_size),
        "num_hidden_layers": int(target_model.num_layers),
        "aux_layer_ids": [int(i) for i in target_model.aux_layer_ids],
        "model_type": target_model.config.model_type,
        "fingerprint": weights_fingerprint(target_model.embed_tokens_weight, target_model.lm_head_weight),
    }


@dataclass
class TargetEmbeddings:
    """What an export needs of a target, read from its checkpoint without building the model
    (`read_target_embeddings`): the text config, the aux layer ids and the [V, H] embedding and
    lm_head. Attribute names as ``TargetDecoder``'s, so `target_identity` and a drafter's
    ``init_from_target`` take either."""

    config: Any  # the HF text config
    aux_layer_ids: list[int]
    embed_tokens_weight: torch.Tensor  # [V, H]
    lm_head_weight: torch.Tensor  # [V, H]; the embedding itself for a tied target

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)


def read_target_embeddings(path: str, aux_layer_ids: list[int], dtype: torch.dtype) -> TargetEmbeddings:
    """The embedding and lm_head of the target checkpoint directory ``path`` (resolved:
    ``torchspec.targets.resolve_target_path``), each read whole with ``safe_open(...).get_tensor``
    and cast to ``dtype`` exactly as ``TargetDecoder.from_pretrained`` casts them; no other tensor is
    read. Key names and tying follow the target package (``checkpoint_key``, the family's
    ``tied_lm_head``), so the identity equals the loaded decoder's."""
    from torchspec.targets import family_of, load_target_config, validate_aux_layer_ids
    from torchspec.targets.loader import checkpoint_key, decoder_prefix, safetensors_files

    config = load_target_config(path).get_text_config()
    args = family_of(config).decoder_args(config)
    validate_aux_layer_ids(list(aux_layer_ids), args.num_layers)
    files = safetensors_files(path)
    prefix = decoder_prefix(files)  # model. or, in a multimodal checkpoint (Qwen3.5), model.language_model.
    tensors = {}
    for name in ["embed_tokens.weight"] + ([] if args.tied_lm_head else ["lm_head.weight"]):
        key = checkpoint_key(name, prefix)
        if key not in files:
            raise ValueError(f"target checkpoint {path!r} has no {key} (tie_word_embeddings={args.tied_lm_head}); "
                             f"does config.json match the weights?")
        with safe_open(files[key], framework="pt") as f:
            tensor = f.get_tensor(key)
        if list(tensor.shape) != [args.vocab_size, args.hidden_size]:
            raise ValueError(f"target checkpoint {path!r}: {key} has shape {list(tensor.shape)}, config.json says "
                             f"[{args.vocab_size}, {args.hidden_size}].")
        tensors[name] = tensor.to(dtype)
    embed = tensors["embed_tokens.weight"]
    return TargetEmbeddings(config, [int(i) for i in aux_layer_ids], embed, tensors.get("lm_head.weight", embed))


# --- export ----------------------------------------------------------------------------------------

def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {sorted(DTYPES)}.")
    return DTYPES[dtype]


def _is_export_dir(path: Path) -> bool:
    try:
        return "torchspec_export_version" in json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False


def _check_drafter_matches_target(config, target: dict[str, Any]) -> None:
    pairs = {"vocab_size": (config.vocab_size, target["vocab_size"]),
             "hidden_size": (config.hidden_size, target["hidden_size"]),
             "num_hidden_layers": (config.target_num_layers, target["num_hidden_layers"]),
             "aux_layer_ids": (list(config.aux_layer_ids), list(target["aux_layer_ids"]))}
    differ = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if differ:
        raise ValueError("export: the drafter was not built for this target: " + ", ".join(
            f"{k} drafter {a} vs target {b}" for k, (a, b) in differ.items()) + ".")


def export_drafter(drafter: nn.Module, out_dir: str | Path, *, dtype: torch.dtype | str,
                   target_identity: dict[str, Any], training: dict[str, int] | None = None) -> dict[str, Any]:
    """Write ``drafter`` as an export directory (layout: module docstring); returns a summary.
    ``training``: {"step", "train_tokens"} of the run it comes from, recorded in config.json.

    Atomic: written into a temporary sibling and renamed into place, so ``out_dir`` is the old
    export or the new one, never half of one. An existing ``out_dir`` that is neither empty nor an
    export is refused rather than replaced.
    """
    dtype = _resolve_dtype(dtype)
    out_dir = Path(out_dir)
    missing = [k for k in (*IDENTITY_KEYS, "aux_layer_ids", "model_type") if k not in target_identity]
    if missing:
        raise ValueError(f"export: target_identity lacks {missing}; build it with target_identity(target).")
    _check_drafter_matches_target(drafter.config, target_identity)
    if out_dir.exists() and not (out_dir.is_dir() and (not any(out_dir.iterdir()) or _is_export_dir(out_dir))):
        raise ValueError(f"export: {out_dir} exists and is not a torchspec export; refusing to overwrite it. "
                         f"Choose a new or empty directory.")

    tensors = {name: (t.detach().to("cpu", dtype) if t.is_floating_point() else t.detach().cpu()).contiguous()
               for name, t in drafter.state_dict().items()}
    config = drafter.config.to_dict()
    config["architectures"] = [type(drafter).__name__]
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["target"] = {k: target_identity[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                        "aux_layer_ids", "model_type", "fingerprint")}
    config["torchspec_export_version"] = EXPORT_VERSION
    if training is not None:
        config["training"] = {"step": int(training["step"]), "train_tokens": int(training["train_tokens"])}

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())

    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()  # an empty directory is "new": let the rename create it
    atomic_save_dir(out_dir, write)
    return {"path": str(out_dir), "num_tensors": len(tensors),
            "num_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "dtype": config["dtype"], "target": config["target"]}


# --- strict load -----------------------------------------------------------------------------------

def _drafter_classes(model_type: str | None) -> tuple[type, type]:
    for config_cls, model_cls in DRAFTERS.values():
        if config_cls.model_type == model_type:
            return config_cls, model_cls
    known = sorted(c.model_type for c, _ in DRAFTERS.values())
    raise ValueError(f"export config.json: model_type={model_type!r} is not a torchspec drafter; known: {known}.")


def check_target(expected: dict[str, Any], target, source: str = "this drafter") -> None:
    """Refuse a target (TargetDecoder or identity dict) whose identity differs from ``expected``."""
    got = target if isinstance(target, dict) else target_identity(target)
    differ = [k for k in IDENTITY_KEYS if expected.get(k) != got.get(k)]
    if differ:
        def show(d: dict) -> str:
            return ", ".join(f"{k} {d.get(k)}" for k in differ)
        raise ValueError(f"{source} was exported for a target with {show(expected)}; got a target with {show(got)}. "
                         f"Serve it with the target it was trained on.")


def _cast_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters and persistent floating buffers; non-persistent tables (RoPE inv_freq) stay fp32."""
    for module in model.modules():
        for p in module.parameters(recurse=False):
            p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point() and name not in module._non_persistent_buffers_set:
                setattr(module, name, b.to(dtype))


def is_export(path: str | Path) -> bool:
    """True if ``path`` holds a torchspec-export directory (config.json with a target block)."""
    config = Path(path) / "config.json"
    return config.is_file() and "torchspec_export_version" in json.loads(config.read_text())


def load_exported_drafter(path: str | Path, *, target=None, dtype: torch.dtype | str | None = None,
                          attn_backend: str = "chunked") -> nn.Module:
    """Load an export strictly; ``target`` (TargetDecoder or identity dict) is checked if given.

    ``dtype``: the dtype of the returned drafter's floating weights (default: the export's).
    """
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{path} is not a torchspec export: it needs {CONFIG_FILE} and {WEIGHTS_FILE}.")
    config_dict = json.loads(config_file.read_text())
    version = config_dict.pop("torchspec_export_version", None)
    if version != EXPORT_VERSION:
        raise ValueError(f"{config_file}: torchspec_export_version={version!r}, this torchspec reads {EXPORT_VERSION}.")
    expected_target = config_dict.pop("target", None)
    config_dict.pop("training", None)  # how far it was trained: read by export_training
    if not isinstance(expected_target, dict) or any(k not in expected_target for k in IDENTITY_KEYS):
        raise ValueError(f"{config_file}: the 'target' block must hold {list(IDENTITY_KEYS)}.")
    if target is not None:
        check_target(expected_target, target, source=f"the drafter at {path}")

    config_cls, model_cls = _drafter_classes(config_dict.get("model_type"))
    config_cls.check_keys(config_dict, source=str(config_file))
    config = config_cls(**{k: v for k, v in config_dict.items() if k in config_cls.ARCH_FIELDS})
    model = model_cls(config, attn_backend=attn_backend)

    expected = model.state_dict()
    with safe_open(str(weights_file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    shapes = [f"{k} {list(tensors[k].shape)} (expected {list(expected[k].shape)})"
              for k in sorted(set(tensors) & set(expected)) if tensors[k].shape != expected[k].shape]
    kinds = [f"{k} {tensors[k].dtype} (expected {expected[k].dtype})" for k in sorted(set(tensors) & set(expected))
             if not expected[k].is_floating_point() and tensors[k].dtype != expected[k].dtype]
    problems = [f"{label}: {items}" for label, items in (
        ("unknown tensors", [f"{k} {list(tensors[k].shape)}" for k in unknown]),
        ("missing tensors", [f"{k} {list(expected[k].shape)}" for k in missing]),
        ("mis-shaped tensors", shapes), ("wrong-dtype buffers", kinds)) if items]
    if problems:
        raise ValueError(f"{weights_file} does not match {model_cls.__name__} built from its config.json: "
                         + "; ".join(problems) + ".")
    model.load_state_dict(tensors, strict=True)  # EAGLE-3: checks and locks the loaded vocab mapping
    float_dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    out_dtype = _resolve_dtype(dtype) if dtype is not None else (float_dtypes.pop() if len(float_dtypes) == 1
                                                                 else torch.float32)
    _cast_weights(model, out_dtype)
    return model.eval()


def export_training(path: str | Path) -> dict[str, int] | None:
    """The export's {"step", "train_tokens"} (None when it does not record its training)."""
    return json.loads((Path(path) / CONFIG_FILE).read_text()).get("training")
