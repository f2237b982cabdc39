"""The attention contract shared by the target decoder and the drafters, and the sliding-window rule.

Models compute q, k, v (projections, norms, RoPE) and hand them to an ``Attend`` that the
*caller* chose: dense causal attention for training capture, TTT attention for the drafter's
training unroll, paged attention over the runtime's KV cache for serving. One model forward thus
serves training and serving; only the attention (where keys come from, which are visible) differs.

    out = attend(layer, q, k, v)   # q [B, Hq, T, D], k/v [B, Hkv, T, D] -> [B, Hq, T, D]

The softmax scale is ``D ** -0.5`` for every supported model. GQA (Hq a multiple of Hkv) is the
attend's business, so models never expand KV heads.

Hybrid targets (Gated DeltaNet layers beside attention layers) hand their linear-attention
layers to the same object through ``RecurrentMix``: the layer computes projections, gates and
normalisation; *where the recurrent history comes from* is the caller's business, exactly as
keys are for ``Attend``:

    x   = mix.conv(layer, x, weight)                     # causal depthwise conv + SiLU over the row's history
    out = mix.delta_rule(layer, q, k, v, g, beta)        # gated delta rule from the row's recurrent state

Training capture: history starts at zero at every sequence (and document, when packed) start.
Serving: history is the row's committed conv / recurrent state; a draft tree's node continues
from its parent's (`torchspec/runtime/recurrent_state.py`), and only the accepted path's state is
committed.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class Attend(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class RecurrentMix(Protocol):
    """Gated DeltaNet's two stateful ops (see the module docstring). Shapes (this TP shard):

    conv:       x [B, T, C] (q|k|v channels before the convolution), weight [C, K] depthwise kernel
                -> SiLU(causal conv of x over the row's last K - 1 inputs and this forward's) [B, T, C]
    delta_rule: q, k [B, T, H, Dk] (L2-normalised; q already scaled by Dk ** -0.5), v [B, T, H, Dv],
                g [B, T, H] log decay (<= 0), beta [B, T, H] in (0, 1)  ->  o [B, T, H, Dv], where
                    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,  o_t = S_t^T q_t
                with S [H, Dk, Dv] the row's state (zeros at a sequence / document start).
    """

    def conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor: ...

    def delta_rule(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor: ...


def in_window(query_pos: Tensor | int, key_pos: Tensor | int, window: int | None) -> Tensor | bool:
    """THE sliding-window rule (causal included): key position s is visible to query position t iff
    ``t - window < s <= t`` (``s <= t`` when window is None). Positions count tokens of the sequence,
    never TTT steps or draft depths; broadcasts over tensors, works on ints (flex ``mask_mod``)."""
    visible = key_pos <= query_pos
    if window is not None:
        visible = visible & (key_pos > query_pos - window)
    return visible


def softmax_scale(q: Tensor) -> float:
    return q.shape[-1] ** -0.5


__all__ = ["Attend", "RecurrentMix", "in_window", "softmax_scale"]
