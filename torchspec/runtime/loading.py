"""Build an ``SpeculativeEngine`` from paths: a target checkpoint (HF dir, .gguf, or alias) and a drafter export.

The drafter must be a torchspec export (``torchspec-export``); it is checked against the target's
identity (vocabulary, hidden size, layer count and the weights fingerprint of embedding and LM
head) before it is used, so a drafter exported for another target is refused with both
identities named.
"""

from __future__ import annotations

import os

import torch

from torchspec.export.serving import is_export, load_exported_drafter, weights_fingerprint
from torchspec.runtime.drafter_runner import DrafterRunner
from torchspec.runtime.engine import SpeculativeEngine
from torchspec.targets import TargetDecoder, load_tokenizer, resolve_target_path

DEFAULT_CACHE_DIR = "~/.cache/torchspec"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be 'auto' or one of {sorted(DTYPES)}.")
    return DTYPES[dtype]


def decoder_identity(decoder: TargetDecoder) -> dict:
    """The identity block a drafter export is checked against (see torchspec/export/serving.py)."""
    return {"vocab_size": decoder.vocab_size, "hidden_size": decoder.hidden_size,
            "num_hidden_layers": decoder.num_layers,
            "fingerprint": weights_fingerprint(decoder.embed_tokens_weight, decoder.lm_head_weight)}


def _optional_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when it ships none (then prompts must be token ids)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                  "tokenizer.model", "vocab.json")):
        return None
    return load_tokenizer(path)


def load_engine(target: str, drafter: str | None = None, *, device: str | torch.device | None = None,
                dtype: str | torch.dtype = "auto", tp_group=None, max_batch: int = 8, max_context: int = 2048,
                page_size: int = 16, num_pages: int | None = None, cache_dir: str = DEFAULT_CACHE_DIR,
                **engine_options) -> SpeculativeEngine:
    """Target (dir | .gguf | alias) + optional drafter export -> a `SpeculativeEngine`; ``engine_options``
    go to it unchanged (``prefix_cache``, ``prefill_tokens``, ``cuda_graphs``, ``fuse``)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(dtype, device)
    path = resolve_target_path(target, os.path.expanduser(cache_dir))
    decoder = TargetDecoder.from_pretrained(path, aux_layer_ids=(), dtype=dtype, device=device, tp_group=tp_group)
    tokenizer = _optional_tokenizer(path)
    runner = None
    if drafter is not None:
        if not is_export(drafter):
            raise ValueError(f"drafter {drafter!r} is not a torchspec export (no config.json with "
                             f"torchspec_export_version). Export a training run first: "
                             f"torchspec-export <run_dir> <out_dir>.")
        model = load_exported_drafter(drafter, target=decoder_identity(decoder), dtype=dtype)
        aux = list(model.config.aux_layer_ids)
        if max(aux) >= decoder.num_layers:
            raise ValueError(f"drafter {drafter!r} reads target layers {aux}; the target has {decoder.num_layers}.")
        runner = DrafterRunner(model.to(device), decoder.vocab_size)
    return SpeculativeEngine(decoder, runner, tokenizer, max_batch=max_batch, max_context=max_context, page_size=page_size,
                             num_pages=num_pages, **engine_options)
