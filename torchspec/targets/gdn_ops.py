"""Gated DeltaNet's two stateful ops in pure torch (CPU + CUDA), and the fla dispatch of capture.

The math is `torchspec.attend.RecurrentMix`'s (read its docstring): a depthwise causal
convolution with SiLU over the q|k|v channels, and the gated delta rule

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

with S [H, Dk, Dv] per row. Three forms of the recurrence, all fp32 inside:

    delta_rule_step      one token (serving: a tree node continues from its parent's state)
    delta_rule_chunked   chunks of 64 tokens in the WY / UT-transform form (fla's algorithm, torch
                         ops): intra-chunk a lower-triangular solve, inter-chunk one state matmul;
                         equal to stepping token by token (tests/unit/test_gdn_ops.py)
    delta_rule           capture's dispatcher: fla's Triton kernel on CUDA when importable, else
                         the chunked reference (``TORCHSPEC_GDN_REFERENCE=1`` or ``USE_REFERENCE``
                         forces the reference)

Document starts (``starts [B, T]`` bool, True at a document's first token) reset both the conv
history and the recurrent state, so a packed row computes every document as if it were alone.
In the torch forms a start is a decay of exactly zero (``exp(g) -> 0``), written as masks on the
decay matrices, so nothing branches on data and nothing syncs with the host. fla's varlen path
needs ``cu_seqlens`` (a host sync when packed); capture is not graph-captured, so that is fine.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

# Force the torch reference even on CUDA with fla installed (parity runs, debugging).
USE_REFERENCE: bool = os.environ.get("TORCHSPEC_GDN_REFERENCE", "0") not in ("", "0", "false", "False")


def causal_conv(x: Tensor, weight: Tensor, history: Tensor | None = None, starts: Tensor | None = None) -> Tensor:
    """SiLU(depthwise causal conv): ``x [B, T, C]``, ``weight [C, K]`` -> ``[B, T, C]`` in x's dtype.

    ``y_t = silu(sum_j weight[:, j] * x_{t - (K - 1) + j})``, i.e. ``weight[:, K - 1]`` scales the current
    token (torch's ``conv1d`` with ``padding=K - 1``, which is how HF applies the layer's ``conv1d``).
    ``history [B, C, K - 1]``: the K - 1 inputs before x, oldest first (zeros when None).
    ``starts [B, T]``: True where a document starts; inputs before it count as zeros.
    """
    b, t, c = x.shape
    k = weight.shape[-1]
    if history is None:
        history = x.new_zeros(b, c, k - 1)
    ext = torch.cat((history.transpose(1, 2).float(), x.float()), dim=1)  # [B, K - 1 + T, C]
    w = weight.float()
    pos = torch.arange(t, device=x.device)
    if starts is not None:
        # first[b, t]: the position of the latest start at or before t (-K when none: history is valid)
        first = torch.where(starts, pos, torch.full_like(pos, -k)).cummax(dim=1).values  # [B, T]
    y = x.new_zeros(b, t, c, dtype=torch.float32)
    for lag in range(k):  # K is a shape: a fixed, data-independent loop
        term = ext[:, k - 1 - lag: k - 1 - lag + t] * w[:, k - 1 - lag]  # input at t - lag, its tap
        if starts is not None:
            term = term * (pos - lag >= first)[..., None]
        y = y + term
    return F.silu(y).to(x.dtype)


def delta_rule_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """One token: ``state [B, H, Dk, Dv]`` fp32, q/k ``[B, H, Dk]``, v ``[B, H, Dv]``, g/beta ``[B, H]``
    -> ``(o [B, H, Dv] in v's dtype, new_state [B, H, Dk, Dv] fp32)``."""
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    s = state.float() * g.exp()[..., None, None]
    delta = (v - (s * k[..., None]).sum(-2)) * beta[..., None]  # v_t - exp(g_t) S^T k_t, times beta  [B, H, Dv]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2).to(out_dtype), s


def delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    starts: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """The chunked form: q/k ``[B, T, H, Dk]``, v ``[B, T, H, Dv]``, g/beta ``[B, T, H]``
    -> ``(o [B, T, H, Dv] in v's dtype, final_state [B, H, Dk, Dv] fp32)``.

    ``initial_state [B, H, Dk, Dv]`` (zeros when None); ``starts [B, T]`` resets the state before
    each True position (so a start at t = 0 ignores ``initial_state``).

    Within a chunk (positions i, j; D(i, j) the decay from j to i, zero across a start; D(i, 0) the
    decay of the incoming state S0): the corrected values u solve ``(I + A) u = beta v - beta D(., 0) K S0``
    with ``A[i, j] = beta_i D(i, j) k_i.k_j`` strictly lower; then ``o_i = D(i, 0) S0^T q_i +
    sum_{j <= i} D(i, j) (q_i.k_j) u_j`` and the outgoing state is ``S_{last}`` of the same sum.
    """
    out_dtype = v.dtype
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    chunk_size = max(1, min(chunk_size, t))  # a short sequence is one chunk of its own length, not padded
    n = -(-t // chunk_size)
    pad = n * chunk_size - t
    if starts is None:
        starts = torch.zeros(b, t, dtype=torch.bool, device=q.device)
    # Padding at the end: k = v = beta = g = 0 leaves the state unchanged and earlier outputs alone.
    q, k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float(), (0, 0, 0, pad)) for x in (g, beta))
    starts = F.pad(starts, (0, pad))

    def chunks(x: Tensor) -> Tensor:  # [B, Tp, H, ...] -> [B, H, N, C, ...]
        return x.unflatten(1, (n, chunk_size)).movedim(3, 1)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))  # q/k/v [B, H, N, C, D], g/beta [B, H, N, C]
    doc = starts.long().cumsum(1).unflatten(1, (n, chunk_size))[:, None]  # [B, 1, N, C] document index
    doc_in = doc[..., :1] - starts.unflatten(1, (n, chunk_size))[:, None, :, :1].long()  # before each chunk
    g = g.cumsum(-1)  # log decay from the chunk start, inclusive  [B, H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    same = (doc[..., :, None] == doc[..., None, :]) & causal  # [B, 1, N, C, C]
    # Mask before exp: across a start the difference may be large and positive.
    decay = torch.where(same, g[..., :, None] - g[..., None, :], -torch.inf).exp()  # D(i, j)  [B, H, N, C, C]
    decay_in = torch.where(doc == doc_in, g, -torch.inf).exp()  # D(i, 0)  [B, H, N, C]

    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    eye = torch.eye(chunk_size, device=q.device)
    lower = (k_beta @ k.transpose(-1, -2)) * decay * (~eye.bool())  # A, strictly lower  [B, H, N, C, C]
    solve = torch.linalg.solve_triangular(lower + eye, eye.expand_as(lower), upper=False, unitriangular=True)
    u_v = solve @ v_beta  # the part of u that does not depend on S0  [B, H, N, C, Dv]
    u_s = solve @ (k_beta * decay_in[..., None])  # u = u_v - u_s @ S0  [B, H, N, C, Dk]
    qk = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]
    decay_last = decay[..., -1, :]  # D(last, j)  [B, H, N, C]

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    o = []
    for i in range(n):  # n is a shape: a fixed loop over chunks
        u = u_v[:, :, i] - u_s[:, :, i] @ state  # [B, H, C, Dv]
        o.append((q[:, :, i] * decay_in[:, :, i, :, None]) @ state + qk[:, :, i] @ u)
        state = state * decay_in[:, :, i, -1, None, None] + (k[:, :, i] * decay_last[:, :, i, :, None]).transpose(-1, -2) @ u
    o = torch.stack(o, dim=2).flatten(2, 3)[:, :, :t].transpose(1, 2)  # [B, T, H, Dv]
    return o.to(out_dtype), state


VarlenPlan = tuple[Tensor, Tensor]  # (cu_seqlens [S + 1], sequence index of every flattened token [B * T])


def varlen_plan(starts: Tensor) -> VarlenPlan:
    """Packed rows [B, T] flattened into one row of variable-length sequences, cut at every row and
    document start: fla's ``cu_seqlens`` and each token's sequence index. One host sync (the count)."""
    b, t = starts.shape
    cut = starts.clone()
    cut[:, 0] = True  # every row begins a sequence of the flattened batch
    flat_cut = cut.flatten()
    begins = flat_cut.nonzero().flatten()  # host sync: the number of sequences
    return F.pad(begins, (0, 1), value=b * t), flat_cut.long().cumsum(0) - 1


@functools.cache
def _fla_chunk():
    """fla's chunk kernel, or None when fla is not installed (looked up once: `uses_fla` runs per layer)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def uses_fla(device: torch.device) -> bool:
    """Whether `delta_rule` runs fla's kernel for tensors on ``device``."""
    return device.type == "cuda" and not USE_REFERENCE and _fla_chunk() is not None


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    starts: Tensor | None = None,
    plan: VarlenPlan | None = None,
) -> tuple[Tensor, Tensor]:
    """`delta_rule_chunked`'s contract, run by fla on CUDA (when importable) else by the reference.

    ``plan``: `varlen_plan(starts)`, computed once per forward by the caller (its one host sync)
    instead of once per layer.

    fla: q/k already L2-normalised and q pre-scaled, so ``use_qk_l2norm_in_kernel=False, scale=1.0``;
    g in natural-log space (fla's default). Packed rows (any start after t = 0) are flattened to one
    row of variable-length sequences cut at every row and document start (``cu_seqlens``).
    """
    if not uses_fla(q.device):
        return delta_rule_chunked(q, k, v, g, beta, initial_state, starts)
    chunk = _fla_chunk()
    b, t, h, _ = k.shape
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g.float(), beta))
    if initial_state is not None:
        initial_state = initial_state.float()
    if starts is None:
        o, final = chunk(q, k, v, g, beta, scale=1.0, initial_state=initial_state, output_final_state=True,
                         use_qk_l2norm_in_kernel=False)
        return o, final.float()
    cu_seqlens, seq_of = plan if plan is not None else varlen_plan(starts)
    init = None
    if initial_state is not None:
        # A row's first sequence continues initial_state unless the row itself starts a document.
        init = initial_state.new_zeros(len(cu_seqlens) - 1, *initial_state.shape[1:]).float()
        keep = (~starts[:, 0]).float()[:, None, None, None]
        init[seq_of.view(b, t)[:, 0]] = initial_state.float() * keep
    o, final = chunk(*(x.flatten(0, 1)[None] for x in (q, k, v, g, beta)), scale=1.0, initial_state=init,
                     output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens)
    return o.view(b, t, *o.shape[2:]), final[seq_of.view(b, t)[:, -1]].float()


__all__ = ["USE_REFERENCE", "VarlenPlan", "causal_conv", "delta_rule", "delta_rule_chunked", "delta_rule_step",
           "uses_fla", "varlen_plan"]
