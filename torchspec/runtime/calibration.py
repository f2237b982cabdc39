"""How far the drafter's confidence is borne out, kept on the device (the draft controller's acceptance estimate).

The drafter's confidence is the controller's only estimate of acceptance, and a drafter can be confidently wrong (an untrained one whose head is the target's). ``Calibration`` keeps,
on the device, decayed sums of the drafted tokens the verified nodes' confidence expected and of those
actually accepted; their ratio (with a small prior at 1, so that without evidence it drifts back to 1
and the controller probes again) scales the expectation in every decision
(``controller_policy``'s ``scale``). An untrained drafter is verified for a round or two, then almost
never.
"""

from __future__ import annotations

import torch

from torchspec.runtime.controller_policy import SCALE_ONE


class Calibration:
    """Decayed evidence of how far the drafter's confidence is borne out (module docstring): per round
    ``accepted = decay * accepted + drafted tokens accepted`` and ``expected = decay * expected + their
    expectation by confidence``; the scale is ``(accepted + prior) / (expected + prior)``, at most
    ``most``. Defaults: evidence halves in ~14 rounds; an untrained drafter that expected ~3 tokens and got
    none is scaled to ~0.08 and probed again after ~50 rounds."""

    def __init__(self, device: torch.device, decay: float = 0.95, prior: float = 0.25, most: float = 4.0):
        if not (0 < decay < 1 and prior > 0 and most >= 1):
            raise ValueError(f"Calibration(decay={decay}, prior={prior}, most={most}): need 0 < decay < 1, "
                             f"prior > 0 and most >= 1.")
        self.decay, self.prior, self.most = decay, prior, most
        self.accepted = torch.zeros((), dtype=torch.float64, device=device)
        self.expected = torch.zeros((), dtype=torch.float64, device=device)
        self.pending: torch.Tensor | None = None  # this round's expectation, until its verification

    def scale(self) -> torch.Tensor:
        """0-d int64 in units of SCALE_ONE (no host read)."""
        ratio = ((self.accepted + self.prior) / (self.expected + self.prior)).clamp(max=self.most)
        return torch.round(ratio * SCALE_ONE).long()

    def observe(self, accepted: torch.Tensor, row_valid: torch.Tensor) -> None:
        """After verification: ``accepted`` [B] drafted tokens accepted per row (live rows count; a round without
        any, a CUDA-graph warm-up on idle inputs, leaves the evidence as it was)."""
        assert self.pending is not None, "observe follows a controlled round's draft"
        decay = torch.where(row_valid.any(), self.decay, 1.0).double()
        self.accepted.mul_(decay).add_((accepted * row_valid).sum().double())
        self.expected.mul_(decay).add_(self.pending)
        self.pending = None


__all__ = ["Calibration"]
