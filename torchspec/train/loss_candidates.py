"""The candidate-restricted head loss (``drafter.head_loss=candidates``): under evaluation.

EAGLE-4's efficient head (``torchspec/models/lm_head.py``) can only ever propose one of the
low-rank scorer's top-k candidates, re-scored exactly by the full head W. This loss trains W only
where serving reads it: for each scored row i (target position n, TTT step k),

    C_i  = topk_k(s_i) ∪ topk_m(zt_n)            k = drafter.lm_head_topk, m = drafter.head_loss_target_topk
    KL_i = KL(p_C || q_C),  p_C = softmax(zt_n restricted to C_i),  q_C = softmax((W h_i) restricted to C_i)

with s_i the scorer's scores over V, zt_n the teacher logits (the target's top-m is per position,
shared by its K steps) and the full-head logits computed at the candidates only, z_C = W[C_i] h_i
(a gather of |C| <= k + m rows, never the [P*K, V] matmul for W). A token in both top-k sets
counts once (its second copy is masked). The target's top-m keeps the target's likely tokens in
the loss even where the scorer misses them, so W learns to rank them and the scorer's
distillation (unchanged: KL to the target over all of V) learns to find them. Token weights,
normalisation and step decay are the full loss's (contract 4).

It is one branch of the fused pass (``torchspec.train.loss.FusedTTTHeadLoss``): the teacher
logits, the scorer's scores over V, its distillation, its gradients and the chunking over
positions are shared; ``candidate_rows`` replaces the dense head's row work, chunk by chunk, with
its gradients computed in the forward, so the gathered rows [P*K, |C|, H] exist for one chunk only.

Outputs (``HeadLossOutput``) under this loss:

    kl            KL over the candidates (above), not over V
    argmax        the served proposal: argmax of W[S] h over the scorer's top-k S (not over the
                  target's top-m, which serving never sees); ``correct`` is therefore served accuracy
    target_argmax the teacher's argmax over its full vocabulary, as in the full loss
    full_in_topk  True: the proposal is a scorer candidate by construction (topk_recall_full = 1)
    target_in_topk, scorer_kl   as in the full loss

FLOPs per target position (matmuls, forward + backward; H drafter width, Ht target width, V
vocabulary, K steps, r scorer rank, |C| <= k + m candidates):

    full        6 K V H  + 6 K r (V + H) + 2 V Ht      (head W, scorer, teacher logits)
    candidates  6 K |C| H + 6 K r (V + H) + 2 V Ht

    SmolLM2 (V=49152, H=Ht=576, K=7, r=128, |C|=256):  1.51 -> 0.33 GFLOP (W: 1.19 G -> 6.2 M, 192x)
    flagship (V=248320, H=Ht=5120, K=7, r=128, |C|=256): 57.3 -> 3.96 GFLOP (W: 53.4 G -> 55 M, 970x)

so the scorer and the teacher logits (still over V) bound the whole saving (4.6x and 14.5x).
The candidate part is bound by bytes, not FLOPs: it reads K |C| H gathered weights per position
(18 MB in bf16 at the flagship shape) where the dense GEMM reuses W across rows; and the
row work over V (softmax of zt and s, two top-k selections) remains, in torch (the Triton row pass
is the full loss's only). Time it on the GPU before believing the FLOP ratio; the CUDA path
(bf16 gathers, the fp32-output batched GEMM, W's gradient by ``index_add_``, whose atomic adds
make it not bitwise deterministic there) is tested on CPU only so far.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from torchspec.train import loss_rows

MASKED = -1e30  # a duplicate candidate's logits: exp() underflows to 0, finite so 0 * logit is not NaN


def duplicates(ids: Tensor) -> Tensor:
    """[R, C] bool: ids[r, c] equals an id earlier in row r. Each top-k set has distinct ids, so with
    the scorer's set first only the target's copies of shared tokens are flagged."""
    sorted_ids, order = ids.sort(dim=-1, stable=True)  # stable: equal ids keep their column order
    later = torch.zeros_like(ids, dtype=torch.bool)
    later[:, 1:] = sorted_ids[:, 1:] == sorted_ids[:, :-1]
    return torch.zeros_like(later).scatter_(1, order, later)


def candidate_ids(s: Tensor, zt: Tensor, steps: int, topk: int, target_topk: int) -> tuple[Tensor, Tensor]:
    """Scores s [P*K, V] and teacher logits zt [P, V] -> (ids [P*K, k + m]: the scorer's top-k of
    each row, then the target's top-m of its position; dup [P*K, k + m] bool: second copies)."""
    p_n, v = zt.shape
    scorer_ids = s.topk(topk, dim=-1, sorted=False).indices  # [P*K, k]
    target_ids = zt.topk(min(target_topk, v), dim=-1, sorted=False).indices  # [P, m]
    target_ids = target_ids[:, None].expand(p_n, steps, -1).reshape(p_n * steps, -1)
    ids = torch.cat([scorer_ids, target_ids], dim=-1)
    return ids, duplicates(ids)


def candidate_rows(xc: Tensor, zt: Tensor, s: Tensor, weight: Tensor, w: Tensor, steps: int, topk: int,
                   target_topk: int, coef: float, outs: loss_rows.RowOutputs, rows: slice, grad_x: Tensor | None,
                   grad_w: Tensor | None, scorer_grads: bool) -> Tensor | None:
    """One chunk's row work under the candidate loss: xc [P*K, H] drafter states and ``weight``
    [V, H] in the compute dtype, zt [P, V] fp32 teacher logits, s [P*K, V] fp32 scorer scores
    (overwritten), w [P, K] token weights. Writes ``outs[rows]``; adds this chunk's gradients to
    ``grad_x[rows]`` ([N, K, H]) and ``grad_w`` ([V, H], fp32) where given. Returns the scorer's
    logit gradient ds [P*K, V] (compute dtype; None unless ``scorer_grads``), as the full loss's
    row pass does."""
    p_n = zt.shape[0]
    acc = w.dtype
    ids, dup = candidate_ids(s, zt, steps, topk, target_topk)  # [P*K, C]
    gathered = F.embedding(ids, weight)  # [P*K, C, H]
    z = loss_rows.mm_f32(gathered, xc[:, :, None]).squeeze(-1)  # [P*K, C] exact full-head logits
    outs.argmax[rows] = ids.gather(-1, z[:, :topk].argmax(-1, keepdim=True)).view(p_n, steps)  # served
    outs.full_in_topk[rows] = True
    zc = zt[:, None].expand(p_n, steps, -1).gather(-1, ids.view(p_n, steps, -1)).view(p_n * steps, -1)
    z.masked_fill_(dup, MASKED)
    zc.masked_fill_(dup, MASKED)
    # The row pass with one student row per teacher row (K=1): KL and w (q_C - p_C) over the candidates.
    head = loss_rows.RowOutputs.empty(p_n * steps, 1, False, acc, zt.device)
    dz, _ = loss_rows.row_pass_torch(z, zc, None, w.reshape(-1, 1), 1, 0, 0.0, False, acc, head, slice(None),
                                     grads=grad_x is not None or grad_w is not None)
    outs.kl[rows] = head.kl.view(p_n, steps)
    if grad_x is not None:  # dh_i = sum_c dz_ic W[c]
        grad_x[rows] = loss_rows.mm_f32(dz.to(weight.dtype)[:, None], gathered).view(p_n, steps, -1)
    if grad_w is not None:  # dW[c] += dz_ic h_i; a masked duplicate adds 0
        grad_w.index_add_(0, ids.flatten(), (dz[..., None] * xc[:, None].to(acc)).flatten(0, 1))
    del gathered, z, zc, dz
    # The scorer over all of V, as in the full loss: recall of the target's argmax and distillation.
    prob, plogp, t_argmax = loss_rows.teacher_rows(zt)
    s3 = s.view(p_n, steps, -1)
    outs.target_argmax[rows] = t_argmax
    outs.target_in_topk[rows] = loss_rows.topk_hits(s3, t_argmax[:, None].expand(p_n, steps), topk)
    outs.scorer_kl[rows], ds = loss_rows.scorer_rows(s3, prob, plogp[:, None], w, coef, weight.dtype, scorer_grads)
    return ds


def candidate_bytes(vocab: int, steps: int, candidates: int, hidden: int, dtype: torch.dtype) -> int:
    """Transient bytes per position: fp32 zt [V], fp32 s and ds [K, V], the gathered rows [K, C, H]
    and their fp32 weight-gradient terms."""
    size = torch.finfo(dtype).bits // 8
    return vocab * (4 + steps * (4 + size)) + steps * candidates * hidden * (size + 4)
