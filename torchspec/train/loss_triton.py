"""The fused head loss's row pass as one Triton kernel (CUDA); ``loss_rows.row_pass_torch`` is its
reference and states the math.

One program per position p: a [KP, BLOCK_V] tile holds the K student rows of p (KP = K rounded up
to a power of two) and one teacher row, so the teacher row is read once for all K steps.

    pass 1 over V: online max / sum-exp of zt, z (and s); running argmax of zt and z
    pass 2 over V: p = exp(zt - lse_t), q = exp(z - lse_z): KL sums, dz = w (q - p) stored in the
                   output dtype; scorer: q_s, its KL, ds = c w (q_s - p_s), and the rank counts
                   #{v : s_v > s_a} for a = the drafter argmax and the teacher argmax

Bytes per position and pass: V * (4 + K * 4 [+ K * 4]) read; pass 2 writes V * K * 2 [* 2].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchspec.train.loss_rows import RowOutputs

BLOCK_V = 1024


@triton.jit
def _head_rows_kernel(z_ptr, zt_ptr, s_ptr, w_ptr, dz_ptr, ds_ptr, kl_ptr, am_ptr, tam_ptr, kls_ptr,
                      fhit_ptr, thit_ptr, V, K, topk, coef,
                      HAS_S: tl.constexpr, S_FULL: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, KP)
    kmask = ks < K
    rows = pid * K + ks  # [KP] student rows
    row_off = rows[:, None] * V  # [KP, 1]
    t_off = pid * V
    neg_inf = float("-inf")

    # ---- pass 1: log-sum-exp and argmax ---------------------------------------------------------
    m_t = tl.full((1,), neg_inf, tl.float32)  # the teacher row is a [1, BLOCK] tile
    l_t = tl.zeros((1,), tl.float32)
    best_t = tl.full((1,), neg_inf, tl.float32)
    best_ti = tl.zeros((1,), tl.int64)
    m_z = tl.full((KP,), neg_inf, tl.float32)
    l_z = tl.zeros((KP,), tl.float32)
    best_z = tl.full((KP,), neg_inf, tl.float32)
    best_zi = tl.zeros((KP,), tl.int64)
    m_s = tl.full((KP,), neg_inf, tl.float32)
    l_s = tl.zeros((KP,), tl.float32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        vmask = offs < V
        m2 = kmask[:, None] & vmask[None, :]
        zt = tl.load(zt_ptr + t_off + offs[None, :], mask=vmask[None, :], other=neg_inf)  # [1, BLOCK]
        bm = tl.max(zt, 1)
        bi = tl.argmax(zt, 1).to(tl.int64) + v0
        better = bm > best_t
        best_ti = tl.where(better, bi, best_ti)
        best_t = tl.where(better, bm, best_t)
        new_t = tl.maximum(m_t, bm)
        l_t = l_t * tl.exp(m_t - new_t) + tl.sum(tl.exp(zt - new_t[:, None]), 1)
        m_t = new_t

        z = tl.load(z_ptr + row_off + offs[None, :], mask=m2, other=neg_inf)
        z = tl.where(kmask[:, None], z, 0.0)  # padding rows stay finite
        zm = tl.max(z, 1)
        zi = tl.argmax(z, 1).to(tl.int64) + v0
        up = zm > best_z
        best_zi = tl.where(up, zi, best_zi)
        best_z = tl.where(up, zm, best_z)
        new_z = tl.maximum(m_z, zm)
        l_z = l_z * tl.exp(m_z - new_z) + tl.sum(tl.exp(z - new_z[:, None]), 1)
        m_z = new_z
        if HAS_S:
            s = tl.load(s_ptr + row_off + offs[None, :], mask=m2, other=neg_inf)
            s = tl.where(kmask[:, None], s, 0.0)
            new_s = tl.maximum(m_s, tl.max(s, 1))
            l_s = l_s * tl.exp(m_s - new_s) + tl.sum(tl.exp(s - new_s[:, None]), 1)
            m_s = new_s
    lse_t = m_t + tl.log(l_t)
    lse_z = m_z + tl.log(l_z)
    lse_s = m_s + tl.log(l_s)
    w = tl.load(w_ptr + rows, mask=kmask, other=0.0)  # [KP]

    # ---- pass 2: KL and logit gradients ---------------------------------------------------------
    kl = tl.zeros((KP,), tl.float32)
    kl_s = tl.zeros((KP,), tl.float32)
    cnt_f = tl.zeros((KP,), tl.int32)
    cnt_t = tl.zeros((KP,), tl.int32)
    if HAS_S:
        s_full = tl.load(s_ptr + rows * V + best_zi, mask=kmask, other=0.0)
        s_tgt = tl.load(s_ptr + rows * V + best_ti, mask=kmask, other=0.0)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        vmask = offs < V
        m2 = kmask[:, None] & vmask[None, :]
        zt = tl.load(zt_ptr + t_off + offs[None, :], mask=vmask[None, :], other=0.0)
        logp = zt - lse_t[:, None]  # [1, BLOCK]
        p = tl.where(vmask[None, :], tl.exp(logp), 0.0)
        z = tl.load(z_ptr + row_off + offs[None, :], mask=m2, other=0.0)
        logq = z - lse_z[:, None]
        q = tl.exp(logq)
        kl += tl.sum(tl.where(m2, p * (logp - logq), 0.0), 1)
        dz = w[:, None] * (q - p)
        tl.store(dz_ptr + row_off + offs[None, :], dz.to(dz_ptr.dtype.element_ty), mask=m2)
        if HAS_S:
            s = tl.load(s_ptr + row_off + offs[None, :], mask=m2, other=0.0)
            logqs = s - lse_s[:, None]
            qs = tl.exp(logqs)
            if S_FULL:
                ps = q
                logps = logq
            else:
                ps = tl.broadcast_to(p, (KP, BLOCK))
                logps = tl.broadcast_to(logp, (KP, BLOCK))
            kl_s += tl.sum(tl.where(m2, ps * (logps - logqs), 0.0), 1)
            ds = (coef * w)[:, None] * (qs - ps)
            tl.store(ds_ptr + row_off + offs[None, :], ds.to(ds_ptr.dtype.element_ty), mask=m2)
            cnt_f += tl.sum((m2 & (s > s_full[:, None])).to(tl.int32), 1)
            cnt_t += tl.sum((m2 & (s > s_tgt[:, None])).to(tl.int32), 1)
    tl.store(kl_ptr + rows, kl, mask=kmask)
    tl.store(am_ptr + rows, best_zi, mask=kmask)
    tl.store(tam_ptr + pid + tl.arange(0, 1), best_ti)
    if HAS_S:
        tl.store(kls_ptr + rows, kl_s, mask=kmask)
        tl.store(fhit_ptr + rows, (cnt_f < topk).to(tl.int8), mask=kmask)
        tl.store(thit_ptr + rows, (cnt_t < topk).to(tl.int8), mask=kmask)


def row_pass_triton(z: Tensor, zt: Tensor, s: Tensor | None, w: Tensor, k: int, topk: int, coef: float,
                    scorer_full: bool, out_dtype: torch.dtype, outs: RowOutputs, rows: slice
                    ) -> tuple[Tensor, Tensor | None]:
    """Same contract as ``loss_rows.row_pass_torch`` (CUDA tensors, contiguous)."""
    p_n, v = zt.shape
    assert z.is_contiguous() and zt.is_contiguous() and (s is None or s.is_contiguous())
    dz = torch.empty(p_n * k, v, dtype=out_dtype, device=z.device)
    ds = torch.empty_like(dz) if s is not None else None
    kl = torch.empty(p_n, k, dtype=torch.float32, device=z.device)
    am = torch.empty(p_n, k, dtype=torch.long, device=z.device)
    tam = torch.empty(p_n, dtype=torch.long, device=z.device)
    kls = torch.empty_like(kl) if s is not None else kl
    fhit = torch.empty(p_n, k, dtype=torch.int8, device=z.device) if s is not None else am
    thit = torch.empty_like(fhit) if s is not None else am
    _head_rows_kernel[(p_n,)](
        z, zt, s if s is not None else z, w.contiguous(), dz, ds if ds is not None else dz, kl, am, tam, kls,
        fhit, thit, v, k, topk, coef, HAS_S=s is not None, S_FULL=scorer_full,
        KP=triton.next_power_of_2(k), BLOCK=BLOCK_V, num_warps=8)
    outs.kl[rows], outs.argmax[rows], outs.target_argmax[rows] = kl, am, tam
    if s is not None:
        outs.scorer_kl[rows], outs.full_in_topk[rows], outs.target_in_topk[rows] = kls, fhit.bool(), thit.bool()
    return dz, ds
