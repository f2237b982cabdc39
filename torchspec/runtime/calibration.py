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

**The scale is kept per rank.** A drafter overconfident along its best path is underconfident in its
alternatives: the mass the best path does not earn is where the lower-ranked nodes are accepted. One scale
for all nodes then reads the 17th-32nd best nodes as worth nothing, and the width criterion verifies 16 or 8
where 32 accept more (the SmolLM2-shaped controlled pair, docs/results.md, eighteenth session). So the
evidence is also kept by bucket of a verified node's rank by path probability (``controller_policy.
rank_bucket``: 1, 2-3, 4-7, 8-15, 16-31, 32+): the verified nodes' expectation per bucket, and the accepted
path's nodes counted in their rank's bucket (``DraftTree.score_rank``); the exponent is chosen on the
totals, and each bucket's ratio under it scales that bucket's nodes, shrunk towards the overall ratio where
the bucket has little evidence (an untrained drafter's deep ranks, never verified, are not probed for it).

The calibration also holds ahead mode's averaged plan tables (``averages_for``, ``plan_averages.py``): what
recent rounds rated each (depth, width), which like the evidence lives as long as the drafter's cost table.
"""

from __future__ import annotations

import itertools

import torch

from torchspec.runtime.controller_policy import PROB_ONE, RANK_BUCKETS, SCALE_ONE, rank_buckets
from torchspec.targets.fused_ops import fused

_SERIALS = itertools.count()  # a calibration's number: graphs that read it are keyed by it, never by id()
ALPHAS = (1.0, 0.5, 0.25, 0.125)  # exponents of the path probabilities (powers of two: p^a's logp * a is exact)
BUCKET_TABLE = 64  # ranks looked up in a table (every rank from 31 on is the last bucket)


class Calibration:
    """Decayed evidence of how far the drafter's confidence is borne out (module docstring): per round
    ``accepted = decay * accepted + drafted tokens accepted`` and, for each exponent ``a`` of ``ALPHAS``,
    ``expected[a] = decay * expected[a] + the verified nodes' sum of p^a``; the same split by bucket of the
    nodes' rank (``controller_policy.rank_bucket``: ``accepted_by_rank`` counts the accepted path's nodes by
    their rank, ``expected_by_rank[a]`` the verified nodes' p^a). ``choice()`` is the exponent whose expectation
    is nearest and a scale per rank bucket, each at most ``most``. Defaults: evidence halves in ~14 rounds; an
    untrained drafter that expected ~3 tokens and got none is scaled to ~0.08 and probed again after ~50 rounds.

    The evidence is one float64 tensor (``state``) that a round updates in one multiply and one add: the
    accepted tokens, those by rank bucket, then ``expected_block`` [A, R + 1] (by bucket, then all: the layout
    of ``evidence()``); the named fields are views of it."""

    def __init__(self, device: torch.device, decay: float = 0.95, prior: float = 0.25, most: float = 4.0):
        if not (0 < decay < 1 and prior > 0 and most >= 1):
            raise ValueError(f"Calibration(decay={decay}, prior={prior}, most={most}): need 0 < decay < 1, "
                             f"prior > 0 and most >= 1.")
        self.decay, self.prior, self.most = decay, prior, most
        self.serial = next(_SERIALS)  # CUDA graphs capture these tensors' addresses: a new calibration, new graphs
        a, r = len(ALPHAS), RANK_BUCKETS
        self.alphas = torch.tensor(ALPHAS, dtype=torch.float64, device=device)
        self.limits = torch.tensor([prior, most], dtype=torch.float64, device=device)  # read by decide_triton
        self.state = torch.zeros(1 + r + a * (r + 1), dtype=torch.float64, device=device)
        self.accepted = self.state[0]
        self.accepted_by_rank = self.state[1:1 + r]
        self.expected_block = self.state[1 + r:].view(a, r + 1)  # contiguous: decide_triton reads it
        self.expected = self.expected_block[:, r]
        self.expected_by_rank = self.expected_block[:, :r]
        self._bucket_table = rank_buckets(BUCKET_TABLE, device)  # a rank's bucket in one gather
        # this round's expectations until its verification: [len(ALPHAS), RANK_BUCKETS + 1], by bucket then all
        self.pending: torch.Tensor | None = None
        self._averages: dict[tuple[str, int, int], torch.Tensor] = {}

    def averages_for(self, shape: str, depths: int, widths: int) -> torch.Tensor:
        """The averaged plan table of greedy rounds of ``shape`` ("tree", "chain") with ``depths`` table depths and
        ``widths`` verify widths (``plan_averages``): [depths, widths] int64, -1 until rated, made once (outside
        any capture: ``RoundCosts`` lookups) and kept as long as the calibration, at one address for the graphs."""
        key = (shape, depths, widths)
        if key not in self._averages:
            self._averages[key] = torch.full((depths, widths), -1, dtype=torch.long, device=self.state.device)
        return self._averages[key]

    def ratios(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the chosen exponent's index, [1] int64; each rank bucket's ratio under it, [RANK_BUCKETS] float64,
        uncapped), no host read: the exponent whose decayed expectation is nearest the accepted tokens (ratio or
        its inverse smallest; the first, a = 1, on ties), then each bucket's ratio, its prior pulled to that
        overall ratio (``(accepted_by_rank + prior * overall) / (expected_by_rank[a] + prior)``): a bucket never
        verified is read as all nodes are, not as the drafter's confidence as is."""
        ratio = (self.accepted + self.prior) / (self.expected + self.prior)  # [A]
        at = torch.argmin(torch.maximum(ratio, 1 / ratio)).view(1)  # the first minimum
        overall = ratio.gather(0, at)[0]  # a bucket without evidence of its own is scaled as all nodes are
        return at, ((self.accepted_by_rank + self.prior * overall)
                    / (self.expected_by_rank.index_select(0, at)[0] + self.prior))

    def choice(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the exponent, 0-d float64; the scales, [RANK_BUCKETS] int64 in units of SCALE_ONE), no host read: the
        exponent and bucket ratios of ``ratios``, each ratio capped at ``most``."""
        at, by_rank = self.ratios()
        return self.alphas.gather(0, at)[0], torch.round(by_rank.clamp(max=self.most) * SCALE_ONE).long()

    def evidence(self, pool_logp: torch.Tensor, verified: int, row_valid: torch.Tensor) -> torch.Tensor:
        """What a round that verifies the ``verified`` best nodes of each live row expects, under each exponent,
        by rank bucket and in all -> [len(ALPHAS), RANK_BUCKETS + 1] float64 drafted tokens (sums of the
        fixed-point units of ``controller_policy``, exact; p^a is monotone in p, so the best nodes and their
        ranks are the same under every exponent)."""
        out = self.expected.new_zeros(len(ALPHAS), RANK_BUCKETS + 1)
        if verified == 0:
            return out
        top = pool_logp.double().topk(verified, dim=1).values  # [B, m] the verified nodes' path log-probs, by rank
        units = torch.floor(torch.exp(top[None] * self.alphas[:, None, None]) * PROB_ONE).long()  # [A, B, m]
        per_rank = (units * row_valid[None, :, None]).sum(1)  # [A, m]
        buckets = rank_buckets(verified, pool_logp.device).expand(len(ALPHAS), verified)
        by_rank = per_rank.new_zeros(len(ALPHAS), RANK_BUCKETS).scatter_add_(1, buckets, per_rank)
        return torch.cat([by_rank, per_rank.sum(1, keepdim=True)], 1).double() / PROB_ONE

    def observe(self, accepted: torch.Tensor, ranks: torch.Tensor, row_valid: torch.Tensor) -> None:
        """After verification: ``accepted`` [B] drafted tokens accepted per row and ``ranks`` [B, D] the rank of the
        accepted path's node at each depth 1..D (``DraftTree.score_rank`` along the path; past ``accepted``: not
        read). Live rows count; a round without any, a CUDA-graph warm-up on idle inputs, leaves the evidence as
        it was."""
        assert self.pending is not None, "observe follows a controlled round's draft"
        factor, delta = _observation(accepted, ranks, row_valid, self._bucket_table, self.pending, self.decay)
        self.state.mul_(factor).add_(delta)
        self.pending = None


@fused
def _observation(accepted: torch.Tensor, ranks: torch.Tensor, row_valid: torch.Tensor, bucket_table: torch.Tensor,
                 pending: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's update of ``Calibration.state`` -> (the decay factor, 0-d: 1 when no row is live; the evidence
    to add, in the state's layout: the live rows' accepted nodes, those by their rank's bucket, then the pending
    expectations). One fused region on CUDA (~13 small ops that ran as as many kernels inside every controlled
    round's graph); the update itself stays an eager multiply and add, rounded twice as before."""
    on_path = (torch.arange(ranks.shape[1], device=ranks.device) < accepted[:, None]) & row_valid[:, None]
    bucket = bucket_table[ranks.clamp(0, BUCKET_TABLE - 1)]
    by_rank = pending.new_zeros(RANK_BUCKETS).scatter_add_(0, bucket.flatten(), on_path.flatten().double())
    factor = torch.where(row_valid.any(), decay, 1.0).double()
    return factor, torch.cat([by_rank.sum(0, keepdim=True), by_rank, pending.flatten()])


__all__ = ["ALPHAS", "Calibration"]
