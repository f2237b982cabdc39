"""The frozen target and what the drafter needs from it: three aux hidden states and the last one.

Contract 1 (aux layer ids): id ``i`` is the residual stream AFTER decoder layer ``i``, 0-indexed,
captured by a forward hook on ``layers[i]``. In Hugging Face terms that is
``output_hidden_states[i + 1]`` for ``i < L - 1``. For ``i = L - 1`` HF's last entry
``hidden_states[L]`` is the final-norm output instead; our hook still returns layer ``L - 1``'s
pre-norm residual, so the convention stays uniform over all ids (tests pin both facts).

Contract 2 (last hidden): ``last_hidden_state`` is the base model's output, i.e. AFTER the final
norm -- exactly what the target's lm_head consumes. Target logits are computed from it on demand
in fp32 (`TargetModel.target_logits`); the forward itself never materialises ``[B, T, V]``.

Packed rows (several documents per row, ``torchspec/data/packing.py``): given ``document_ids``,
each document is computed as if it were alone. The decoder then gets the per-document
``position_ids`` and no 2D ``attention_mask``, which is transformers' own packed-sequence path
(``masking_utils.find_packed_sequence_indices``): a new sequence starts wherever ``position_ids``
does not grow by 1, and the causal mask becomes block-diagonal, in the format of whichever
attention implementation the model uses (sdpa, eager, flex; flash-attention reads the same
position_ids as varlen boundaries) and for sliding-window layers too. A hand-made 4D mask would
instead be handed unchanged to every layer type and must match the implementation's mask format.
Padding needs no mask: it sits after every real token of its row, so causality already hides it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from torchspec.data.packing import document_positions
from torchspec.target.loader import load_target_config

NUM_AUX_LAYERS = 3


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high layers: ``[1, L//2 - 1, L - 4]``."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if not (0 <= ids[0] < ids[1] < ids[2] <= num_layers - 1):
        raise ValueError(
            f"the default aux layer ids [1, L//2 - 1, L - 4] = {ids} are not strictly increasing inside "
            f"[0, {num_layers - 1}] for a target with L={num_layers} layers; set target.aux_layer_ids "
            f"explicitly to 3 increasing ids in [0, {num_layers - 1}]."
        )
    return ids


def validate_aux_layer_ids(ids: list[int], num_layers: int) -> None:
    """Exactly 3 ints inside ``[0, L-1]``, strictly increasing; ValueError naming what is wrong."""
    ids = list(ids)
    fix = f"set target.aux_layer_ids to 3 strictly increasing ints in [0, {num_layers - 1}] (L={num_layers})"
    if len(ids) != NUM_AUX_LAYERS:
        raise ValueError(f"aux_layer_ids={ids} has {len(ids)} entries, expected {NUM_AUX_LAYERS}: {fix}.")
    not_int = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)]
    if not_int:
        raise ValueError(f"aux_layer_ids={ids} has non-int entries {not_int}: {fix}.")
    out_of_range = [i for i in ids if not 0 <= i <= num_layers - 1]
    if out_of_range:
        raise ValueError(
            f"aux_layer_ids={ids} has ids {out_of_range} outside [0, {num_layers - 1}] for a target with "
            f"L={num_layers} decoder layers (id i = output of decoder layer i, 0-indexed): {fix}."
        )
    if any(a >= b for a, b in zip(ids, ids[1:])):
        raise ValueError(
            f"aux_layer_ids={ids} is not strictly increasing (ids must be distinct, low < mid < high): {fix}."
        )


@dataclass
class TargetOutput:
    aux_hidden_states: list[Tensor]  # 3 x [B, T, H], residual stream after layers aux_layer_ids
    last_hidden_state: Tensor  # [B, T, H], after the final norm (lm_head input)


class TargetModel(torch.nn.Module):
    """A frozen HF causal LM with explicit capture of the aux layers and the post-norm last hidden."""

    def __init__(self, hf_model: PreTrainedModel, aux_layer_ids: list[int]):
        super().__init__()
        self.hf_model = hf_model.requires_grad_(False)
        self.eval()
        assert hasattr(self.decoder, "layers"), f"{type(self.decoder).__name__} has no .layers module list"
        validate_aux_layer_ids(aux_layer_ids, self.num_layers)
        self._aux_layer_ids = [int(i) for i in aux_layer_ids]
        # The hooks stay registered but only record while our own forward runs (`_captured` is a
        # fresh dict then, None otherwise), so direct hf_model calls neither capture nor leak.
        self._captured: dict[int, Tensor] | None = None
        for i in self._aux_layer_ids:
            self.decoder.layers[i].register_forward_hook(self._make_hook(i))

    @classmethod
    def from_pretrained(
        cls, path: str, aux_layer_ids: list[int] | None = None, dtype: torch.dtype = torch.float32
    ) -> TargetModel:
        """Load from a checkpoint directory (see `resolve_target_path`); ids are checked first."""
        num_layers = load_target_config(path).get_text_config().num_hidden_layers
        if aux_layer_ids is None:
            aux_layer_ids = default_aux_layer_ids(num_layers)
        validate_aux_layer_ids(aux_layer_ids, num_layers)
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return cls(hf_model, aux_layer_ids)

    def train(self, mode: bool = True) -> TargetModel:
        # Frozen means eval forever: a parent's .train() must not switch dropout etc. back on.
        return super().train(False)

    def _make_hook(self, layer_id: int):
        def hook(module, args, output):
            if self._captured is not None:
                # Decoder layers return the hidden state, or a tuple led by it (older transformers).
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    @property
    def decoder(self) -> torch.nn.Module:
        """The base model (embeddings, decoder layers, final norm), without the lm_head."""
        return self.hf_model.get_decoder()

    @property
    def config(self):
        return self.hf_model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self._aux_layer_ids)

    @property
    def embed_tokens_weight(self) -> Tensor:
        return self.hf_model.get_input_embeddings().weight  # [V, H]

    @property
    def lm_head_weight(self) -> Tensor:
        # With tie_word_embeddings HF ties lm_head.weight to the embedding: the same tensor.
        return self.hf_model.get_output_embeddings().weight  # [V, H]

    @property
    def lm_head_bias(self) -> Tensor | None:
        return getattr(self.hf_model.get_output_embeddings(), "bias", None)

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                document_ids: Tensor | None = None) -> TargetOutput:
        """input_ids [B, T]; attention_mask [B, T] (1 = real token, right padding) for unpacked rows.

        With ``document_ids`` [B, T] (packed rows; -1 on padding) every document is processed
        independently: ``position_ids`` [B, T] must restart at 0 in each document (derived from
        ``document_ids`` when None) and ``attention_mask`` is not used (see the module docstring).
        """
        if document_ids is not None:
            if position_ids is None:
                position_ids = document_positions(document_ids)
            attention_mask = None  # else transformers skips its packed-sequence detection
        self._captured = {}
        try:
            # The base model only: no lm_head, so no [B, T, V] logits are materialised.
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False)
            aux = [self._captured[i] for i in self._aux_layer_ids]
        finally:
            self._captured = None
        return TargetOutput(aux_hidden_states=aux, last_hidden_state=out.last_hidden_state)

    def target_logits(self, last_hidden: Tensor) -> Tensor:
        """fp32 logits of the target's lm_head on the post-norm last hidden: [..., H] -> [..., V]."""
        logits = last_hidden.float() @ self.lm_head_weight.float().T
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias.float()
        return logits
