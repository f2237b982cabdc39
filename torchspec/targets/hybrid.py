"""The hybrid Gated-DeltaNet family: Qwen3-Next (``qwen3_next``) and Qwen3.5 (``qwen3_5``, text decoder).

Most layers are Gated DeltaNet (GDN, linear attention with a recurrent state), the rest gated full
attention; ``config.layer_types`` says which (Qwen3-Next-80B / Qwen3.5-27B: 3 of every 4 are GDN,
``full_attention_interval`` = 4). Per layer, as transformers computes it (same op order)::

    x = x + mixer(input_layernorm(x))          mixer: GatedDeltaNet | Attention, by the layer's kind
    x = x + mlp(post_attention_layernorm(x))   mlp: SparseMoeBlock (qwen3_next) | MLP (qwen3_5, and
                                               qwen3_next's ``mlp_only_layers``)

    GatedDeltaNet   q|k|v = in_proj(n) -> mix.conv (causal depthwise conv + SiLU) -> q, k L2-normalised,
                    q scaled by Dk^-0.5, both repeated to the value heads; beta = sigmoid(b),
                    g = -exp(A_log) softplus(a + dt_bias); o = mix.delta_rule(q, k, v, g, beta);
                    out_proj(RMSNormGated(o, z))                         z: the output gate projection
    Attention       q|gate = q_proj(n) per head; q_norm / k_norm (1 + w) per head; partial RoPE (the
                    leading 1/4 of each head); attend; o_proj(out * sigmoid(gate))
    SparseMoeBlock  softmax router -> top-k experts (renormalised when ``norm_topk_prob``) +
                    sigmoid(shared_expert_gate) * shared_expert

The GDN layer hands its two stateful ops to the caller's ``RecurrentMix`` (``torchspec/attend.py``)
exactly as attention hands q/k/v to the ``Attend``: capture resets the history at every sequence /
document start (`torchspec.targets.capture.DenseAttend`), serving continues each row's state. All
RMSNorms except RMSNormGated store ``weight`` centred on 0 (`layers.OffsetRMSNorm`).

Checkpoint layouts (module names mirror the keys, so loading needs no adapter): qwen3_next packs
``in_proj_qkvz`` (per key head: q, k, then the v and z of its value heads) and ``in_proj_ba`` (per
key head: b then a of its value heads); qwen3_5 has ``in_proj_qkv`` (q | k | v, each head-major),
``in_proj_z``, ``in_proj_b``, ``in_proj_a``. Qwen3.5 ships as a multimodal checkpoint whose text
config (``model_type`` ``qwen3_5_text``) this family reads, keys under ``model.language_model.``
(`torchspec.targets.loader.decoder_prefix`); its M-RoPE with text-only positions (t = h = w) is
plain RoPE over the rotary dims.

Tensor parallelism (``TP_PLAN``): attention as in Llama (q_proj with its gate rows, k/v colwise by
whole heads, o_proj rowwise). GDN: each rank owns whole key heads and their value heads --
qwen3_next's grouped in-projections split colwise as stored; qwen3_5's ``in_proj_qkv`` and every
GDN's ``conv1d`` hold q | k | v segments, each split separately (``colwise_segments``, sizes in the
module's ``tp_segments``); z/b/a projections colwise; ``A_log`` / ``dt_bias`` follow the value heads
(``heads``); out_proj rowwise. The conv and recurrent state are thus sharded with the heads
(``RecurrentShape`` gives this shard's sizes). Dense MLP as in Llama. MoE: router and
shared_expert_gate replicated (every rank routes identically); each expert's and the shared
expert's gate/up colwise, down rowwise, and the block's routed + gated shared partial sums are
all-reduced ONCE (both are linear in the down projections' partial outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from torchspec.attend import Attend, RecurrentMix
from torchspec.targets.layers import MLP, OffsetRMSNorm, qk_norm_rope, qk_norm_rope_fused, row_parallel
from torchspec.targets.loader import check_tp_size
from torchspec.targets.rope import rotary_dim

Norm = OffsetRMSNorm  # the final norm's class (`TargetDecoder.norm`)
LAYER_KINDS = {"linear_attention": "linear", "full_attention": "attention"}  # HF layer_types -> ours


@dataclass(frozen=True)
class Family:
    """What differs between the supported model types (HF ``model_type`` of the text config)."""

    grouped_projections: bool  # in_proj_qkvz / in_proj_ba grouped per key head, else in_proj_qkv | z | b | a
    moe: bool  # sparse MoE MLPs where ``mlp_only_layers`` / ``decoder_sparse_step`` say so


FAMILIES: dict[str, Family] = {
    "qwen3_next": Family(grouped_projections=True, moe=True),
    "qwen3_5_text": Family(grouped_projections=False, moe=False),  # Qwen3.5's text config (checkpoint: qwen3_5)
}

# Module inside a decoder layer -> TP style (`torchspec.targets.layers.TP_STYLES`); ``*`` = any index.
TP_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "linear_attn.in_proj_qkvz": "colwise",
    "linear_attn.in_proj_ba": "colwise",
    "linear_attn.in_proj_qkv": "colwise_segments",
    "linear_attn.in_proj_z": "colwise",
    "linear_attn.in_proj_b": "colwise",
    "linear_attn.in_proj_a": "colwise",
    "linear_attn.conv1d": "colwise_segments",
    "linear_attn": "heads",
    "linear_attn.out_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
    "mlp.experts.*.gate_proj": "colwise",
    "mlp.experts.*.up_proj": "colwise",
    "mlp.experts.*.down_proj": "rowwise",
    "mlp.shared_expert.gate_proj": "colwise",
    "mlp.shared_expert.up_proj": "colwise",
    "mlp.shared_expert.down_proj": "rowwise",
}


@dataclass(frozen=True)
class RecurrentShape:
    """One GDN layer's serving state on this TP shard: conv ``[C, K - 1]`` and recurrent ``[H, Dk, Dv]``."""

    conv_channels: int  # C = 2 * key heads * Dk + value heads * Dv (q | k | v before the conv)
    conv_kernel: int  # K
    num_heads: int  # H: value heads (q / k repeated to them)
    key_dim: int  # Dk
    value_dim: int  # Dv


@dataclass(frozen=True)
class HybridArgs:
    """Sizes and switches of one TP shard, validated from an HF config (`decoder_args`). Head counts local."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_kinds: tuple[str, ...]  # "linear" (GDN) | "attention", per layer
    mlp_kinds: tuple[str, ...]  # "moe" | "dense", per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    attention_bias: bool
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int
    grouped_projections: bool
    intermediate_size: int  # dense MLP, local
    num_experts: int
    experts_per_token: int
    norm_topk_prob: bool
    moe_intermediate_size: int  # local
    shared_expert_intermediate_size: int  # local
    rms_norm_eps: float
    tied_lm_head: bool
    recurrent: RecurrentShape


def _refuse(key: str, value, supported: str):
    raise ValueError(f"config {key}={value!r} is not supported by TargetDecoder; supported: {supported}.")


def layer_types(config) -> list[str]:
    """HF ``layer_types`` (or the pattern ``full_attention_interval`` implies), validated."""
    types = getattr(config, "layer_types", None)
    if types is None:
        interval = getattr(config, "full_attention_interval", None)
        if not interval:
            _refuse("layer_types", None, "a list of 'linear_attention' / 'full_attention', or full_attention_interval")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(config.num_hidden_layers)]
    types = list(types)
    if len(types) != config.num_hidden_layers or not set(types) <= set(LAYER_KINDS):
        _refuse("layer_types", types, f"{config.num_hidden_layers} entries of {sorted(LAYER_KINDS)}")
    return types


def mlp_kinds(config) -> list[str]:
    """Per layer "moe" or "dense", by HF's rule (qwen3_next: MoE unless in mlp_only_layers / off the sparse step)."""
    if not FAMILIES[config.model_type].moe or not getattr(config, "num_experts", 0):
        return ["dense"] * config.num_hidden_layers
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = config.decoder_sparse_step
    return ["dense" if i in dense or (i + 1) % step else "moe" for i in range(config.num_hidden_layers)]


def tp_sharded_sizes(config) -> dict[str, int]:
    """The sizes TP splits over the ranks (each must divide by the tp size)."""
    kinds = set(mlp_kinds(config))
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
    }
    if "dense" in kinds:
        sizes["intermediate_size"] = config.intermediate_size
    if "moe" in kinds:
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
        sizes["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    return sizes


def decoder_args(config, tp_size: int = 1) -> HybridArgs:
    """Validate `config` (layer pattern, activation, GDN head grouping, tp divisibility) and size one shard."""
    fam = FAMILIES[config.model_type]
    if getattr(config, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", config.hidden_act, "'silu' (SwiGLU, SiLU conv)")
    types = layer_types(config)
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    if hv % hk:
        _refuse("linear_num_value_heads", hv, f"a multiple of linear_num_key_heads={hk}")
    kinds = mlp_kinds(config)
    sizes = tp_sharded_sizes(config)
    check_tp_size(sizes, tp_size)
    moe = "moe" in kinds
    hk, hv, dk, dv = hk // tp_size, hv // tp_size, config.linear_key_head_dim, config.linear_value_head_dim
    kernel = config.linear_conv_kernel_dim
    return HybridArgs(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        layer_kinds=tuple(LAYER_KINDS[t] for t in types),
        mlp_kinds=tuple(kinds),
        num_heads=config.num_attention_heads // tp_size,
        num_kv_heads=config.num_key_value_heads // tp_size,
        head_dim=config.head_dim,
        rotary_dim=rotary_dim(config),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        linear_key_heads=hk,
        linear_value_heads=hv,
        linear_key_dim=dk,
        linear_value_dim=dv,
        conv_kernel=kernel,
        grouped_projections=fam.grouped_projections,
        intermediate_size=config.intermediate_size // tp_size,
        num_experts=config.num_experts if moe else 0,
        experts_per_token=config.num_experts_per_tok if moe else 0,
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
        moe_intermediate_size=config.moe_intermediate_size // tp_size if moe else 0,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // tp_size if moe else 0,
        rms_norm_eps=config.rms_norm_eps,
        tied_lm_head=bool(getattr(config, "tie_word_embeddings", False)),
        recurrent=RecurrentShape(2 * hk * dk + hv * dv, kernel, hv, dk, dv),
    )


class GatedRMSNorm(nn.Module):
    """HF's RMSNormGated over a head's Dv: ``weight * norm(x) * silu(gate)`` (weight centred on 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """fla's / HF's L2 normalisation of the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, a: HybridArgs, layer_index: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.a, self.layer_index, self.group = a, layer_index, group
        hidden, hv, r = a.hidden_size, a.linear_value_heads, a.recurrent
        key, value = a.linear_key_heads * a.linear_key_dim, hv * a.linear_value_dim
        self.segments = (key, key, value)  # q | k | v channels of the conv (this shard)
        if a.grouped_projections:
            self.in_proj_qkvz = nn.Linear(hidden, 2 * key + 2 * value, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, 2 * key + value, bias=False)
            self.in_proj_qkv.tp_segments = self.segments
            self.in_proj_z = nn.Linear(hidden, value, bias=False)
            self.in_proj_b = nn.Linear(hidden, hv, bias=False)
            self.in_proj_a = nn.Linear(hidden, hv, bias=False)
        self.conv1d = nn.Conv1d(r.conv_channels, r.conv_channels, r.conv_kernel, groups=r.conv_channels, bias=False)
        self.conv1d.tp_segments = self.segments
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(a.linear_value_dim, a.rms_norm_eps)
        self.out_proj = nn.Linear(value, hidden, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [B, T, H] -> (q|k|v [B, T, C] before the conv, z [B, T, Hv, Dv], b, a [B, T, Hv])."""
        a, (b, t, _) = self.a, x.shape
        hk, hv, dk, dv = a.linear_key_heads, a.linear_value_heads, a.linear_key_dim, a.linear_value_dim
        if not a.grouped_projections:
            z = self.in_proj_z(x).view(b, t, hv, dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        per = hv // hk  # value heads per key head, stored after their key head's q and k
        q, k, v, z = self.in_proj_qkvz(x).view(b, t, hk, -1).split([dk, dk, per * dv, per * dv], dim=-1)
        beta, decay = self.in_proj_ba(x).view(b, t, hk, 2 * per).split([per, per], dim=-1)
        qkv = torch.cat((q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)), dim=-1)
        return qkv, z.reshape(b, t, hv, dv), beta.reshape(b, t, hv), decay.reshape(b, t, hv)

    def forward(self, x: Tensor, mix: RecurrentMix) -> Tensor:
        a, (b, t, _) = self.a, x.shape
        hk, hv, dk, dv = a.linear_key_heads, a.linear_value_heads, a.linear_key_dim, a.linear_value_dim
        qkv, z, beta, decay = self.project(x)
        qkv = mix.conv(self.layer_index, qkv, self.conv1d.weight[:, 0])  # [B, T, C]
        q, k, v = qkv.split(self.segments, dim=-1)
        q = (l2norm(q.view(b, t, hk, dk)) * dk**-0.5).to(x.dtype).repeat_interleave(hv // hk, dim=2)
        k = l2norm(k.view(b, t, hk, dk)).to(x.dtype).repeat_interleave(hv // hk, dim=2)  # [B, T, Hv, Dk]
        g = -self.A_log.float().exp() * F.softplus(decay.float() + self.dt_bias)  # log decay [B, T, Hv]
        o = mix.delta_rule(self.layer_index, q, k, v.view(b, t, hv, dv), g, beta.sigmoid())  # [B, T, Hv, Dv]
        return row_parallel(self.out_proj, self.norm(o, z).reshape(b, t, -1), self.group)


class Attention(nn.Module):
    def __init__(self, a: HybridArgs, layer_index: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.a, self.layer_index, self.group = a, layer_index, group
        bias = a.attention_bias
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim * 2, bias=bias)  # per head: query | gate
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(a.head_dim, a.rms_norm_eps)
        self.fused = False  # serving on CUDA: q/k norm + RoPE of q and k as one kernel

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        a, (b, t, _) = self.a, x.shape
        q, gate = self.q_proj(x).view(b, t, a.num_heads, 2 * a.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(b, t, a.num_kv_heads, a.head_dim)
        v = self.v_proj(x).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)  # [B, kv_heads, T, D]
        # (1 + w) norms per head, then RoPE on the leading rotary_dim dims; q, k -> [B, heads, T, D]
        q, k = (qk_norm_rope_fused if self.fused else qk_norm_rope)(
            q, k, cos, sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, offset=True)
        out = attend(self.layer_index, q, k, v).transpose(1, 2).reshape(b, t, -1)  # [B, T, heads * D]
        return row_parallel(self.o_proj, out * torch.sigmoid(gate.reshape(b, t, -1)), self.group)


class SparseMoeBlock(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert (Qwen3-Next).

    Tokens are sorted by expert and each expert runs once on its batch; the batch sizes cost one
    host sync per block (an eager dispatch, like transformers'; a grouped GEMM would remove it).
    """

    def __init__(self, a: HybridArgs, group: dist.ProcessGroup | None):
        super().__init__()
        self.a, self.group = a, group
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)  # the router, replicated
        self.experts = nn.ModuleList(MLP(a.hidden_size, a.moe_intermediate_size, None) for _ in range(a.num_experts))
        self.shared_expert = MLP(a.hidden_size, a.shared_expert_intermediate_size, None)
        self.shared_expert_gate = nn.Linear(a.hidden_size, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        a, shape = self.a, x.shape
        x = x.reshape(-1, shape[-1])  # [N, H]
        logits = self.gate(x)  # [N, E]
        weights, chosen = logits.softmax(-1, dtype=torch.float).topk(a.experts_per_token, dim=-1)  # [N, k]
        if a.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(logits.dtype)
        order = chosen.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert
        token = order // a.experts_per_token
        counts = torch.bincount(chosen.flatten(), minlength=a.num_experts).tolist()  # the host sync
        routed = torch.cat([expert(part) for expert, part in zip(self.experts, x[token].split(counts))])
        out = torch.zeros_like(x).index_add_(0, token, routed * weights.flatten()[order, None])
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.group is not None:  # routed + shared partial sums of this rank's expert slices
            dist.all_reduce(out, group=self.group)
        return out.view(shape)


class DecoderLayer(nn.Module):
    """``forward(x [B, T, H], cos, sin [B, 1, T, rotary_dim], attend) -> [B, T, H]``; a GDN layer uses
    ``attend`` as its `RecurrentMix`, an attention layer as its `Attend`. ``forward_pending``: serving's
    form with each residual add inside the norm after it (see `torchspec.targets.llama.DecoderLayer`)."""

    def __init__(self, a: HybridArgs, layer_index: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.linear = a.layer_kinds[layer_index] == "linear"
        self.input_layernorm = OffsetRMSNorm(a.hidden_size, a.rms_norm_eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(a, layer_index, group)
        else:
            self.self_attn = Attention(a, layer_index, group)
        self.post_attention_layernorm = OffsetRMSNorm(a.hidden_size, a.rms_norm_eps)
        moe = a.mlp_kinds[layer_index] == "moe"
        self.mlp = SparseMoeBlock(a, group) if moe else MLP(a.hidden_size, a.intermediate_size, group)

    def fuse(self) -> None:
        """Serving: the dense MLP's gate|up as one GEMM (experts and GDN projections stay as loaded)."""
        if isinstance(self.mlp, MLP):
            self.mlp.fuse()

    def mix(self, n: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        return self.linear_attn(n, attend) if self.linear else self.self_attn(n, cos, sin, attend)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        x = x + self.mix(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_pending(self, x: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor,
                        attend: Attend) -> tuple[Tensor, Tensor, Tensor]:
        """The stream in is ``x + delta`` (``x`` if delta is None); returns (stream in, x', delta'), the
        stream out being ``x' + delta'``."""
        stream, n = self.input_layernorm.add_norm(x, delta)
        x, m = self.post_attention_layernorm.add_norm(stream, self.mix(n, cos, sin, attend))
        return stream, x, self.mlp(m)
