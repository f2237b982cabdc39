"""EAGLE-4's efficient LM head: a rank-r scorer over the full vocabulary picks k candidates, and
the full head re-scores only those k exactly.

Shapes: H hidden size, V target vocabulary (e.g. 248,320), r rank (default 128), k top-k (128).

    full head        W     [V, H]   (nn.Linear layout: the fused loss in train/loss.py uses it as is)
    scorer           down  [r, H],  up [V, r]      s(h) = up @ (down @ h)      ~ W h, rank r
    inference        ids = topk_k(s(h));  logits = W[ids] @ h  (gather k rows, batched matvec)
                     sparse draft logits: logits at ids, -inf at every other token

Per drafted token the dense head reads V*H weights (2.5 GB in bf16 at the flagship shape); the
efficient head reads r*(V+H) + k*H (64 MB + 1.3 MB), 40x less, and the k-row gather costs what
one matvec of k rows costs.

**Training.** Two losses with disjoint parameters, computed in ONE fused pass over the vocabulary
(``torchspec.train.loss``; the scorer's scores come from the same chunk of drafter states):

* the full head W is trained by the main loss, unchanged: forward KL to the target over all of V,
  exactly as a dense drafter.
* the scorer (down, up) is distilled: forward KL from a teacher distribution to softmax(s(h)),
  with the main loss's token weights. Forward KL is mass-covering: it pushes up the score of every
  token the teacher gives mass to, which is what "the right tokens are inside the top-k" needs;
  its gradient on the scores, w * (softmax(s) - p), has the same form as the main loss's. The
  teacher is the target distribution (``drafter.lowrank_teacher=target``, default: it is computed
  in the pass anyway) or the drafter's own full head softmax(W h), detached ("full"): the scorer
  then imitates exactly what it must preserve (the dense head's ranking). Where the full head is
  right (the only positions a greedy chain accepts), both teachers have the same argmax.
* the drafter state h is detached in the scorer's loss: the scorer follows the drafter, it does
  not steer it. Without the detach the aux gradient would pull the drafter's states towards
  directions a rank-r map reads easily, trading main-loss quality for recall.

The scorer's extra cost is its rank-r matmuls (~3 r / (4 H) of the main loss's FLOPs) and one
more [rows, V] read in the row pass.

**Recall** (counted by the fused loss pass, reported per depth by the training metrics), over the
valid positions i (token weight > 0), with C_k(h) = the ids whose score is exceeded by fewer than
k scores (the top-k, ties at the k-th score counted in) and argmax taken as torch.argmax does:

    full recall@k   = #{i valid : argmax_v (W h_i)_v in C_k(h_i)} / #{i valid}
    target recall@k = #{i valid : argmax_v p_target(i)_v in C_k(h_i)} / #{i valid}

Full recall is the rate at which the sparse greedy draft equals the dense greedy draft: when the
dense argmax is a candidate, the exact re-score picks it (up to exact ties and, in bf16, rounding
differences between the gathered and the dense matmul). Target recall bounds the sparse
drafter's greedy accuracy from above; ``correct_in_topk`` / valid bounds it from below.

**Initialisation** (``init_from_full`` / ``init_scorer``): truncated SVD of W, W ~ U_r S_r V_r^T,
with S split evenly, up = U_r S_r^(1/2), down = S_r^(1/2) V_r^T, so up @ down is the best rank-r
approximation of W in Frobenius norm (Eckart-Young) and both factors have the same norm, which
keeps their gradient scales alike. ``method="exact"`` runs ``torch.linalg.svd`` in fp32
(cost ~4 V H^2); ``"randomized"`` runs the randomized range finder with power iterations of
Halko, Martinsson & Tropp (2011, Alg. 4.4) with a seeded generator (cost ~2 V H (r + oversample)
(2 niter + 2) plus a few tall-skinny QRs); ``"auto"`` picks exact when V H^2 <= 6e10 or the rank
is over half of H, else randomized. Measured on the 2-core dev machine (shared, so noisy):
V=49K, H=576: exact 2-11 s; V=49K, H=2048: exact 25 s, randomized 9-11 s. On a Gaussian random
matrix (flat spectrum, the hardest case) the randomized rank-128 error is within 1% of the exact
one (0.871 vs 0.863 relative, V=49K, H=576); real heads have decaying spectra. The flagship shape (V=248K, H=5120) costs
~4 TFLOP randomized: an estimate of well under a second of H200 matmul time (not measured yet);
pass ``device="cuda"`` and the SVD runs there with the factors copied back, so a drafter still
on the CPU is initialised in seconds. Every rank computes the same factors (seeded, same
inputs); initialise before sharding, or broadcast from rank 0 if the devices differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_EXACT_SVD_MAX_COST = 6e10  # V * H^2 up to which "auto" uses the exact SVD (a few s on CPU)


class EfficientLMHead(nn.Module):
    """Full LM head ``weight`` [V, H] plus a rank-``rank`` scorer (``down`` [r, H], ``up`` [V, r]).

    ``forward`` returns the full logits, so the module drops in where an ``nn.Linear`` head was.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int = 128, topk: int = 128,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if not 1 <= rank <= hidden_size:
            raise ValueError(f"EfficientLMHead: rank={rank} must lie in [1, hidden_size={hidden_size}].")
        if not 1 <= topk <= vocab_size:
            raise ValueError(f"EfficientLMHead: topk={topk} must lie in [1, vocab_size={vocab_size}].")
        self.hidden_size, self.vocab_size, self.rank, self.topk = hidden_size, vocab_size, rank, topk
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, **factory))
        self.down = nn.Parameter(torch.empty(rank, hidden_size, **factory))
        self.up = nn.Parameter(torch.empty(vocab_size, rank, **factory))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init of all three (the drafter's ``_init_weights``); call ``init_scorer`` after
        the full head holds real weights."""
        for p in (self.weight, self.down, self.up):
            nn.init.normal_(p, std=std)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, rank={self.rank}, topk={self.topk}"

    # ---- scoring -------------------------------------------------------------------------------

    def full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V], the dense head."""
        return F.linear(h, self.weight)

    forward = full_logits

    def lowrank_scores(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V], the rank-r approximation (h @ down.T) @ up.T."""
        return F.linear(F.linear(h, self.down), self.up)

    def candidates(self, h: torch.Tensor, topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Inference path: [..., H] -> (ids [..., k] unordered, exact logits W[ids] @ h [..., k])."""
        k = self.topk if topk is None else topk
        ids = self.lowrank_scores(h).topk(k, dim=-1, sorted=False).indices  # [..., k]
        rows = F.embedding(ids, self.weight)  # [..., k, H]: gather k rows of W per token
        logits = torch.matmul(rows, h.unsqueeze(-1)).squeeze(-1)  # [..., k]
        return ids, logits

    def draft_logits_sparse(self, h: torch.Tensor, topk: int | None = None) -> torch.Tensor:
        """[..., H] -> [..., V]: exact logits at the candidates, -inf elsewhere (the sparse draft
        distribution is its softmax)."""
        ids, logits = self.candidates(h, topk)
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return out.scatter_(-1, ids, logits)

    # ---- initialisation ------------------------------------------------------------------------

    @torch.no_grad()
    def init_from_full(self, weight: torch.Tensor, **svd_kwargs) -> None:
        """Copy a full head [V, H] (e.g. the target's lm_head) and SVD-initialise the scorer."""
        self.weight.copy_(weight)
        self.init_scorer(**svd_kwargs)

    @torch.no_grad()
    def init_scorer(self, method: str = "auto", oversample: int = 32, niter: int = 4, seed: int = 0,
                    device: torch.device | str | None = None) -> None:
        """Set (down, up) to the balanced rank-r truncated SVD of the current ``weight``.

        method: "exact" | "randomized" | "auto" (see the module docstring for costs); the SVD
        runs in fp32 on ``device`` (default: where the weight is).
        """
        w = self.weight.detach().to(device=device or self.weight.device, dtype=torch.float32)
        v, h = w.shape
        if method == "auto":
            exact = v * h * h <= _EXACT_SVD_MAX_COST or 2 * (self.rank + oversample) >= h
            method = "exact" if exact else "randomized"
        if method == "exact":
            u, s, vh = torch.linalg.svd(w, full_matrices=False)
        elif method == "randomized":
            u, s, vh = randomized_svd(w, self.rank, oversample, niter, seed)
        else:
            raise ValueError(f"init_scorer: method={method!r}; use 'exact', 'randomized' or 'auto'.")
        root = s[: self.rank].sqrt()  # [r]
        self.up.copy_(u[:, : self.rank] * root)  # [V, r]
        self.down.copy_(root[:, None] * vh[: self.rank])  # [r, H]


def randomized_svd(a: torch.Tensor, rank: int, oversample: int = 32, niter: int = 4,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Truncated SVD of a [m, n] by a randomized range finder with ``niter`` power iterations,
    re-orthonormalised every half step (Halko et al. 2011, Alg. 4.4). Returns (U [m, rank],
    S [rank], Vh [rank, n]). A seeded generator keeps the result identical on every rank and
    leaves the global RNG untouched."""
    m, n = a.shape
    q = min(rank + oversample, m, n)
    gen = torch.Generator(device=a.device).manual_seed(seed)
    omega = torch.randn(n, q, generator=gen, device=a.device, dtype=a.dtype)
    basis = torch.linalg.qr(a @ omega).Q  # [m, q]
    for _ in range(niter):
        basis = torch.linalg.qr(a.T @ basis).Q  # [n, q]
        basis = torch.linalg.qr(a @ basis).Q  # [m, q]
    ub, s, vh = torch.linalg.svd(basis.T @ a, full_matrices=False)  # [q, n] -> small SVD
    return (basis @ ub)[:, :rank], s[:rank], vh[:rank]
