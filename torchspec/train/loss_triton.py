"""The fused head loss's row pass as Triton kernels (CUDA); ``loss_rows.row_pass_torch`` is its
reference and states the math.

A program owns one position p and one slice of the vocabulary (a "split"): a [KP, BLOCK] tile holds
the K student rows of p (KP = K rounded up to a power of two) and one teacher row, so the teacher
row is read once for all K steps. Splitting V gives P * S programs instead of P (a chunk of ~300
positions would leave most of the GPU's 132 SMs waiting on a tail of long programs).

    stats kernel  (grid P x S): per split, running max / sum-exp of zt, z (and s), argmax of zt and z
    combine       (torch, [P, K, S] tensors): log-sum-exps and argmaxes over the splits
    grad kernel   (grid P x S): p = exp(zt - lse_t), q = exp(z - lse_z): KL partial sums,
                  dz = w (q - p) stored in the output dtype; scorer: q_s, its KL, ds = c w (q_s - p_s),
                  and the rank counts #{v : s_v > s_a} for a = the drafter / teacher argmax
    combine       (torch): sums over the splits

Bytes per position: V * (4 + K * 4 [+ K * 4]) read twice; V * K * 2 [* 2] written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchspec.train.loss_rows import RowOutputs

BLOCK_V = 256  # measured on the H200: 256 beats 512, 1024 and 2048 (fewer registers per thread)
TARGET_PROGRAMS = 4096  # enough programs per launch to fill the SMs several times over


@triton.jit
def _stats_kernel(z_ptr, zt_ptr, s_ptr, mt_ptr, lt_ptr, bt_ptr, bti_ptr, mz_ptr, lz_ptr, bz_ptr, bzi_ptr,
                  ms_ptr, ls_ptr, V, K, SPLIT, S,
                  HAS_S: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    ks = tl.arange(0, KP)
    kmask = ks < K
    row_off = (pid * K + ks)[:, None] * V  # [KP, 1]
    t_off = pid * V
    neg_inf = float("-inf")
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
    lo = j * SPLIT
    hi = tl.minimum(lo + SPLIT, V)
    for v0 in range(lo, hi, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        vmask = offs < hi
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
    one = tl.arange(0, 1)
    tl.store(mt_ptr + pid * S + j + one, m_t)
    tl.store(lt_ptr + pid * S + j + one, l_t)
    tl.store(bt_ptr + pid * S + j + one, best_t)
    tl.store(bti_ptr + pid * S + j + one, best_ti)
    out = (pid * K + ks) * S + j  # [P, K, S] layout
    tl.store(mz_ptr + out, m_z, mask=kmask)
    tl.store(lz_ptr + out, l_z, mask=kmask)
    tl.store(bz_ptr + out, best_z, mask=kmask)
    tl.store(bzi_ptr + out, best_zi, mask=kmask)
    if HAS_S:
        tl.store(ms_ptr + out, m_s, mask=kmask)
        tl.store(ls_ptr + out, l_s, mask=kmask)


@triton.jit
def _grad_kernel(z_ptr, zt_ptr, s_ptr, w_ptr, lse_t_ptr, lse_z_ptr, lse_s_ptr, sf_ptr, st_ptr, dz_ptr, ds_ptr,
                 kl_ptr, kls_ptr, cf_ptr, ct_ptr, V, K, SPLIT, S, coef,
                 HAS_S: tl.constexpr, S_FULL: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    ks = tl.arange(0, KP)
    kmask = ks < K
    rows = pid * K + ks
    row_off = rows[:, None] * V
    t_off = pid * V
    lse_t = tl.load(lse_t_ptr + pid + tl.arange(0, 1))  # [1]
    lse_z = tl.load(lse_z_ptr + rows, mask=kmask, other=0.0)
    w = tl.load(w_ptr + rows, mask=kmask, other=0.0)
    kl = tl.zeros((KP,), tl.float32)
    kl_s = tl.zeros((KP,), tl.float32)
    cnt_f = tl.zeros((KP,), tl.int32)
    cnt_t = tl.zeros((KP,), tl.int32)
    if HAS_S:
        lse_s = tl.load(lse_s_ptr + rows, mask=kmask, other=0.0)
        s_full = tl.load(sf_ptr + rows, mask=kmask, other=0.0)
        s_tgt = tl.load(st_ptr + rows, mask=kmask, other=0.0)
    lo = j * SPLIT
    hi = tl.minimum(lo + SPLIT, V)
    for v0 in range(lo, hi, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        vmask = offs < hi
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
    out = rows * S + j
    tl.store(kl_ptr + out, kl, mask=kmask)
    if HAS_S:
        tl.store(kls_ptr + out, kl_s, mask=kmask)
        tl.store(cf_ptr + out, cnt_f, mask=kmask)
        tl.store(ct_ptr + out, cnt_t, mask=kmask)


def _lse(m: Tensor, sum_exp: Tensor) -> Tensor:
    """Combine per-split (max, sum-exp) [..., S] into log-sum-exp [...]."""
    top = m.max(-1).values
    return top + torch.log((sum_exp * torch.exp(m - top[..., None])).sum(-1))


def _argmax(best: Tensor, idx: Tensor) -> Tensor:
    """Per-split (max value, its first index) [..., S] -> the global first argmax [...]."""
    return idx.gather(-1, best.argmax(-1, keepdim=True)).squeeze(-1)  # first maximal split = lowest ids


def row_pass_triton(z: Tensor, zt: Tensor, s: Tensor | None, w: Tensor, k: int, topk: int, coef: float,
                    scorer_full: bool, out_dtype: torch.dtype, outs: RowOutputs, rows: slice,
                    grads: bool = True, splits: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Same contract as ``loss_rows.row_pass_torch`` (CUDA tensors, contiguous; the logit
    gradients are written even when not ``grads``: evaluation cost on the GPU is small)."""
    p_n, v = zt.shape
    assert z.is_contiguous() and zt.is_contiguous() and (s is None or s.is_contiguous())
    dev, f32 = z.device, torch.float32
    if splits is None:
        splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, p_n), triton.cdiv(v, BLOCK_V)))
    split = triton.cdiv(triton.cdiv(v, splits), BLOCK_V) * BLOCK_V
    n_s = triton.cdiv(v, split)  # every split holds at least one id
    kp, has_s = triton.next_power_of_2(k), s is not None
    s_arg = s if has_s else z
    part = lambda *shape, dtype=f32: torch.empty(*shape, n_s, dtype=dtype, device=dev)  # noqa: E731
    m_t, l_t, b_t, bi_t = part(p_n), part(p_n), part(p_n), part(p_n, dtype=torch.long)
    m_z, l_z, b_z, bi_z = part(p_n, k), part(p_n, k), part(p_n, k), part(p_n, k, dtype=torch.long)
    m_s, l_s = (part(p_n, k), part(p_n, k)) if has_s else (m_z, l_z)
    grid = (p_n, n_s)
    _stats_kernel[grid](z, zt, s_arg, m_t, l_t, b_t, bi_t, m_z, l_z, b_z, bi_z, m_s, l_s, v, k, split, n_s,
                        HAS_S=has_s, KP=kp, BLOCK=BLOCK_V, num_warps=8)
    lse_t, lse_z = _lse(m_t, l_t), _lse(m_z, l_z)  # [P], [P, K]
    t_argmax, argmax = _argmax(b_t, bi_t), _argmax(b_z, bi_z)
    lse_s = _lse(m_s, l_s) if has_s else lse_z
    row_base = torch.arange(p_n * k, device=dev).view(p_n, k) * v
    flat = s.view(-1) if has_s else None
    s_full = flat[row_base + argmax] if has_s else lse_z
    s_tgt = flat[row_base + t_argmax[:, None]] if has_s else lse_z
    dz = torch.empty(p_n * k, v, dtype=out_dtype, device=dev)
    ds = torch.empty_like(dz) if has_s else dz
    kl = part(p_n, k)
    kls, c_f, c_t = (part(p_n, k), part(p_n, k, dtype=torch.int32), part(p_n, k, dtype=torch.int32)) if has_s \
        else (kl, kl, kl)
    _grad_kernel[grid](z, zt, s_arg, w.contiguous(), lse_t, lse_z.contiguous(), lse_s.contiguous(),
                       s_full.contiguous(), s_tgt.contiguous(), dz, ds, kl, kls, c_f, c_t, v, k, split, n_s, coef,
                       HAS_S=has_s, S_FULL=scorer_full, KP=kp, BLOCK=BLOCK_V, num_warps=8)
    outs.kl[rows], outs.argmax[rows], outs.target_argmax[rows] = kl.sum(-1), argmax, t_argmax
    if has_s:
        outs.scorer_kl[rows] = kls.sum(-1)
        outs.full_in_topk[rows] = c_f.sum(-1) < topk
        outs.target_in_topk[rows] = c_t.sum(-1) < topk
    return dz, (ds if has_s else None)
