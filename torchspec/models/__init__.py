"""Drafter architectures. ``DRAFTERS`` maps ``drafter.arch`` to (config class, model class).

Every model class implements the drafter interface (``torchspec.models.base.Drafter``). Each
architecture's flags are declared once, in its config class's ``ARCH_FIELDS``; ``drafter_keys``
derives the ``drafter.*`` keys an architecture reads from them, and ``drafter_config_from_target``
maps those keys (plus the target's sizes) to the model config.
"""

from __future__ import annotations

from typing import Any

from torchspec.models.base import Drafter
from torchspec.models.config_base import FROM_TARGET, Flag
from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter
from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter

DRAFTERS: dict[str, tuple[type, type[Drafter]]] = {
    "eagle4": (Eagle4Config, Eagle4Drafter),
    "eagle3": (Eagle3Config, Eagle3Drafter),
}
DEFAULT_ARCH = "eagle4"  # the training config's defaults are this architecture's


def drafter_keys(arch: str) -> dict[str, Flag]:
    """The ``drafter.*`` architecture keys ``arch`` reads: its ARCH_FIELDS minus what comes from the target."""
    config_cls, _ = DRAFTERS[arch]
    return {name: flag for name, flag in config_cls.ARCH_FIELDS.items() if name not in FROM_TARGET}


def all_drafter_keys() -> dict[str, Flag]:
    """Every architecture's keys; a key two architectures share takes ``DEFAULT_ARCH``'s default."""
    out: dict[str, Flag] = {}
    for arch in (DEFAULT_ARCH, *DRAFTERS):
        for name, flag in drafter_keys(arch).items():
            out.setdefault(name, flag)
    return out


def arch_display_name(arch: str) -> str:
    """'eagle4' -> 'EAGLE-4' (for messages)."""
    return arch.upper().replace("EAGLE", "EAGLE-")


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
    """Build the architecture config of ``drafter_cfg.arch`` sized for ``target_config``: every key of
    ``drafter_keys(arch)`` is read from ``drafter_cfg``; a null size takes the target's value."""
    config_cls, _ = DRAFTERS[drafter_cfg.arch]
    flags = {name: getattr(drafter_cfg, name) for name in drafter_keys(drafter_cfg.arch)}
    t = target_config
    flags["num_attention_heads"] = flags["num_attention_heads"] or t.num_attention_heads
    flags["num_key_value_heads"] = (flags["num_key_value_heads"] or getattr(t, "num_key_value_heads", None)
                                    or flags["num_attention_heads"])
    flags["head_dim"] = (flags["head_dim"] or getattr(t, "head_dim", None)
                         or t.hidden_size // t.num_attention_heads)
    flags["intermediate_size"] = flags["intermediate_size"] or t.intermediate_size
    if "draft_vocab_size" in flags:  # null: the full target vocabulary
        flags["draft_vocab_size"] = flags["draft_vocab_size"] or t.vocab_size
    return config_cls(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        rms_norm_eps=float(getattr(t, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(t),
        max_position_embeddings=int(getattr(t, "max_position_embeddings", 4096)),
        aux_layer_ids=list(aux_layer_ids),
        target_num_layers=t.num_hidden_layers,
        **flags,
    )


def build_drafter(drafter_cfg: Any, target_config: Any, aux_layer_ids: list[int]) -> Drafter:
    _, model_cls = DRAFTERS[drafter_cfg.arch]
    return model_cls(drafter_config_from_target(drafter_cfg, target_config, aux_layer_ids),
                     attn_backend=drafter_cfg.attn_backend)


__all__ = ["DEFAULT_ARCH", "DRAFTERS", "Drafter", "Eagle3Config", "Eagle3Drafter", "Eagle4Config", "Eagle4Drafter",
           "all_drafter_keys", "build_drafter", "drafter_config_from_target", "drafter_keys"]
