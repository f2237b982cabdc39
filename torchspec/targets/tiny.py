"""A tiny random target (one flavour per supported family) built from a config: no download, CPU-fast.

The ``debugmodel`` of the target side: unit, distributed and integration tests build one into a
temp dir and load it through the same path as a real checkpoint. Defaults keep 4 KV heads so the
model shards over TP=4. Flavours: llama, mistral (no sliding window), qwen2 (q/k/v bias), qwen3
(per-head q/k norm); transformers builds and saves them, and serves as the oracle in tests.
"""

from __future__ import annotations

import os

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY_FLAVOURS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
# Settings a flavour needs beyond the shared sizes (the decoder supports full attention only).
FLAVOUR_KWARGS = {"mistral": {"sliding_window": None}}


def build_tiny_target(
    out_dir: str,
    flavour: str = "llama",
    vocab_size: int = 384,
    num_layers: int = 8,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    tokenizer=None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.02,
) -> str:
    """Save a tiny random causal LM (safetensors, + `tokenizer` if given) to `out_dir`; return it.

    Weights depend only on `seed` (the global RNG is left untouched). `vocab_size` must cover the
    tokenizer. `initializer_range` > 0.02 gives a peakier (less uniform) target distribution.
    """
    if flavour not in TINY_FLAVOURS:
        raise ValueError(f"tiny target flavour {flavour!r} is not one of {sorted(TINY_FLAVOURS)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"tiny target: hidden_size={hidden_size} must be divisible by num_heads={num_heads}, "
            f"and num_heads by num_kv_heads={num_kv_heads}"
        )
    if tokenizer is not None and len(tokenizer) > vocab_size:
        raise ValueError(
            f"tiny target: vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)}"
        )
    token_ids = {}
    if tokenizer is not None:
        token_ids = {
            name: getattr(tokenizer, name)
            for name in ("bos_token_id", "eos_token_id", "pad_token_id")
            if getattr(tokenizer, name) is not None
        }
    config_cls, model_cls = TINY_FLAVOURS[flavour]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        **FLAVOUR_KWARGS.get(flavour, {}),
        **token_ids,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
