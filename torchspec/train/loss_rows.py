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
each teacher row once for its K student rows.
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


def row_pass_torch(z: Tensor, zt: Tensor, s: Tensor | None, w: Tensor, k: int, topk: int, coef: float,
                   scorer_full: bool, out_dtype: torch.dtype, outs: RowOutputs, rows: slice,
                   grads: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """Reference row pass; writes ``outs[rows]`` and returns (dz, ds) in ``out_dtype`` (None, None
    when not ``grads``: evaluation). Overwrites ``z`` and ``s`` (the logit gradients are built in
    their memory: few passes over [P*K, V] on CPU).

    With lse_z = logsumexp(z): KL = sum_v p log p - sum_v p z + lse_z (sum_v p = 1), so no
    log q tensor is needed."""
    p_n, v = zt.shape
    logp = torch.log_softmax(zt, dim=-1)  # [P, V]
    prob = logp.exp()
    plogp = (prob * logp).sum(-1)  # [P]
    z3 = z.view(p_n, k, v)
    lse_z = torch.logsumexp(z3, dim=-1)  # [P, K]
    argmax = z3.argmax(-1)  # [P, K]
    t_argmax = zt.argmax(-1)  # [P]
    outs.argmax[rows], outs.target_argmax[rows] = argmax, t_argmax
    outs.kl[rows] = plogp[:, None] - torch.einsum("pv,pkv->pk", prob, z3) + lse_z
    ds = None
    if s is not None:
        s3 = s.view(p_n, k, v)
        lse_s = torch.logsumexp(s3, dim=-1)  # [P, K]
        s_full = s3.gather(-1, argmax[..., None])  # [P, K, 1]
        s_tgt = s3.gather(-1, t_argmax[:, None, None].expand(p_n, k, 1))
        outs.full_in_topk[rows] = (s3 > s_full).sum(-1) < topk
        outs.target_in_topk[rows] = (s3 > s_tgt).sum(-1) < topk
        if scorer_full:  # teacher q (detached): KL = sum q (z - lse_z) - sum q s + lse_s
            q = (z3 - lse_z[..., None]).exp()
            outs.scorer_kl[rows] = (q * (z3 - lse_z[..., None] - s3)).sum(-1) + lse_s
        else:
            outs.scorer_kl[rows] = plogp[:, None] - torch.einsum("pv,pkv->pk", prob, s3) + lse_s
        if not grads:
            return None, None
        qs = s3.sub_(lse_s[..., None]).exp_()  # in place: s -> softmax(s)
        qs.sub_(q if scorer_full else prob[:, None]).mul_(coef * w[..., None])
        ds = qs.view(p_n * k, v).to(out_dtype)
    if not grads:
        return None, None
    dz = z3.sub_(lse_z[..., None]).exp_()  # in place: z -> q
    dz.sub_(prob[:, None]).mul_(w[..., None])
    return dz.view(p_n * k, v).to(out_dtype), ds


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
