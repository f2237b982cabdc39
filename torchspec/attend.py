"""The attention contract shared by the target decoder and the drafters, and the sliding-window rule.

Models compute q, k, v (projections, norms, RoPE) and hand them to an ``Attend`` that the
*caller* chose: dense causal attention for training capture, TTT attention for the drafter's
training unroll, paged attention over the runtime's KV cache for serving. One model forward thus
serves training and serving; only the attention (where keys come from, which are visible) differs.

    out = attend(layer, q, k, v)   # q [B, Hq, T, D], k/v [B, Hkv, T, D] -> [B, Hq, T, D]

The softmax scale is ``D ** -0.5`` for every supported model. GQA (Hq a multiple of Hkv) is the
attend's business, so models never expand KV heads.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class Attend(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


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


__all__ = ["Attend", "in_window", "softmax_scale"]
