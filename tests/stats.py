"""Statistical helpers shared by the runtime's distribution tests."""

from __future__ import annotations

import torch


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts against probs (cells with expectation < 5 pooled).

    Any count in a cell of probability 0 is an outright failure (p-value 0).
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = counts.sum() * probs
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small & (probs > 0)].sum()[None]])
    exp = torch.cat([expected[~small], expected[small & (probs > 0)].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
