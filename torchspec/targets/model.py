"""THE target decoder: one module for training capture and for serving, with its own tensor parallelism.

    embedding -> L x family layer (q/k/v, norms, RoPE, then the caller's attend) -> final RMSNorm;  lm_head

Hybrid targets (Qwen3-Next, Qwen3.5) mix Gated DeltaNet layers into the stack; those hand their
conv and delta rule to the same ``attend`` object through its ``RecurrentMix`` side
(``torchspec/attend.py``), so capture and serving differ only in the attend there, too.

One forward (`TargetDecoder.forward`) serves both worlds; only the `Attend` differs
(``torchspec/attend.py``):

    training capture   decoder.capture(input_ids, document_ids=...)          DenseAttend (causal SDPA,
                       -> TargetOutput(3 aux states, post-norm last hidden)   block-diagonal when packed)
    serving            decoder(ids, positions, PagedAttend(cache, meta),      paged KV cache
                               capture_layers=aux_ids) -> DecoderOutput

so the drafter sees in serving exactly the numerics it saw in training. A decoder fused for serving
(`fuse_for_serving`) runs the same layers in their ``forward_pending`` form, each residual add inside
the RMSNorm after it (same ops, one kernel per add + norm on CUDA; equal to the plain loop in fp32 on
CPU). The forward has no host sync and no data-dependent Python branch (CUDA-graph friendly).
``logits(hidden)`` applies the lm_head separately, so callers decide which positions need ``[.., V]``.

Families: ``ARCHITECTURES`` maps a config's ``model_type`` to the module that implements its layers:
`torchspec.targets.llama` (llama / mistral / qwen2 / qwen3) and `torchspec.targets.hybrid`
(qwen3_next, and qwen3_5 whose text config is ``qwen3_5_text``). A family module provides
``decoder_args(config, tp_size)`` (validation, incl. `loader.check_tp_size`, and this shard's
sizes), ``DecoderLayer(args, index, group)`` with ``forward(x, cos, sin, attend)`` and its serving
form ``forward_pending(x, delta, cos, sin, attend)``, ``TP_PLAN`` and ``Norm`` (the final norm's
class, with ``add_norm``). The args say which layers are which (``layer_kinds``:
"attention" | "linear") and, for hybrids, the per-shard GDN state sizes (``recurrent``, a
`hybrid.RecurrentShape`; None for llama) that serving allocates; `TargetDecoder.attention_layer_ids`
/ ``linear_layer_ids`` list them.

Tensor parallelism over a ``torch.distributed`` group (training: the mesh's tp group,
``mesh["tp"].get_group()``; serving: the tp group of the launch): the layers hold this rank's
shard and all-reduce after their row-parallel projections, so every rank holds full hidden states
and every captured state is a plain, full tensor. `from_pretrained` follows "build on meta, then
load": config, aux ids and tp size are validated first, the model is built on the meta device at
this rank's shard sizes, and each rank reads only its own slices of the safetensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchspec.attend import Attend
from torchspec.targets import hybrid, llama
from torchspec.targets.capture import (
    TargetOutput,
    default_aux_layer_ids,
    dense_attend,
    validate_aux_layer_ids,
)
from torchspec.targets.head import VocabParallelHead
from torchspec.targets.loader import load_target_config, load_weights, resolve_target_path
from torchspec.targets.rope import RopeTables

DEFAULT_CACHE_DIR = "~/.cache/torchspec"  # same default as TargetConfig.cache_dir (GGUF conversions)

# config.model_type -> the module implementing that family's layers (see the module docstring).
ARCHITECTURES = {**dict.fromkeys(llama.FAMILIES, llama), **dict.fromkeys(hybrid.FAMILIES, hybrid)}


def family_of(config):
    """The family module of an HF (text) config; ValueError listing the supported model types."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"config model_type={model_type!r} is not supported by TargetDecoder; supported: {sorted(ARCHITECTURES)}."
        )
    return ARCHITECTURES[model_type]


def validate_tp_for_target(target_config, tp: int) -> None:
    """Config-time check that the target's family is supported and shards over ``tp`` ranks."""
    config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    family_of(config).decoder_args(config, tp)


@dataclass
class DecoderOutput:
    hidden: Tensor  # [B, T, H] after the final norm (lm_head input)
    aux: list[Tensor]  # one [B, T, H] per capture layer id: residual stream after that layer


class TargetDecoder(nn.Module):
    """The frozen target; see the module docstring.

    ``aux_layer_ids``: the 3 layers `capture` records (contract 1), or ``()`` for a decoder that
    only serves (the runtime passes ``capture_layers`` per forward).
    """

    def __init__(self, config, aux_layer_ids: Sequence[int] = (), *, tp_group: dist.ProcessGroup | None = None):
        super().__init__()
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.family = family_of(config)
        self.args = a = self.family.decoder_args(config, tp_size)
        if len(aux_layer_ids):
            validate_aux_layer_ids(list(aux_layer_ids), a.num_layers)
        self._aux_layer_ids = [int(i) for i in aux_layer_ids]
        self.tp_size, self.tp_rank = tp_size, (dist.get_rank(tp_group) if tp_group is not None else 0)
        group = tp_group if tp_size > 1 else None
        self.tp_group = group
        self.config = config  # the HF text config
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(self.family.DecoderLayer(a, i, group) for i in range(a.num_layers))
        self.norm = self.family.Norm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = None if a.tied_lm_head else nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        with torch.device("cpu"):  # real tables even when the rest is built on meta
            self.rope = RopeTables.from_config(config)
        self._eos_token_ids = _eos_ids(getattr(config, "eos_token_id", None))
        self.fused = False  # serving (`fuse_for_serving`): residual adds inside the norms (`forward`)
        self.requires_grad_(False)
        self.eval()

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        aux_layer_ids: Sequence[int] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp_group: dist.ProcessGroup | None = None,
        cache_dir: str = DEFAULT_CACHE_DIR,
    ) -> TargetDecoder:
        """Load a HF checkpoint dir, a ``.gguf`` file or an alias (``smollm2``): this rank's shards only.

        ``aux_layer_ids``: None = the default ``[1, L//2 - 1, L - 4]``; ``()`` = none (serving).
        Config, ids and tp size are checked before any weight is read.
        """
        path = resolve_target_path(path, os.path.expanduser(cache_dir))
        config = load_target_config(path).get_text_config()
        if aux_layer_ids is None:
            aux_layer_ids = default_aux_layer_ids(config.num_hidden_layers)
        with torch.device("meta"):
            model = cls(config, aux_layer_ids, tp_group=tp_group)  # validates before any weight is read
        device = torch.device(device)
        load_weights(model, path, model.family.TP_PLAN, model.tp_rank, model.tp_size, dtype, device)
        model.rope.to(device)
        gen_config = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_config):
            with open(gen_config) as f:
                model._eos_token_ids = _eos_ids(*model._eos_token_ids, json.load(f).get("eos_token_id"))
        return model

    def fuse_for_serving(self) -> TargetDecoder:
        """Serving only, once after loading: q|k|v and gate|up as one GEMM each (`layers.fuse_linears`),
        each residual add done inside the RMSNorm after it (`forward`) and, on CUDA, the elementwise
        chains (residual add + RMSNorm, q/k norm + RoPE of q and k, SwiGLU) as one kernel each
        (`torchspec.targets.fused_ops`). Outputs agree with the unfused decoder to rounding; training
        capture never calls it (it stays bit-identical to the transformers oracle). Idempotent."""
        for layer in self.layers:
            if not getattr(layer, "is_fused", False) and hasattr(layer, "fuse"):
                layer.fuse()
                layer.is_fused = True
        for module in self.modules():
            if hasattr(module, "fused"):
                module.fused = True
        return self

    def train(self, mode: bool = True) -> TargetDecoder:
        # Frozen means eval forever: a parent's .train() must not switch anything back on.
        return super().train(False)

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, attend: Attend,
                capture_layers: Sequence[int] = ()) -> DecoderOutput:
        """input_ids, positions [B, T] long (RoPE positions: per document in packed rows, ctx_len + depth
        for tree nodes); ``attend`` decides which keys each query sees; ``capture_layers``: aux ids to return."""
        bad = [i for i in capture_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"capture_layers {list(bad)} outside [0, {self.num_layers - 1}]")
        h = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rope(positions, h.dtype)  # [B, T, D]
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        captured: dict[int, Tensor] = {}
        if not self.fused:  # HF's op order (training capture: bit-equal to the transformers oracle)
            for i, layer in enumerate(self.layers):
                h = layer(h, cos, sin, attend)
                if i in capture_layers:
                    captured[i] = h
            return DecoderOutput(hidden=self.norm(h), aux=[captured[i] for i in capture_layers])
        # Serving: every residual add runs inside the norm after it (one kernel each on CUDA), so the
        # stream is carried as h + delta; layer i's forward_pending returns the stream after layer i - 1.
        delta = None
        for i, layer in enumerate(self.layers):
            stream, h, delta = layer.forward_pending(h, delta, cos, sin, attend)
            if i - 1 in capture_layers:
                captured[i - 1] = stream
        stream, hidden = self.norm.add_norm(h, delta)
        captured[self.num_layers - 1] = stream
        return DecoderOutput(hidden=hidden, aux=[captured[i] for i in capture_layers])

    @torch.no_grad()
    def capture(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                document_ids: Tensor | None = None) -> TargetOutput:
        """Training capture: the aux states at ``aux_layer_ids`` and the post-norm last hidden state.

        input_ids [B, T]. Unpacked rows: right padding, which causality hides (``attention_mask``
        is accepted for the batch's sake and not needed). Packed rows: ``document_ids`` [B, T] (-1 on
        padding) make every document attend only to itself, with ``position_ids`` restarting per
        document (derived from ``document_ids`` when None). See `torchspec.targets.capture`.
        """
        if not self._aux_layer_ids:
            raise ValueError("this TargetDecoder was built without aux_layer_ids (a serving decoder); "
                             "load it with aux_layer_ids=None (the defaults) or 3 explicit ids to capture.")
        positions, attend = dense_attend(input_ids, position_ids, document_ids)
        out = self(input_ids, positions, attend, capture_layers=self._aux_layer_ids)
        return TargetOutput(aux_hidden_states=out.aux, last_hidden_state=out.hidden)

    @torch.no_grad()
    def logits(self, hidden: Tensor) -> Tensor:
        """Serving: [..., H] -> fp32 [..., V], model-dtype operands accumulated AND returned in fp32 (no
        bf16 rounding, so no rounding-made ties). Under TP each rank scores its vocabulary slice and
        the slices are all-gathered (`torchspec.targets.head`)."""
        return VocabParallelHead(self.lm_head_weight, self.tp_group).logits(hidden)

    @torch.no_grad()
    def argmax(self, hidden: Tensor) -> Tensor:
        """Serving, greedy: [..., H] -> [...] the argmax of `logits` (lowest id on ties) without
        materialising the full logits under TP: one all-gather of (max, id) per position."""
        return VocabParallelHead(self.lm_head_weight, self.tp_group).argmax(hidden)

    def target_logits(self, last_hidden: Tensor) -> Tensor:
        """Training's teacher: fp32 logits of the lm_head on the post-norm last hidden, [..., H] -> [..., V]."""
        logits = last_hidden.float() @ self.lm_head_weight.float().T
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias.float()
        return logits

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self._aux_layer_ids)

    @aux_layer_ids.setter
    def aux_layer_ids(self, ids: Sequence[int]) -> None:
        validate_aux_layer_ids(list(ids), self.num_layers)
        self._aux_layer_ids = [int(i) for i in ids]

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    @property
    def attention_layer_ids(self) -> list[int]:
        """Layers that call ``attend(layer, q, k, v)`` (and need KV cache): all of them for llama."""
        return [i for i, kind in enumerate(self.args.layer_kinds) if kind == "attention"]

    @property
    def linear_layer_ids(self) -> list[int]:
        """Gated DeltaNet layers (conv + recurrent state of shape ``args.recurrent``); none for llama."""
        return [i for i, kind in enumerate(self.args.layer_kinds) if kind == "linear"]

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

    @property
    def lm_head_bias(self) -> Tensor | None:
        return None if self.lm_head is None else self.lm_head.bias


def _eos_ids(*values) -> tuple[int, ...]:
    """Distinct ids, in order, from values that are each None, an int or a list of ints."""
    ids = [i for v in values if v is not None for i in (v if isinstance(v, list | tuple) else [v])]
    return tuple(dict.fromkeys(int(i) for i in ids))
