"""Drafter architectures. ``DRAFTERS`` maps ``drafter.arch`` to (config class, model class)."""

from __future__ import annotations

from typing import Any

from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter
from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter

DRAFTERS: dict[str, tuple[type, type]] = {
    "eagle3": (Eagle3Config, Eagle3Drafter),
    "eagle4": (Eagle4Config, Eagle4Drafter),
}


def _rope_theta(target_config: Any) -> float:
    params = getattr(target_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"target rope_type={rope_type!r}: the drafter implements default RoPE only; "
            f"use a target with default RoPE or extend torchspec.models.layers.RotaryEmbedding."
        )
    return float(params.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)))


def drafter_config_from_target(drafter_cfg: Any, target_config: Any, aux_layer_ids: list[int]):
    """Build the architecture config of ``drafter_cfg.arch`` sized for ``target_config``."""
    config_cls, _ = DRAFTERS[drafter_cfg.arch]
    heads = drafter_cfg.num_attention_heads or target_config.num_attention_heads
    kv_heads = drafter_cfg.num_key_value_heads or getattr(target_config, "num_key_value_heads", None) or heads
    head_dim = drafter_cfg.head_dim or getattr(target_config, "head_dim", None)
    head_dim = head_dim or target_config.hidden_size // target_config.num_attention_heads
    return config_cls(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=drafter_cfg.intermediate_size or target_config.intermediate_size,
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(target_config),
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 4096)),
        aux_layer_ids=list(aux_layer_ids),
        target_num_layers=target_config.num_hidden_layers,
        fc_norm=drafter_cfg.fc_norm,
        norm_output=drafter_cfg.norm_output,
        **_arch_flags(drafter_cfg, target_config),
    )


def _arch_flags(d: Any, target_config: Any) -> dict[str, Any]:
    """The flags only one architecture has (the configs refuse the others' flags)."""
    if d.arch == "eagle3":
        return {"draft_vocab_size": d.draft_vocab_size or target_config.vocab_size}
    return {
        "fc_post_norm": d.fc_post_norm, "pre_attn_norm": d.pre_attn_norm, "sliding_window": d.sliding_window,
        "nope": d.nope, "moe": d.moe, "moe_num_experts": d.moe_num_experts, "moe_top_k": d.moe_top_k,
        "moe_intermediate_size": d.moe_intermediate_size, "moe_shared_expert": d.moe_shared_expert,
        "moe_norm_topk_prob": d.moe_norm_topk_prob, "moe_extra_norm": d.moe_extra_norm,
        "lm_head_rank": d.lm_head_rank, "lm_head_topk": d.lm_head_topk,
    }


def build_drafter(drafter_cfg: Any, target_config: Any, aux_layer_ids: list[int]):
    _, model_cls = DRAFTERS[drafter_cfg.arch]
    return model_cls(drafter_config_from_target(drafter_cfg, target_config, aux_layer_ids),
                     attn_backend=drafter_cfg.attn_backend)


__all__ = ["DRAFTERS", "Eagle3Config", "Eagle3Drafter", "Eagle4Config", "Eagle4Drafter", "build_drafter", "drafter_config_from_target"]
