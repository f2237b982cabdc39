"""A tiny random target (one flavour per supported family) built from a config: no download, CPU-fast.

The ``debugmodel`` of the target side: unit, distributed and integration tests build one into a
temp dir and load it through the same path as a real checkpoint. Defaults keep 4 KV heads so the
model shards over TP=4. Flavours: llama, mistral (no sliding window), qwen2 (q/k/v bias), qwen3
(per-head q/k norm), and the hybrid Gated-DeltaNet targets qwen3_next (MoE with a shared expert)
and qwen3_5 (saved as the multimodal checkpoint Qwen3.5 ships, with a one-block vision tower);
transformers builds and saves them, and serves as the oracle in tests.

Hybrid flavours get the real layer pattern (full attention every 4th layer), partial RoPE, 4 key /
8 value GDN heads and, since HF initialises their 1-D weights to constants (norms 0 or 1, dt_bias 1)
and A_log to decays that forget within a token, seeded random norms, dt_bias and A_log (decay
exp(g) around 0.5 - 0.95), so a test cannot pass with a norm, a gate or the recurrence ignored.
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
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

TINY_FLAVOURS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
# Hybrid Gated-DeltaNet flavours, kept apart: tests parametrised over TINY_FLAVOURS are attention-only.
TINY_HYBRID_FLAVOURS = {
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
    "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
}
_ALL_FLAVOURS = {**TINY_FLAVOURS, **TINY_HYBRID_FLAVOURS}
# Settings a flavour needs beyond the shared sizes (the decoder supports full attention only).
_GDN = {"linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4}
FLAVOUR_KWARGS = {
    "mistral": {"sliding_window": None},
    "qwen3_next": {**_GDN, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48, "mlp_only_layers": [2]},
    "qwen3_5": _GDN,
}


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
    if flavour not in _ALL_FLAVOURS:
        raise ValueError(f"tiny target flavour {flavour!r} is not one of {sorted(_ALL_FLAVOURS)}")
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
    config_cls, model_cls = _ALL_FLAVOURS[flavour]
    text = dict(
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
    if flavour in TINY_HYBRID_FLAVOURS:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if flavour == "qwen3_5":  # text config inside the multimodal one; text-only M-RoPE sections
        n = hidden_size // num_heads // 8  # rotary frequencies: head_dim * 0.25 / 2
        hw = [n // 2, 0] if n < 3 else [n // 3, n // 3]
        text["rope_parameters"].update(mrope_section=[n - sum(hw), *hw], mrope_interleaved=True)
        vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": hidden_size}
        config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings)
    else:
        config = config_cls(**text)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
        if flavour in TINY_HYBRID_FLAVOURS:
            _randomise_constants(model)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def _randomise_constants(model: torch.nn.Module) -> None:
    """Random values for the weights HF initialises to constants, and A_log for moderate decays."""
    for name, param in model.named_parameters():
        if name.endswith("A_log"):
            param.copy_(torch.empty_like(param).uniform_(0.05, 0.6).log())
        elif name.endswith("dt_bias"):
            param.copy_(torch.randn_like(param) * 0.5 - 1.0)
        elif param.ndim == 1 and "norm" in name:
            param.add_(torch.randn_like(param) * 0.2)
