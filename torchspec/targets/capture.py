"""What the drafter needs from the target, and the dense attention that training capture runs with.

Contract 1 (aux layer ids): id ``i`` is the residual stream AFTER decoder layer ``i``, 0-indexed.
The target decoder records it inside its own layer loop (`TargetDecoder.forward`'s
``capture_layers``), so no hook and no index shift is involved. In Hugging Face terms (the test
oracle) that is ``output_hidden_states[i + 1]`` for ``i < L - 1``; for ``i = L - 1`` HF's last entry
is the final-norm output instead, while id ``L - 1`` stays layer ``L - 1``'s pre-norm residual, so
the convention is uniform over all ids (tests pin both facts). Ids are validated before any
weight loads.

Contract 2 (last hidden): ``last_hidden_state`` is AFTER the final norm -- exactly what the
target's lm_head consumes. Target logits are computed from it on demand in fp32
(`TargetDecoder.target_logits`); the capture itself never materialises ``[B, T, V]``.

Dense attention for training (`DenseAttend`, built once per forward by `dense_attend`):

- unpacked rows (no ``document_ids``): causal attention over the row, SDPA's ``is_causal`` fast
  path. Right padding needs no mask: it sits after every real token of its row, so causality
  already hides it from them (padding positions compute garbage nobody reads).
- packed rows (``document_ids`` [B, T], -1 on padding): block-diagonal causal, key s visible to
  query t iff ``s <= t`` and both lie in the same document, and RoPE positions restart at 0 in
  each document (`torchspec.data.packing.document_positions` when no ``position_ids`` are given).
  So every document is computed exactly as if it were alone. Padding forms a "document" of its
  own, so no query row is fully masked (no NaN).

GQA goes to SDPA as is (``enable_gqa=True``): KV heads are never repeated in memory.

Gated DeltaNet layers of hybrid targets (`DenseAttend` is also their `torchspec.attend.RecurrentMix`):
the conv history and the recurrent state start at zero at every row start and, in packed rows, at
every document start (``starts``, where the document id changes), so each document is again
computed alone. Right padding of unpacked rows sits after the real tokens, so it cannot reach them
through the recurrence either. Kernels: `torchspec.targets.gdn_ops` (fla on CUDA, else the torch
reference). Nothing here syncs with the host, except fla's varlen path for packed rows (its
``cu_seqlens``).

Which layer kinds the default aux ids ``[1, L//2 - 1, L - 4]`` pick on hybrid targets (full
attention every 4th layer, ids 3, 7, 11, ...): Qwen3.5-27B (L = 64) -> [1, 31, 60] = GDN,
attention, GDN; Qwen3-Next-80B (L = 48) -> [1, 23, 44] = GDN, attention, GDN. Either kind's output
is the residual stream after the layer, so the contract does not care; the defaults stay EAGLE-3's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from torchspec.attend import in_window, softmax_scale
from torchspec.data.packing import document_positions
from torchspec.targets.gdn_ops import causal_conv, delta_rule, uses_fla, varlen_plan

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


class DenseAttend:
    """The `torchspec.attend.Attend` (and `RecurrentMix`) of training capture: this forward's own tokens.

    ``mask`` [B, 1, T, T] bool (True = attend) for packed rows, None for plain causal rows;
    ``starts`` [B, T] bool, True at each document's first token (packed rows), None otherwise.
    """

    def __init__(self, mask: Tensor | None = None, starts: Tensor | None = None):
        self.mask, self.starts = mask, starts
        self._plan = None  # fla's varlen description of packed rows: built by the first GDN layer, then reused

    def conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor:
        return causal_conv(x, weight, starts=self.starts)  # zero history at row and document starts

    def delta_rule(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        if self.starts is not None and self._plan is None and uses_fla(q.device):
            self._plan = varlen_plan(self.starts)
        return delta_rule(q, k, v, g, beta, starts=self.starts, plan=self._plan)[0]  # zero state at row and document starts

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if q.device.type == "cpu":  # CPU SDPA on strided operands takes a much slower path
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if self.mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale(q), enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=softmax_scale(q), enable_gqa=True)


def document_mask(document_ids: Tensor) -> Tensor:
    """[B, T] document ids -> [B, 1, T, T] block-diagonal causal mask (True = attend)."""
    i = torch.arange(document_ids.shape[1], device=document_ids.device)
    causal = in_window(i[:, None], i[None, :], None)  # [T, T]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
    return (same & causal)[:, None]


def dense_attend(input_ids: Tensor, position_ids: Tensor | None = None,
                 document_ids: Tensor | None = None) -> tuple[Tensor, DenseAttend]:
    """(RoPE positions [B, T], the attend) for a training batch; see the module docstring."""
    b, t = input_ids.shape
    if document_ids is None:
        positions = position_ids if position_ids is not None else torch.arange(t, device=input_ids.device).expand(b, t)
        return positions, DenseAttend()
    positions = position_ids if position_ids is not None else document_positions(document_ids)
    return positions, DenseAttend(document_mask(document_ids), document_starts(document_ids))


def document_starts(document_ids: Tensor) -> Tensor:
    """[B, T] document ids -> [B, T] bool, True where a document (or the padding after them) begins."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts
