"""The runtime's target decoder: Llama / Qwen3-family forward over the paged KV cache, with TP.

One small model file in the spirit of gpt-fast: embedding -> L x (RMSNorm, GQA attention with
RoPE over `paged_kv`, RMSNorm, SwiGLU MLP) -> final RMSNorm; ``logits(hidden)`` applies the lm_head
separately so callers decide which positions need ``[.., V]``. The forward has no host sync and no
data-dependent Python branch, so it can be captured in a CUDA graph; one mask rule (built by the
caller with `build_attention_meta`) serves prefill, decode and tree verification.

Families (``FAMILIES``): llama, mistral (without sliding window), qwen2 (q/k/v bias), qwen3
(per-head q/k RMSNorm before RoPE). Module names mirror the HF checkpoint keys (``layers.3.mlp.
up_proj.weight`` is ``model.layers.3.mlp.up_proj.weight``), so loading needs no name adapter.

Tensor parallelism over a ``torch.distributed`` group (Megatron style, plan in ``TP_SHARD_DIM``):
q/k/v and gate/up are column-sharded (each rank holds heads/tp query heads, kv_heads/tp KV heads
and intermediate/tp of the MLP), o/down are row-sharded and all-reduced over the group before
their bias and the residual add. Embedding, norms and lm_head are replicated, so every rank holds
the full hidden states and computes full logits (simple; V-sized tensors never cross ranks). The
model is built on the meta device and each rank reads only its own slices of the safetensors
(``safe_open(...).get_slice``), so no rank ever materialises the whole checkpoint.

Captured states follow `torchspec.target.capture`: aux id ``i`` is the residual stream AFTER
decoder layer ``i`` (0-indexed); ``hidden`` is AFTER the final norm (what the lm_head consumes).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn
from transformers import AutoConfig

from torchspec.runtime.paged_kv import AttentionMeta, PagedKVCache, paged_attention
from torchspec.runtime.rope import RopeTables, apply_rope
from torchspec.target.loader import resolve_target_path

DEFAULT_CACHE_DIR = "~/.cache/torchspec"  # same default as TargetConfig.cache_dir (GGUF conversions)


@dataclass(frozen=True)
class Family:
    """What differs between supported families: a bool, or the config attribute holding it."""

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

# TP plan: parameter (last two name atoms) -> the dim each rank holds 1/tp of. Others: replicated.
TP_SHARD_DIM: dict[str, int] = {
    "q_proj.weight": 0, "q_proj.bias": 0,
    "k_proj.weight": 0, "k_proj.bias": 0,
    "v_proj.weight": 0, "v_proj.bias": 0,
    "gate_proj.weight": 0, "gate_proj.bias": 0,
    "up_proj.weight": 0, "up_proj.bias": 0,
    "o_proj.weight": 1,  # row-parallel: its bias is replicated and added after the all-reduce
    "down_proj.weight": 1,
}  # fmt: skip


@dataclass(frozen=True)
class DecoderArgs:
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


def _flag(config, value: bool | str) -> bool:
    return bool(getattr(config, value, False)) if isinstance(value, str) else value


def _refuse(key: str, value, supported: str):
    raise ValueError(f"config {key}={value!r} is not supported by TargetDecoder; supported: {supported}.")


def decoder_args(config, tp_size: int = 1) -> DecoderArgs:
    """Validate `config` (model type, attention variant, tp divisibility) and size one shard."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        _refuse("model_type", model_type, str(sorted(FAMILIES)))
    fam = FAMILIES[model_type]
    if getattr(config, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", config.hidden_act, "'silu' (SwiGLU)")
    layer_types = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
    if layer_types != ["full_attention"]:
        _refuse("layer_types", layer_types, "all 'full_attention' (no sliding window)")
    if model_type == "mistral" and config.sliding_window is not None:
        _refuse("sliding_window", config.sliding_window, "null (no sliding-window attention)")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    inter = config.intermediate_size
    sizes = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": inter}
    bad = {k: v for k, v in sizes.items() if v % tp_size}
    if bad:
        ok = [d for d in range(1, kv_heads + 1) if all(v % d == 0 for v in sizes.values())]
        raise ValueError(
            f"tensor parallel size {tp_size} does not shard this target: "
            + ", ".join(f"{k}={v}" for k, v in bad.items())
            + f" not divisible by {tp_size} (each rank holds whole query/KV heads and an equal MLP slice). "
            f"Supported tp sizes: {ok}."
        )
    return DecoderArgs(
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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # HF's exact op order: fp32 statistics, cast back, then scale (so fp32 results match bitwise).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def row_parallel(linear: nn.Linear, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``linear(x)`` for a weight sharded along its input dim: partial sums, all-reduce, then bias."""
    y = F.linear(x, linear.weight)
    if group is not None:
        dist.all_reduce(y, group=group)
    return y if linear.bias is None else y + linear.bias


class Attention(nn.Module):
    def __init__(self, a: DecoderArgs, group: dist.ProcessGroup | None):
        super().__init__()
        self.a, self.group = a, group
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor, meta: AttentionMeta
    ) -> Tensor:
        b, t, _ = x.shape
        a = self.a
        q = self.q_proj(x).view(b, t, a.num_heads, a.head_dim)
        k = self.k_proj(x).view(b, t, a.num_kv_heads, a.head_dim)
        v = self.v_proj(x).view(b, t, a.num_kv_heads, a.head_dim)
        if a.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, k_pool, v_pool, meta, a.head_dim**-0.5)  # [B, heads, T, D]
        return row_parallel(self.o_proj, out.transpose(1, 2).reshape(b, t, -1), self.group)


class MLP(nn.Module):
    def __init__(self, a: DecoderArgs, group: dist.ProcessGroup | None):
        super().__init__()
        self.group = group
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return row_parallel(self.down_proj, F.silu(self.gate_proj(x)) * self.up_proj(x), self.group)


class DecoderLayer(nn.Module):
    def __init__(self, a: DecoderArgs, group: dist.ProcessGroup | None):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a, group)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a, group)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor, meta: AttentionMeta
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_pool, v_pool, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DecoderOutput:
    hidden: Tensor  # [B, T, H] after the final norm (lm_head input)
    aux: list[Tensor]  # one [B, T, H] per capture layer id: residual stream after that layer


class TargetDecoder(nn.Module):
    """Frozen Llama/Qwen3-family decoder over a paged KV cache; see the module docstring."""

    def __init__(self, config, *, tp_group: dist.ProcessGroup | None = None):
        super().__init__()
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.args = a = decoder_args(config, tp_size)
        self.tp_size, self.tp_rank = tp_size, (dist.get_rank(tp_group) if tp_group is not None else 0)
        group = tp_group if tp_size > 1 else None
        self.config = config  # the HF config object
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, group) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = None if a.tied_lm_head else nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        with torch.device("cpu"):  # real tables even when the rest is built on meta
            self.rope = RopeTables.from_config(config)
        self._eos_token_ids = _eos_ids(getattr(config, "eos_token_id", None))
        self.requires_grad_(False)
        self.eval()

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp_group: dist.ProcessGroup | None = None,
        cache_dir: str = DEFAULT_CACHE_DIR,
    ) -> TargetDecoder:
        """Load a HF checkpoint dir, a ``.gguf`` file or an alias (``smollm2``): this rank's shards only."""
        path = resolve_target_path(path, os.path.expanduser(cache_dir))
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = cls(config, tp_group=tp_group)  # validates the config before any weight is read
        _load_weights(model, path, dtype, torch.device(device))
        model.rope.to(device)
        gen_config = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_config):
            with open(gen_config) as f:
                model._eos_token_ids = _eos_ids(*model._eos_token_ids, json.load(f).get("eos_token_id"))
        return model

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: PagedKVCache,
        meta: AttentionMeta,
        capture_layers: tuple[int, ...] = (),
    ) -> DecoderOutput:
        """input_ids, positions [B, T] long (RoPE positions: ctx_len + depth for tree nodes)."""
        bad = [i for i in capture_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"capture_layers {list(bad)} outside [0, {self.num_layers - 1}]")
        assert cache.num_kv_heads == self.args.num_kv_heads, (cache.num_kv_heads, self.args.num_kv_heads)
        h = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rope(positions, h.dtype)  # [B, T, D]
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        captured: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache.k[i], cache.v[i], meta)
            if i in capture_layers:
                captured[i] = h
        return DecoderOutput(hidden=self.norm(h), aux=[captured[i] for i in capture_layers])

    @torch.no_grad()
    def logits(self, hidden: Tensor) -> Tensor:
        """[..., H] -> fp32 [..., V]: the lm_head in the model dtype, then upcast."""
        return F.linear(hidden, self.lm_head_weight).float()

    def make_kv_cache(
        self,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> PagedKVCache:
        """An empty paged cache for this rank's KV heads (default: model dtype and device)."""
        a, w = self.args, self.embed_tokens.weight
        dtype, device = dtype or w.dtype, device or w.device
        return PagedKVCache(a.num_layers, num_pages, page_size, a.num_kv_heads, a.head_dim, dtype, device)

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def head_dim(self) -> int:
        return self.args.head_dim

    @property
    def num_kv_heads_local(self) -> int:
        return self.args.num_kv_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """config.json's eos_token_id (int or list) plus generation_config.json's, in that order."""
        return self._eos_token_ids

    @property
    def embed_tokens_weight(self) -> Tensor:
        return self.embed_tokens.weight  # [V, H]

    @property
    def lm_head_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V, H]


def _eos_ids(*values) -> tuple[int, ...]:
    """Distinct ids, in order, from values that are each None, an int or a list of ints."""
    ids = [i for v in values if v is not None for i in (v if isinstance(v, list | tuple) else [v])]
    return tuple(dict.fromkeys(int(i) for i in ids))


def _checkpoint_key(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def _key_to_file(path: str) -> dict[str, str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"checkpoint {path!r} has no *.safetensors; re-save it with save_pretrained().")
    out = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def _load_weights(model: TargetDecoder, path: str, dtype: torch.dtype, device: torch.device) -> None:
    """Replace the (meta) parameters with this rank's slices of the checkpoint tensors."""
    key_to_file = _key_to_file(path)
    names = [n for n, _ in model.named_parameters()]
    missing = [_checkpoint_key(n) for n in names if _checkpoint_key(n) not in key_to_file]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {len(missing)} weights: {missing[:4]}")
    tp, rank = model.tp_size, model.tp_rank
    with contextlib.ExitStack() as stack:
        paths = sorted(set(key_to_file.values()))
        files = {f: stack.enter_context(safe_open(f, framework="pt")) for f in paths}
        for name in names:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            local_shape = getattr(module, attr).shape
            key = _checkpoint_key(name)
            stored = files[key_to_file[key]].get_slice(key)
            dim = TP_SHARD_DIM.get(".".join(name.split(".")[-2:]))
            full_shape = list(local_shape)
            index = [slice(None)] * len(local_shape)
            if dim is not None:
                full_shape[dim] *= tp
                n = local_shape[dim]
                index[dim] = slice(rank * n, (rank + 1) * n)
            if list(stored.get_shape()) != full_shape:
                raise ValueError(f"{path!r}: {key} has shape {stored.get_shape()}, expected {full_shape}")
            value = stored[tuple(index)].to(device=device, dtype=dtype)
            setattr(module, attr, nn.Parameter(value, requires_grad=False))
