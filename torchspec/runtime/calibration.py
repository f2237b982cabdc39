"""How far the drafter's confidence is borne out, kept on the device (the draft controller's acceptance estimate).

The drafter's confidence is the controller's only estimate of acceptance, and it can be wrong both ways. An
untrained drafter whose head is the target's is confidently wrong. A trained one is often *under*confident
for greedy decoding: trained toward the target's distribution, it gives its top token the target's
probability (0.3, say) while greedy verification accepts it whenever the two argmaxes agree (far more
often), and along a path the gap compounds (0.3^5 against ~0.5 accepted). A multiplicative scale cannot
close a gap that grows with depth, so ``Calibration`` fits an exponent as well: it keeps, on the device,
decayed sums of the drafted tokens accepted and of those the verified nodes' confidence expected with every
path probability raised to each ``ALPHAS`` power (p^a lifts a long path more than a short one); each round
the controller reads the path probabilities as p^a for the exponent whose expectation is nearest to what was
accepted (ratio nearest 1; ties to the plainest, a = 1), times the remaining ratio
``(accepted + prior) / (expected_a + prior)`` (at most ``most``) as a scale. The small prior pulls both back
to the confidence as is without evidence, so the controller probes again. An untrained drafter (nothing
accepted) keeps a = 1 and is scaled towards 0: verified for a round or two, then almost never.
"""

from __future__ import annotations

import itertools

import torch

from torchspec.runtime.controller_policy import PROB_ONE, SCALE_ONE

_SERIALS = itertools.count()  # a calibration's number: graphs that read it are keyed by it, never by id()
ALPHAS = (1.0, 0.5, 0.25, 0.125)  # exponents of the path probabilities (powers of two: p^a's logp * a is exact)


class Calibration:
    """Decayed evidence of how far the drafter's confidence is borne out (module docstring): per round
    ``accepted = decay * accepted + drafted tokens accepted`` and, for each exponent ``a`` of ``ALPHAS``,
    ``expected[a] = decay * expected[a] + the verified nodes' sum of p^a``; ``choice()`` is the exponent whose
    expectation is nearest and the scale ``(accepted + prior) / (expected[a] + prior)``, at most ``most``.
    Defaults: evidence halves in ~14 rounds; an untrained drafter that expected ~3 tokens and got none is
    scaled to ~0.08 and probed again after ~50 rounds."""

    def __init__(self, device: torch.device, decay: float = 0.95, prior: float = 0.25, most: float = 4.0):
        if not (0 < decay < 1 and prior > 0 and most >= 1):
            raise ValueError(f"Calibration(decay={decay}, prior={prior}, most={most}): need 0 < decay < 1, "
                             f"prior > 0 and most >= 1.")
        self.decay, self.prior, self.most = decay, prior, most
        self.serial = next(_SERIALS)  # CUDA graphs capture these tensors' addresses: a new calibration, new graphs
        self.alphas = torch.tensor(ALPHAS, dtype=torch.float64, device=device)
        self.limits = torch.tensor([prior, most], dtype=torch.float64, device=device)  # read by decide_triton
        self.accepted = torch.zeros((), dtype=torch.float64, device=device)
        self.expected = torch.zeros(len(ALPHAS), dtype=torch.float64, device=device)
        self.pending: torch.Tensor | None = None  # this round's expectations [len(ALPHAS)], until its verification

    def choice(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the exponent, 0-d float64; the scale, 0-d int64 in units of SCALE_ONE), no host read: the exponent
        whose decayed expectation is nearest the accepted tokens (ratio or its inverse smallest; the first,
        a = 1, on ties)."""
        ratio = (self.accepted + self.prior) / (self.expected + self.prior)  # [A]
        at = torch.argmin(torch.maximum(ratio, 1 / ratio)).view(1)  # the first minimum
        scale = torch.round(ratio.gather(0, at)[0].clamp(max=self.most) * SCALE_ONE).long()
        return self.alphas.gather(0, at)[0], scale

    def evidence(self, pool_logp: torch.Tensor, verified: int, row_valid: torch.Tensor) -> torch.Tensor:
        """What a round that verifies the ``verified`` best nodes of each live row expects, under each exponent
        -> [len(ALPHAS)] float64 drafted tokens (the fixed-point units of ``controller_policy``: p^a is monotone
        in p, so the best nodes are the same under every exponent and a = 1 is the decisions' own sum)."""
        if verified == 0:
            return self.alphas.new_zeros(len(ALPHAS))
        top = pool_logp.double().topk(verified, dim=1).values  # [B, m] the verified nodes' path log-probs
        units = torch.floor(torch.exp(top[None] * self.alphas[:, None, None]) * PROB_ONE).long()  # [A, B, m]
        return (units * row_valid[None, :, None]).sum((1, 2)).double() / PROB_ONE

    def observe(self, accepted: torch.Tensor, row_valid: torch.Tensor) -> None:
        """After verification: ``accepted`` [B] drafted tokens accepted per row (live rows count; a round without
        any, a CUDA-graph warm-up on idle inputs, leaves the evidence as it was)."""
        assert self.pending is not None, "observe follows a controlled round's draft"
        decay = torch.where(row_valid.any(), self.decay, 1.0).double()
        self.accepted.mul_(decay).add_((accepted * row_valid).sum().double())
        self.expected.mul_(decay).add_(self.pending)
        self.pending = None


__all__ = ["ALPHAS", "Calibration"]
