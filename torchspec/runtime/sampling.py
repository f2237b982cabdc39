"""Token sampling shared by the drafter and the verifier: one logits processor, exact samplers.

``process_logits`` turns raw logits into the distribution a side samples from (temperature, then
top-k, then top-p). Speculative sampling is exact only if the target's verification distribution
and the draft's proposal distribution are the ones actually used, so the SAME function processes
both sides' logits; ``-inf`` logits (a head that scores only a candidate subset) get probability 0.
The settings are one ``SamplingParams`` for every row, or a ``RowSampling`` (per-row tensors [B], the
rows of one round may belong to requests with different settings); greedy rows give the point mass
on the argmax either way, so one verifier serves a batch mixing greedy and sampled rows.

Samplers use the Gumbel / exponential race: with E_v ~ Exp(1) i.i.d., the order of
``log p_v - log E_v`` is exactly the order of sequential sampling without replacement, so
``argmax`` is one draw and ``topk(n)`` is n draws without replacement in draw order. Every draw
takes an explicit ``torch.Generator``, lives on the inputs' device and needs no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # 0 = off

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"sampling temperature={self.temperature} must be >= 0 (0 = greedy).")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p={self.top_p} must lie in (0, 1] (1 = off).")
        if self.top_k < 0:
            raise ValueError(f"sampling top_k={self.top_k} must be >= 0 (0 = off).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RowSampling:
    """Per-row settings of one batch (static shape [B]; the values never change a graph's shape).

    ``greedy`` is host-side and static: True when every row is greedy (the engine then runs its
    greedy round: argmax verification, dynamic tree), False for a batch with any sampled row.
    ``filtered`` is host-side and static too: whether any sampled row uses top-k or top-p. Without
    one, ``process_logits`` skips the vocabulary-wide sort of the filter (the same probabilities:
    a filter that keeps every token changes nothing); the engine keys its graphs by it."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy row
    top_p: torch.Tensor  # [B] fp32, 1 = off
    top_k: torch.Tensor  # [B] long, 0 = off
    greedy: bool = False
    filtered: bool = True

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device | str) -> RowSampling:
        t = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        k = torch.tensor([p.top_k for p in params], dtype=torch.long)
        filtered = any(not x.greedy and (x.top_k > 0 or x.top_p < 1.0) for x in params)
        return cls(t.to(device), p.to(device), k.to(device), greedy=all(x.greedy for x in params), filtered=filtered)


def _point_mass(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)


def process_logits(logits: torch.Tensor, params: SamplingParams | RowSampling) -> torch.Tensor:
    """logits [B, ..., V] -> probabilities [B, ..., V] fp32 (rows need at least one finite logit).

    Greedy (temperature 0) gives the point mass on the argmax (first index on ties), so the
    verifier's sampling rule reduces to greedy verification. Otherwise: divide by the
    temperature; keep the top_k largest; of those, keep the smallest prefix of the sorted,
    renormalised distribution whose mass reaches top_p (the top-1 token is always kept);
    renormalise. Sorting is stable, so ties are broken towards the lower token id.

    ``RowSampling`` applies row b's settings to ``logits[b]`` (greedy rows: point mass); the
    top-k / top-p filter (a sort over V) runs when its host-side ``filtered`` says a sampled row
    uses one, for every row (its cost does not depend on the rows' values).
    """
    x = logits.float()
    if params.greedy:
        return _point_mass(x)
    greedy_rows = None
    if isinstance(params, RowSampling):
        col = (-1,) + (1,) * (x.dim() - 1)  # [B, 1, ..., 1]: row b's value for every position of row b
        t = params.temperature.view(col)
        greedy_rows = t == 0
        temperature, top_p, top_k = torch.where(greedy_rows, 1.0, t), params.top_p.view(col), params.top_k.view(col)
        filtered = params.filtered
    else:
        temperature, top_p, top_k = params.temperature, params.top_p, params.top_k
        filtered = top_k > 0 or top_p < 1.0
    x = x / temperature
    if filtered:
        v = x.shape[-1]
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [..., V]
        keep = torch.ones_like(sorted_x, dtype=torch.bool)
        keep &= (torch.arange(v, device=x.device) < top_k) | (top_k <= 0)
        ps = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
        mass_before = torch.cumsum(ps, dim=-1) - ps  # exclusive prefix mass; 0 for the top-1
        keep &= (mass_before < top_p) | (top_p >= 1.0)
        keep = torch.zeros_like(keep).scatter_(-1, order, keep)  # back to vocabulary order
        x = x.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if greedy_rows is not None:
        probs = torch.where(greedy_rows, _point_mass(logits.float()), probs)
    return probs


def _race_keys(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """log p - log E with E ~ Exp(1): sorting these keys is sampling without replacement.

    p = 0 gives -inf, so a zero-probability token never beats a positive one. The uniform is
    clamped away from 0 so that E stays finite (torch.rand can return exactly 0).
    """
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float32)
    e = -torch.log(u.clamp_min(torch.finfo(torch.float32).tiny))  # Exp(1), in (0, 88]
    return torch.log(probs.float()) - torch.log(e)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs [..., V] (a distribution per row) -> one token id per row [...] long."""
    return _race_keys(probs, generator).argmax(dim=-1)


def sample_without_replacement(probs: torch.Tensor, n: int, generator: torch.Generator
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [..., V] -> (ids [..., n] long in draw order, valid [..., n] bool).

    ids[..., j] is distributed as the j-th draw of sequential sampling without replacement, each
    draw from ``probs`` with the earlier draws removed and renormalised. A row with fewer than n
    tokens of positive probability runs out: its surplus slots are ``valid = False`` and hold
    token 0 (in range, so padding can still be embedded); zero-probability tokens are never
    returned as valid. Requires n <= V.
    """
    keys, ids = torch.topk(_race_keys(probs, generator), n, dim=-1)  # [..., n], sorted descending
    valid = keys > float("-inf")
    return torch.where(valid, ids, torch.zeros_like(ids)), valid


def remove_and_renormalise(q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """q [..., V] with the tokens ids [..., m] zeroed, renormalised (all zeros if no mass is left).

    The distribution of the next draw without replacement after ``ids`` were drawn from ``q``.
    """
    out = q.scatter(-1, ids, 0.0)
    mass = out.sum(dim=-1, keepdim=True)
    return out / mass.clamp_min(torch.finfo(out.dtype).tiny)


__all__ = ["RowSampling", "SamplingParams", "process_logits", "remove_and_renormalise", "sample",
           "sample_without_replacement"]
