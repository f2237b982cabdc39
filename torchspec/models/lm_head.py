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

**Training.** Two losses with disjoint parameters:

* the full head W is trained by the main loss, unchanged: the fused chunked forward KL to the
  target over all of V (``torchspec.train.loss``), exactly as a dense drafter.
* the scorer (down, up) is trained by ``lowrank_distill_loss``: forward KL from a teacher
  distribution to softmax(s(h)), summed over valid tokens with the main loss's token weights.
  Forward KL is mass-covering: it pushes up the score of every token the teacher gives mass to,
  which is what "the right tokens are inside the top-k" needs; its gradient on the scores,
  w * (softmax(s) - p), has the same form as the main loss's. The teacher is either
  - the target distribution p_target (pass ``teacher_probs``; recommended default in TTT: it is
    already in memory, so the aux loss only adds the rank-r matmuls, ~r/H of the main loss), or
  - the drafter's own full head, softmax(W h / tau) detached (``teacher_probs=None``): the
    scorer then imitates exactly what it must preserve (the dense head's ranking), at the price
    of one more [N, V] x H matmul per TTT step (about a third of the main loss's cost).
  Where the full head is right (the only positions a greedy chain accepts), both teachers have
  the same argmax; they differ where the full head is wrong.
* the drafter state h is detached in the aux loss: the scorer follows the drafter, it does not
  steer it. Without the detach the aux gradient would pull the drafter's states towards
  directions a rank-r map reads easily, trading main-loss quality for recall; the full head and
  the layer stay trained only by the objective that defines acceptance.

Why a custom autograd Function: like the fused main loss, chunks of ``chunk_elems`` scores are
materialised at a time and the gradients of down/up are accumulated in the same pass, so no
[N, V] tensor exists whole. Chunked plain autograd would keep every chunk's softmax alive until
backward (the whole [N, V] again) or recompute it under checkpointing (a second pass over V).

**Recall** (``topk_recall`` turns the counts into these ratios), over the valid positions i (token weight > 0), with
C_k(h) = the k ids returned by ``torch.topk(s(h), k)`` (ties broken as torch.topk breaks them)
and argmax taken as torch.argmax does (first maximal index):

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


# ---- auxiliary training loss of the scorer -----------------------------------------------------


class LowRankDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, down, up, weight, teacher_probs, token_weights, full_argmax, target_argmax,
                topk, tau, compute_dtype, chunk_rows, need_down, need_up):
        """hidden [B, N, H] (detached), down [r, H], up [V, r], weight [V, H] or None (needed when
        teacher_probs or full_argmax is None), teacher_probs [B, N, V] fp32 or None, token_weights
        [B, N] fp32, full_argmax / target_argmax [B, N] or None.

        Returns (weighted loss, KL per token [B, N], full-head argmax [B, N] (computed or the one
        given), full argmax in top-k [B, N], target argmax in top-k [B, N] (all False without
        target_argmax)).
        """
        b, n, _ = hidden.shape
        dev = hidden.device
        h_c, d_c, u_c = hidden.to(compute_dtype), down.to(compute_dtype), up.to(compute_dtype)
        w_c = weight.to(compute_dtype) if weight is not None else None
        kl = torch.empty(b, n, dtype=torch.float32, device=dev)
        fa_all = torch.empty(b, n, dtype=torch.long, device=dev) if full_argmax is None else full_argmax
        full_hit = torch.zeros(b, n, dtype=torch.bool, device=dev)
        target_hit = torch.zeros(b, n, dtype=torch.bool, device=dev)
        grad_down = torch.zeros_like(down, dtype=torch.float32) if need_down else None
        grad_up = torch.zeros_like(up, dtype=torch.float32) if need_up else None
        for i in range(b):
            for start in range(0, n, chunk_rows):
                rows = slice(start, min(start + chunk_rows, n))
                hc = h_c[i, rows]  # [c, H]
                a = hc @ d_c.T  # [c, r]
                s = (a @ u_c.T).float()  # [c, V]
                cand = s.topk(topk, dim=-1, sorted=False).indices  # [c, k]
                z = (hc @ w_c.T).float() if w_c is not None else None  # [c, V] full logits
                if full_argmax is None:
                    fa_all[i, rows] = z.argmax(-1)
                fa = fa_all[i, rows]
                full_hit[i, rows] = (cand == fa[:, None]).any(-1)
                if target_argmax is not None:
                    target_hit[i, rows] = (cand == target_argmax[i, rows, None]).any(-1)
                logq = torch.log_softmax(s / tau, dim=-1)
                if teacher_probs is None:
                    logp = torch.log_softmax(z / tau, dim=-1)
                    p = logp.exp()
                    kl[i, rows] = torch.linalg.vecdot(p, logp - logq)
                else:
                    p = teacher_probs[i, rows]
                    kl[i, rows] = torch.xlogy(p, p).sum(-1) - torch.linalg.vecdot(p, logq)
                if not (need_down or need_up):
                    continue
                # d loss / d s = w * (softmax(s / tau) - p) / tau
                ds = logq.exp_().sub_(p).mul_(token_weights[i, rows, None] / tau).to(compute_dtype)  # [c, V]
                if need_up:
                    grad_up.add_((ds.T @ a).float())  # [V, r]
                if need_down:
                    grad_down.add_(((ds @ u_c).T @ hc).float())  # [r, H]
        ctx.down_dtype, ctx.up_dtype = down.dtype, up.dtype
        ctx.save_for_backward(grad_down, grad_up)
        ctx.mark_non_differentiable(kl, fa_all, full_hit, target_hit)
        return (kl * token_weights).sum(), kl, fa_all, full_hit, target_hit

    @staticmethod
    def backward(ctx, grad_loss, _kl, _argmax, _full, _target):
        grad_down, grad_up = ctx.saved_tensors
        gd = (grad_down * grad_loss).to(ctx.down_dtype) if grad_down is not None else None
        gu = (grad_up * grad_loss).to(ctx.up_dtype) if grad_up is not None else None
        return None, gd, gu, None, None, None, None, None, None, None, None, None, None, None


def lowrank_distill_loss(
    hidden: torch.Tensor,
    head: EfficientLMHead,
    token_weights: torch.Tensor,
    teacher_probs: torch.Tensor | None = None,
    full_argmax: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
    tau: float = 1.0,
    chunk_elems: int = 1 << 24,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Auxiliary loss of the scorer, and top-k recall counted in the same pass (module docstring).

    hidden [B, N, H]: drafter states (detached here: no gradient reaches the drafter);
    token_weights [B, N]: the main loss's weights (0 = invalid; decay**k / global count otherwise);
    teacher_probs [B, N, V] fp32 (may be a T-slice) or None for teacher = softmax(W h / tau) of
    the full head (detached); tau must stay 1 with teacher_probs;
    full_argmax [B, N]: the full head's argmax if known (the fused main loss returns it), else it
    is computed here; target_argmax [B, N] for target recall.

    Returns (loss, stats) with loss = sum_i w_i KL(teacher_i || softmax(s_i / tau)), and stats of
    0-dim device tensors (no host sync), all sums over valid tokens (token weight > 0):
    ``kl_sum``, ``valid``, ``full_in_topk`` (full head's argmax among the candidates),
    and with target_argmax ``target_in_topk`` and ``correct_in_topk`` (full argmax == target
    argmax and among the candidates: the efficient head's greedy draft is right through the dense
    head's choice, a lower bound of its greedy accuracy; the exact value can exceed it only at
    positions counted in target_in_topk but not full_in_topk). Recall = count / valid.
    Matmuls run in the autocast dtype if on, else in hidden's; softmax in fp32.
    """
    if teacher_probs is not None and tau != 1.0:
        raise ValueError(f"lowrank_distill_loss: tau={tau} only applies with the full head as teacher.")
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    need_weight = teacher_probs is None or full_argmax is None
    grad_on = torch.is_grad_enabled()
    with torch.autocast(dev, enabled=False):
        loss, kl, full_argmax, full_hit, target_hit = LowRankDistill.apply(
            hidden.detach(), head.down, head.up, head.weight.detach() if need_weight else None,
            teacher_probs, token_weights.float(), full_argmax, target_argmax, head.topk, tau, dtype,
            max(1, chunk_elems // head.vocab_size),
            grad_on and head.down.requires_grad, grad_on and head.up.requires_grad)
    valid = token_weights > 0
    stats = {"kl_sum": (kl * valid).sum(), "valid": valid.sum(), "full_in_topk": (full_hit & valid).sum()}
    if target_argmax is not None:
        stats["target_in_topk"] = (target_hit & valid).sum()
        stats["correct_in_topk"] = (full_hit & (full_argmax == target_argmax) & valid).sum()
    return loss, stats


def topk_recall(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Counts of ``lowrank_distill_loss`` (0-dim, or [K] per TTT step, summed over micro-batches
    and ranks) -> ratios: ``recall_full``, ``recall_target`` and ``acc_efficient_lb`` (the lower
    bound of the efficient head's greedy accuracy), each count / valid."""
    names = {"full_in_topk": "recall_full", "target_in_topk": "recall_target", "correct_in_topk": "acc_efficient_lb"}
    valid = stats["valid"].clamp(min=1)
    return {out: stats[key] / valid for key, out in names.items() if key in stats}
