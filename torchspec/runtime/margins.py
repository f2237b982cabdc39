"""Near-tie accounting for greedy divergences in bf16: is a difference rounding, or a bug?

Greedy speculative decoding equals plain greedy decoding of the same engine token for token in
fp32 (DESIGN contract 8). In bf16 the verify forward (a tree over the paged cache) and a plain step
(one token) add the same numbers in different orders, so where the target's two best logits nearly
tie either may win. A difference is allowed only there; anywhere else it is a bug.

At the first position ``j`` where a reference output (plain greedy) and another output of the same
prompt differ, `divergence`

1. recomputes the target's logits for the common prefix ``prompt + reference[:j]`` with one plain
   dense forward of the same decoder (`prefix_logits`: the decoder's dtype, the lm_head output
   accumulated and returned in fp32 by `TargetDecoder.logits`), and
2. measures them (`measure`): ``margin = top1 - top2`` in logits and in bf16 ulps of the top-1
   logit (`bf16_ulp`: bf16 keeps 8 significant bits, so ulp(x) = 2^(floor(log2|x|) - 7)), whether
   the two diverging tokens are the top 2, and whether the two top logits round to the same bf16
   number (an exact tie for a head that emits bf16 logits).

A divergence is a **near-tie** when the two diverging tokens' logits lie within ``max_ulps`` (2)
ulps of each other (``gap``) and the better of them within ``max_ulps`` of the top-1 logit
(``lag``). When the two tokens are the top 2 that is exactly ``margin <= max_ulps`` ulps; a margin
above it always fails (gap or lag exceeds it). Anything else is reported as ``suspect``.

Used by ``tools/bench_lossless_bf16.py`` and ``tests/gpu/test_runtime_stress_gpu.py``; checked by
``tests/unit/test_runtime_margins.py``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from torchspec.targets import TargetDecoder, dense_attend

MAX_ULPS = 2.0


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at magnitude |x|: 2^(floor(log2|x|) - 7) (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0**-126))) - 7)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index < min(len(a), len(b)) where the two differ; None when one is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@dataclass
class Margin:
    """The target's logits at one position, seen from two diverging tokens (see the module docstring)."""

    margin: float  # top1 - top2, logits
    margin_ulps: float  # in bf16 ulps of the top-1 logit
    top1: float
    top2_ids: list[int]  # the two best token ids, best first
    tokens: list[int]  # the two diverging tokens: [reference, other]
    top2: bool  # the diverging tokens are the two best (in either order)
    gap_ulps: float  # |logit[tokens[0]] - logit[tokens[1]]| in ulps
    lag_ulps: float  # top1 - max(logit[tokens]) in ulps (0 when one of them is the argmax)
    bf16_tie: bool  # the two top logits round to the same bf16 number
    near_tie: bool  # gap_ulps <= max_ulps and lag_ulps <= max_ulps

    @property
    def suspect(self) -> bool:
        return not self.near_tie

    def as_dict(self) -> dict:
        return {**asdict(self), "suspect": self.suspect}


def measure(logits: torch.Tensor, tokens: tuple[int, int] | list[int], max_ulps: float = MAX_ULPS) -> Margin:
    """logits [V] (fp32) at the divergence; ``tokens`` = (reference token, other token)."""
    logits = logits.detach().float().cpu()
    values, ids = logits.topk(2)
    top1, second = float(values[0]), float(values[1])
    ulp = bf16_ulp(top1)
    a, b = float(logits[tokens[0]]), float(logits[tokens[1]])
    gap, lag = abs(a - b) / ulp, (top1 - max(a, b)) / ulp
    rounded = values.to(torch.bfloat16)
    return Margin(margin=top1 - second, margin_ulps=(top1 - second) / ulp, top1=top1, top2_ids=ids.tolist(),
                  tokens=[int(t) for t in tokens], top2={int(tokens[0]), int(tokens[1])} == set(ids.tolist()),
                  gap_ulps=gap, lag_ulps=lag, bf16_tie=bool(rounded[0] == rounded[1]),
                  near_tie=gap <= max_ulps and lag <= max_ulps)


@torch.no_grad()
def prefix_logits(decoder: TargetDecoder, ids: list[int]) -> torch.Tensor:
    """fp32 [V]: the target's logits after ``ids`` (they predict token ``len(ids)``), from one dense
    causal forward of ``decoder`` in its own dtype and its fp32-output head (`TargetDecoder.logits`)."""
    device = decoder.embed_tokens_weight.device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, T]
    positions, attend = dense_attend(input_ids)
    hidden = decoder(input_ids, positions, attend).hidden  # [1, T, H]
    return decoder.logits(hidden[0, -1]).float()  # [V]


def divergence(decoder: TargetDecoder, prompt: list[int], reference: list[int], output: list[int],
               max_ulps: float = MAX_ULPS) -> dict | None:
    """None when ``output`` and ``reference`` agree on their common length; else the first differing
    position and its `Margin` (``as_dict``), measured on ``prompt + reference[:position]``."""
    j = first_difference(reference, output)
    if j is None:
        return None
    logits = prefix_logits(decoder, list(prompt) + list(reference[:j]))
    return {"position": j, **measure(logits, (reference[j], output[j]), max_ulps).as_dict()}


__all__ = ["MAX_ULPS", "Margin", "bf16_ulp", "divergence", "first_difference", "measure", "prefix_logits"]
