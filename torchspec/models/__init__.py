"""Drafter architectures. ``DRAFTERS`` maps ``drafter.arch`` to (config class, model class)."""

from __future__ import annotations

from typing import Any

from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter

DRAFTERS: dict[str, tuple[type, type]] = {
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
        fc_post_norm=drafter_cfg.fc_post_norm,
        norm_output=drafter_cfg.norm_output,
        pre_attn_norm=drafter_cfg.pre_attn_norm,
    )


def build_drafter(drafter_cfg: Any, target_config: Any, aux_layer_ids: list[int]):
    _, model_cls = DRAFTERS[drafter_cfg.arch]
    return model_cls(drafter_config_from_target(drafter_cfg, target_config, aux_layer_ids))


__all__ = ["DRAFTERS", "Eagle4Config", "Eagle4Drafter", "build_drafter", "drafter_config_from_target"]
