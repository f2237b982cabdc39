"""Rotary position embeddings of the target decoder, matching Hugging Face bit for bit.

``RopeTables.from_config(config)`` reads the checkpoint's RoPE settings and computes the inverse
frequencies once; ``tables(positions, dtype)`` then gives ``cos, sin : [*positions.shape, head_dim]``
for integer positions of any shape (prefill, decode, or per-node tree positions), and
``apply_rope(x, cos, sin)`` rotates with HF Llama's rotate-half convention (serving runs it inside
`torchspec.targets.layers.qk_norm_rope`: q and k in one kernel on CUDA). With a
``partial_rotary_factor`` < 1 (Qwen3-Next / Qwen3.5: 0.25) the tables cover only the leading
``rotary_dim`` dims of a head and `apply_rope` passes the rest through; which families accept a
partial factor is each family's ``decoder_args`` business (the Llama family refuses it).

Settings are read from ``config.rope_parameters`` (transformers 5: a dict with ``rope_type``,
``rope_theta``, ``factor``, ...) or, for older configs, from ``rope_theta`` + ``rope_scaling``
(whose type key may be spelled ``type``). Supported ``rope_type``: see ``ROPE_INV_FREQ``. The
formulas are transcribed from transformers' ``modeling_rope_utils.py`` (same op order, so the
fp32 tables are identical; a test compares them with the HF model's buffers):

- ``default``: ``inv_freq = 1 / theta^(2i / d)``.
- ``linear``: default divided by ``factor``.
- ``dynamic`` (NTK): HF recomputes the base whenever a sequence grows past
  ``max_position_embeddings``. We compute it ONCE for ``seq_len = max_position_embeddings``, which
  equals the default table, i.e. exact for every position below ``max_position_embeddings`` and
  no dynamic stretching beyond it (a static table is what CUDA graphs need).
- ``llama3``: Llama 3.1's wavelength-banded scaling.
- ``yarn``: ramp between interpolated and extrapolated frequencies, plus the attention factor
  ("mscale") that HF multiplies into cos and sin; we do the same.

cos/sin are computed on the fly from ``positions * inv_freq`` (as HF does) rather than gathered
from a precomputed table: no maximum length, same numbers, and no host sync either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

DEFAULT_THETA = 10_000.0


def rope_parameters(config) -> dict:
    """The config's RoPE settings as one flat dict with ``rope_type``, ``rope_theta`` and ``partial_rotary_factor``."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"config.rope_parameters is nested per layer type ({sorted(params)}); only one RoPE setting "
            "shared by all layers is supported (Llama / Qwen3 families)."
        )
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or DEFAULT_THETA
    if params["rope_type"] in ("llama3", "yarn"):
        # HF: a top-level original_max_position_embeddings wins, else the rope dict's, else the max.
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    params["partial_rotary_factor"] = 1.0 if partial is None else partial
    return params


def rotary_dim(config) -> int:
    """How many leading dims of each head RoPE rotates: ``int(head_dim * partial_rotary_factor)`` (HF's rule)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * rope_parameters(config)["partial_rotary_factor"])


def _default(config, p: dict) -> tuple[Tensor, float]:
    dim = rotary_dim(config)
    return 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0


def _linear(config, p: dict) -> tuple[Tensor, float]:
    inv_freq, _ = _default(config, p)
    inv_freq /= p["factor"]
    return inv_freq, 1.0


def _dynamic(config, p: dict) -> tuple[Tensor, float]:
    # HF's NTK base at seq_len = max_position_embeddings (see the module docstring): factor * L / L.
    dim, max_len, factor = rotary_dim(config), config.max_position_embeddings, p["factor"]
    base = p["rope_theta"] * ((factor * max_len / max_len) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0


def _llama3(config, p: dict) -> tuple[Tensor, float]:
    inv_freq, _ = _default(config, p)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn(config, p: dict) -> tuple[Tensor, float]:
    dim, base = rotary_dim(config), p["rope_theta"]
    original = p["original_max_position_embeddings"]
    factor = p.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


# rope_type -> (config, flat rope parameters) -> (inv_freq [rotary_dim / 2] fp32, attention scaling)
ROPE_INV_FREQ: dict[str, Callable[..., tuple[Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
}


def rope_inv_freq(config) -> tuple[Tensor, float]:
    """``(inv_freq [rotary_dim // 2] fp32 on CPU, attention_scaling)`` for the config's RoPE settings."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_INV_FREQ:
        raise ValueError(
            f"config rope_type={rope_type!r} (rope_parameters / rope_scaling) is not supported; "
            f"supported: {sorted(ROPE_INV_FREQ)}."
        )
    return ROPE_INV_FREQ[rope_type](config, params)


class RopeTables(nn.Module):
    """cos/sin for integer positions: ``forward(positions [...], dtype) -> (cos, sin) [..., rotary_dim]``."""

    def __init__(self, inv_freq: Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [rotary_dim // 2]
        self.attention_scaling = attention_scaling

    @classmethod
    def from_config(cls, config, device: torch.device | str = "cpu") -> RopeTables:
        inv_freq, attention_scaling = rope_inv_freq(config)
        return cls(inv_freq.to(device), attention_scaling)

    def forward(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [..., rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., rotary_dim]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [..., head_dim]`` by the angles whose cos/sin ``[..., rotary_dim]`` broadcast against it.

    Partial rotary (rotary_dim < head_dim, Qwen3-Next / Qwen3.5): only the leading rotary_dim dims
    turn, the rest pass through (HF's split; the branch is on shapes, not data)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat(((x_rot * cos) + (rotate_half(x_rot) * sin), x_pass), dim=-1)

