"""The row pass of the fused head loss: from one chunk's logits to KL, argmaxes and logit gradients.

Inputs of a chunk of P positions and K TTT steps (student row i = p*K + k is scored against
teacher row p):

    z  [P*K, V] fp32   drafter logits          zt [P, V] fp32   teacher logits
    s  [P*K, V] fp32   low-rank scorer scores (or None)          w [P, K] fp32 token weights

Outputs, with p = softmax(zt), q = softmax(z), q_s = softmax(s), p_s = p ("target" teacher) or
q ("full" teacher, detached):

    kl      [P, K]  sum_v p (log p - log q)              dz [P*K, V] = w (q - p)        (out dtype)
    argmax  [P, K]  argmax_v z   (first maximal index)    t_argmax [P] = argmax_v zt
    scorer_kl [P, K] sum_v p_s (log p_s - log q_s)       ds [P*K, V] = c w (q_s - p_s)
    full_in_topk / target_in_topk [P, K]: #{v : s_v > s_a} < topk for a = argmax / t_argmax

``row_pass_torch`` is the reference (any device); ``torchspec.train.loss_triton`` computes the same
in one kernel with two passes over V per position (online max/sum-exp, then gradients), reading
each teacher row once for its K student rows. The candidate loss (``torchspec.train.loss_candidates``)
reuses the pieces: ``row_pass_torch`` over gathered candidate logits (one student row per teacher
row), ``teacher_rows``, ``topk_hits`` and ``scorer_rows``; ``mm_f32`` / ``addmm_f32_`` are the
fp32-output GEMMs both paths use.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

MAX_TRITON_STEPS = 16  # K rows of one position share a [next_pow2(K), BLOCK_V] tile


@dataclass
class RowOutputs:
    """The whole batch's per-row results, filled chunk by chunk (rows = positions)."""

    kl: Tensor  # [N, K] fp32
    argmax: Tensor  # [N, K] long
    target_argmax: Tensor  # [N] long
    scorer_kl: Tensor | None
    full_in_topk: Tensor | None  # [N, K] bool
    target_in_topk: Tensor | None

    @classmethod
    def empty(cls, n: int, k: int, scorer: bool, dtype: torch.dtype, device: torch.device) -> RowOutputs:
        f32 = {"dtype": dtype, "device": device}
        return cls(torch.empty(n, k, **f32), torch.empty(n, k, dtype=torch.long, device=device),
                   torch.empty(n, dtype=torch.long, device=device),
                   torch.empty(n, k, **f32) if scorer else None,
                   torch.empty(n, k, dtype=torch.bool, device=device) if scorer else None,
                   torch.empty(n, k, dtype=torch.bool, device=device) if scorer else None)

    def tensors(self) -> tuple[Tensor, ...]:
        out = (self.kl, self.argmax, self.target_argmax)
        if self.scorer_kl is not None:
            out += (self.scorer_kl, self.full_in_topk, self.target_in_topk)
        return out


def mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b as fp32 (2-D, or 3-D batched). CUDA: bf16 operands accumulate in fp32 and are not rounded back. CPU has no
    fp32-output bf16 GEMM: the bf16 product is rounded to bf16 and upcast, as bf16 autocast does
    (CPUs run bf16 only where it is the faster: ``train.optim.fast_bf16``)."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if a.is_cuda:
        return (torch.bmm if a.dim() == 3 else torch.mm)(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def addmm_f32_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc (fp32) += a @ b in place: the GEMM's epilogue reads and writes acc (no temporary)."""
    if a.dtype in (torch.float32, torch.float64):
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # CPU: a bf16 product per chunk, accumulated in fp32 (chunks are few on CPU)
        acc.add_(a @ b)


def row_pass_torch(z: Tensor, zt: Tensor, s: Tensor | None, w: Tensor, k: int, topk: int, coef: float,
                   scorer_full: bool, out_dtype: torch.dtype, outs: RowOutputs, rows: slice,
                   grads: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """Reference row pass; writes ``outs[rows]`` and returns (dz, ds) in ``out_dtype`` (None, None
    when not ``grads``: evaluation). Overwrites ``z`` and ``s`` (the logit gradients are built in
    their memory: few passes over [P*K, V] on CPU).

    With lse_z = logsumexp(z): KL = sum_v p log p - sum_v p z + lse_z (sum_v p = 1), so no
    log q tensor is needed."""
    p_n, v = zt.shape
    prob, plogp, t_argmax = teacher_rows(zt)
    z3 = z.view(p_n, k, v)
    lse_z = torch.logsumexp(z3, dim=-1)  # [P, K]
    argmax = z3.argmax(-1)  # [P, K]
    outs.argmax[rows], outs.target_argmax[rows] = argmax, t_argmax
    outs.kl[rows] = plogp[:, None] - torch.einsum("pv,pkv->pk", prob, z3) + lse_z
    ds = None
    if s is not None:
        s3 = s.view(p_n, k, v)
        outs.full_in_topk[rows] = topk_hits(s3, argmax, topk)
        outs.target_in_topk[rows] = topk_hits(s3, t_argmax[:, None].expand(p_n, k), topk)
        if scorer_full:  # teacher q = softmax(z), detached
            logq = z3 - lse_z[..., None]
            q = logq.exp()
            outs.scorer_kl[rows], ds = scorer_rows(s3, q, (q * logq).sum(-1), w, coef, out_dtype, grads)
        else:
            outs.scorer_kl[rows], ds = scorer_rows(s3, prob, plogp[:, None], w, coef, out_dtype, grads)
    if not grads:
        return None, None
    dz = z3.sub_(lse_z[..., None]).exp_()  # in place: z -> q
    dz.sub_(prob[:, None]).mul_(w[..., None])
    return dz.view(p_n * k, v).to(out_dtype), ds


def teacher_rows(zt: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher logits [P, V] -> (p = softmax(zt) [P, V], sum_v p log p [P], argmax_v zt [P])."""
    logp = torch.log_softmax(zt, dim=-1)
    prob = logp.exp()
    return prob, (prob * logp).sum(-1), zt.argmax(-1)


def topk_hits(s3: Tensor, ids: Tensor, topk: int) -> Tensor:
    """[P, K] bool: token ``ids`` [P, K] is a top-``topk`` candidate of the scores s3 [P, K, V], i.e.
    fewer than ``topk`` scores exceed its score (ties at the k-th score count as hits)."""
    return (s3 > s3.gather(-1, ids[..., None])).sum(-1) < topk


def scorer_rows(s3: Tensor, teacher: Tensor, teacher_plogp: Tensor, w: Tensor, coef: float,
                out_dtype: torch.dtype, grads: bool) -> tuple[Tensor, Tensor | None]:
    """The scorer's distillation rows: scores s3 [P, K, V] against a teacher distribution ``teacher``
    ([P, V], shared by the K steps of a position, or [P, K, V]) with sum_v t log t ``teacher_plogp``
    ([P, 1] or [P, K]). Returns (KL(t || softmax(s)) [P, K], ds = coef w (softmax(s) - t) [P*K, V]
    in ``out_dtype``, or None when not ``grads``); ds is built in s3's memory."""
    p_n, k, v = s3.shape
    lse_s = torch.logsumexp(s3, dim=-1)  # [P, K]
    shared = teacher.dim() == 2
    kl = teacher_plogp - torch.einsum("pv,pkv->pk" if shared else "pkv,pkv->pk", teacher, s3) + lse_s
    if not grads:
        return kl, None
    qs = s3.sub_(lse_s[..., None]).exp_()  # in place: s -> softmax(s)
    qs.sub_(teacher[:, None] if shared else teacher).mul_(coef * w[..., None])
    return kl, qs.view(p_n * k, v).to(out_dtype)


def triton_unsupported(device: torch.device, steps: int) -> str | None:
    """Why the Triton row pass cannot run here (None: it can)."""
    if device.type != "cuda":
        return f"the Triton row pass needs CUDA (tensors are on {device.type})"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if steps > MAX_TRITON_STEPS:
        return f"K={steps} TTT steps exceed the Triton row pass's {MAX_TRITON_STEPS}"
    return None


def _row_pass_triton(*args, **kwargs):
    from torchspec.train.loss_triton import row_pass_triton

    return row_pass_triton(*args, **kwargs)


ROW_BACKENDS: dict[str, Callable] = {"torch": row_pass_torch, "triton": _row_pass_triton}
