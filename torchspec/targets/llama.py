"""The Llama-family decoder layer: llama, mistral (no sliding window), qwen2 (q/k/v bias), qwen3 (q/k norm).

One layer, as transformers computes it (same op order, so fp32 results match the oracle)::

    x = x + o_proj(attend(layer, rope(q_norm(q_proj(n))), rope(k_norm(k_proj(n))), v_proj(n)))   n = input_layernorm(x)
    x = x + down_proj(silu(gate_proj(m)) * up_proj(m))                                             m = post_attention_layernorm(x)

The layer computes q, k, v (bias and per-head q/k RMSNorm as the family says, then RoPE) and
hands them to the caller's `Attend` (``torchspec/attend.py``): dense causal attention for training
capture (`torchspec.targets.capture.DenseAttend`), paged attention over the KV cache for serving
(`torchspec.runtime.paged_kv.PagedAttend`). Which keys a query sees is the attend's business.

What differs between the supported model types is one row of ``FAMILIES``; everything that does
not fit (sliding-window layers, another activation, partial RoPE) is refused by `decoder_args`
before any weight loads. Module names mirror the HF checkpoint keys (``layers.3.mlp.up_proj.weight``
is ``model.layers.3.mlp.up_proj.weight``), so loading needs no name adapter. Serving then fuses
q|k|v and gate|up into one GEMM each (``DecoderLayer.fuse``, after loading:
`torchspec.targets.layers.fuse_linears`).

Tensor parallelism (``TP_PLAN``, Megatron style, the same plan transformers ships as
``base_model_tp_plan``): q/k/v and gate/up are column-parallel (each rank holds heads/tp query
heads, kv_heads/tp KV heads, intermediate/tp of the MLP), o/down are row-parallel and all-reduced
over the tp group (`torchspec.targets.layers.row_parallel`). Embedding, norms (incl. Qwen3's
q/k norms, which act per head) and the lm_head are replicated, so every rank holds the full
hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor, nn

from torchspec.attend import Attend
from torchspec.targets.layers import (
    MLP,
    RMSNorm,
    fuse_linears,
    qk_norm_rope,
    qk_norm_rope_fused,
    row_parallel,
)
from torchspec.targets.loader import check_tp_size
from torchspec.targets.rope import rope_parameters


@dataclass(frozen=True)
class Family:
    """What differs between supported model types: a bool, or the config attribute holding it."""

    qk_norm: bool
    qkv_bias: bool | str
    o_bias: bool | str
    mlp_bias: bool | str


FAMILIES: dict[str, Family] = {
    "llama": Family(qk_norm=False, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "mistral": Family(qk_norm=False, qkv_bias=False, o_bias=False, mlp_bias=False),
    "qwen2": Family(qk_norm=False, qkv_bias=True, o_bias=False, mlp_bias=False),
    "qwen3": Family(qk_norm=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False),
}

Norm = RMSNorm  # the final norm's class (`TargetDecoder.norm`)

# Module inside a decoder layer -> TP style (`torchspec.targets.layers.TP_STYLES`). Others: replicated.
TP_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


@dataclass(frozen=True)
class LlamaArgs:
    """Sizes and switches of one TP shard, validated from an HF config (`decoder_args`)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # local (per tp rank)
    num_kv_heads: int  # local
    head_dim: int
    intermediate_size: int  # local
    rms_norm_eps: float
    tied_lm_head: bool
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    recurrent: None = None  # no Gated DeltaNet layers (`torchspec.targets.hybrid.RecurrentShape` there)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return ("attention",) * self.num_layers


def _flag(config, value: bool | str) -> bool:
    return bool(getattr(config, value, False)) if isinstance(value, str) else value


def _refuse(key: str, value, supported: str):
    raise ValueError(f"config {key}={value!r} is not supported by TargetDecoder; supported: {supported}.")


def tp_sharded_sizes(config) -> dict[str, int]:
    """The sizes TP splits over the ranks (each must divide by the tp size)."""
    heads = config.num_attention_heads
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": config.intermediate_size,
    }


def decoder_args(config, tp_size: int = 1) -> LlamaArgs:
    """Validate `config` (attention variant, activation, tp divisibility) and size one shard."""
    fam = FAMILIES[config.model_type]
    if getattr(config, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", config.hidden_act, "'silu' (SwiGLU)")
    layer_types = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
    if layer_types != ["full_attention"]:
        _refuse("layer_types", layer_types, "all 'full_attention' (no sliding window)")
    if config.model_type == "mistral" and config.sliding_window is not None:
        _refuse("sliding_window", config.sliding_window, "null (no sliding-window attention)")
    if rope_parameters(config)["partial_rotary_factor"] != 1:
        _refuse("partial_rotary_factor", rope_parameters(config)["partial_rotary_factor"], "1.0 (the whole head_dim)")
    sizes = tp_sharded_sizes(config)
    check_tp_size(sizes, tp_size)
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    return LlamaArgs(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads // tp_size,
        num_kv_heads=kv_heads // tp_size,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=config.intermediate_size // tp_size,
        rms_norm_eps=config.rms_norm_eps,
        tied_lm_head=bool(getattr(config, "tie_word_embeddings", False)),
        qk_norm=fam.qk_norm,
        qkv_bias=_flag(config, fam.qkv_bias),
        o_bias=_flag(config, fam.o_bias),
        mlp_bias=_flag(config, fam.mlp_bias),
    )


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs, layer_index: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.a, self.layer_index, self.group = a, layer_index, group
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.qkv_proj: nn.Linear | None = None  # set by `fuse` (serving)
        self.fused = False  # serving on CUDA: q/k norm + RoPE of q and k as one kernel

    def fuse(self) -> None:
        """One q|k|v GEMM instead of three (serving): the weights move into one tensor."""
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        b, t, _ = x.shape
        a = self.a
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([a.num_heads * a.head_dim, *[a.num_kv_heads * a.head_dim] * 2], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, a.num_heads, a.head_dim)
        k = k.view(b, t, a.num_kv_heads, a.head_dim)
        v = v.view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)  # [B, kv_heads, T, D]
        # Qwen3: per-head RMSNorm before RoPE; q, k -> [B, heads, T, D]
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if a.qk_norm else ()
        q, k = (qk_norm_rope_fused if self.fused else qk_norm_rope)(q, k, cos, sin, *norms)
        out = attend(self.layer_index, q, k, v)  # [B, heads, T, D]
        return row_parallel(self.o_proj, out.transpose(1, 2).reshape(b, t, -1), self.group)


class DecoderLayer(nn.Module):
    """``forward(x [B, T, H], cos, sin [B, 1, T, D], attend) -> [B, T, H]``: the residual stream after the layer.

    ``forward_pending`` is the same layer in serving's form (`TargetDecoder.forward` when fused): each
    residual add is done inside the norm that follows it (`RMSNorm.add_norm`, one kernel on CUDA), so
    the layer takes and returns the stream as ``x + delta`` with the add still pending."""

    def __init__(self, a: LlamaArgs, layer_index: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a, layer_index, group)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a.hidden_size, a.intermediate_size, group, bias=a.mlp_bias)

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_pending(self, x: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor,
                        attend: Attend) -> tuple[Tensor, Tensor, Tensor]:
        """The stream in is ``x + delta`` (``x`` if delta is None); returns (stream in, x', delta'), the
        stream out being ``x' + delta'``."""
        stream, n = self.input_layernorm.add_norm(x, delta)
        x, m = self.post_attention_layernorm.add_norm(stream, self.self_attn(n, cos, sin, attend))
        return stream, x, self.mlp(m)
