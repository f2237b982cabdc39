"""The drafter's LM head and its forward-KL loss over ALL TTT steps in one fused, chunked pass.

No [N, V] tensor is ever whole -- neither the drafter's logits nor the target's probabilities.
The teacher is kept as what the target's own LM head consumes (``TeacherHead``: post-norm last
hidden state + head weight), and each chunk's target distribution is computed inside the loop.

Layout. The K TTT steps are stacked by TARGET position: ``states[n, k]`` is the drafter state of
step k that is scored against the target distribution at flattened position n (= b*T + p; step k
at sequence position t is scored at p = t + k + 1, see ``torchspec/train/ttt.py``). A chunk of P
positions therefore holds P teacher rows and P*K drafter rows, and the teacher logits of a
position are computed ONCE for all K steps (not K times).

Per chunk (z: drafter logits, zt: teacher logits, s: the low-rank scorer's scores):

    zt = teacher_hidden[P] @ Wt^T (+ bias)          [P, V]      bf16 operands, fp32 output
    z  = states[P, K] @ W^T                         [P*K, V]
    s  = (states @ down^T) @ up^T                   [P*K, V]    efficient head only
    row pass (two Triton kernels on CUDA, torch elsewhere): lse of zt / z / s, argmaxes,
         KL_i = sum_v p (log p - log q),   dz = w_i (q - p),   ds = c w_i (q_s - p_s)
    grad_states[P, K] = dz @ W;   grad_W += dz^T @ states   (fp32, accumulated in place)
    grad_up += ds^T @ a;  grad_down += (ds @ up)^T @ states  (a = states @ down^T)

so the head's weight gradient is one fp32 [V, H] buffer written by the GEMM's epilogue (beta=1),
never a per-chunk temporary. Chunks hold ``chunk_positions`` positions (``auto_chunk_positions``
sizes them from a memory budget). The scorer (EAGLE-4's efficient head) is distilled from the
target distribution (``scorer_teacher="target"``) or the drafter's own full head ("full"); its
input state is detached by construction (its gradient reaches only down/up). Its top-k recall
is counted in the same pass: the full-head argmax is a candidate iff fewer than k scores exceed
its score (ties count as hits).

``backend``: "triton" (CUDA) or "torch" (the reference; CPU, CI). Both compute the same function.

``head_loss="candidates"`` (``drafter.head_loss``, under evaluation) trains W only at the tokens an
efficient head can propose, the scorer's top-k joined to the target's top-m, renormalised there:
the same loop, with ``torchspec.train.loss_candidates.candidate_rows`` in place of the dense z, its
row pass and its GEMMs (its module docstring has the definition and the FLOP count).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from torchspec.train import loss_candidates, loss_rows
from torchspec.train.loss_rows import addmm_f32_, mm_f32


@dataclass
class TeacherHead:
    """The target distribution, as the target's LM head sees it: softmax(hidden @ weight^T + bias).

    hidden [B, T, Ht] (post-norm last hidden), weight [V', Ht] (the rows the drafter is scored on:
    the full vocabulary for EAGLE-4, the draft vocabulary for EAGLE-3), bias [V'] or None.
    ``argmax`` [B, T]: the target's argmax over its FULL vocabulary (accuracy is measured there);
    None means ``weight`` is the full head and the loss pass computes it.
    """

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None = None
    argmax: Tensor | None = None

    @classmethod
    def from_logits(cls, logits: Tensor) -> TeacherHead:
        """Teacher from explicit logits [B, T, V] (identity head: for tests and tiny vocabularies)."""
        return cls(hidden=logits, weight=torch.eye(logits.shape[-1], dtype=logits.dtype, device=logits.device))

    def restricted(self, vocab_ids: Tensor, chunk_rows: int = 1024) -> TeacherHead:
        """The teacher over a sub-vocabulary ``vocab_ids`` [V'] (EAGLE-3's draft vocabulary: the loss
        then renormalises inside it), keeping the argmax over the full vocabulary."""
        argmax = self.argmax if self.argmax is not None else self.full_argmax(chunk_rows)
        bias = None if self.bias is None else self.bias.index_select(0, vocab_ids)
        return TeacherHead(self.hidden, self.weight.index_select(0, vocab_ids), bias, argmax)

    @torch.no_grad()
    def full_argmax(self, chunk_rows: int = 1024) -> Tensor:
        """[B, T] argmax of the teacher logits, chunked over positions (never [N, V] whole)."""
        flat = self.hidden.reshape(-1, self.hidden.shape[-1])
        weight_t = self.weight.to(flat.dtype).T  # cast once, not per chunk
        bias = None if self.bias is None else self.bias.float()
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for start in range(0, flat.shape[0], chunk_rows):
            zt = mm_f32(flat[start : start + chunk_rows], weight_t)
            out[start : start + chunk_rows] = (zt if bias is None else zt + bias).argmax(-1)
        return out.view(self.hidden.shape[:-1])


@dataclass
class HeadLossOutput:
    """Per-(position, step) results; rows of weight 0 hold values that must be masked out. Under
    ``head_loss="candidates"`` (``loss_candidates``) ``kl`` is the KL over the candidates, ``argmax``
    the served proposal (best of the scorer's top-k by the full head) and ``full_in_topk`` all True."""

    loss: Tensor  # scalar: sum w * KL (+ coef * sum w * KL_scorer)
    kl: Tensor  # [N, K] fp32 forward KL(target || drafter)
    argmax: Tensor  # [N, K] drafter argmax (draft-vocabulary ids)
    target_argmax: Tensor  # [N] teacher argmax over the full vocabulary
    scorer_kl: Tensor | None = None  # [N, K] the scorer's KL(teacher || softmax(s)) over V
    full_in_topk: Tensor | None = None  # [N, K] bool: argmax is a scorer top-k candidate
    target_in_topk: Tensor | None = None  # [N, K] bool: target_argmax is one


def chunk_bytes(positions: int, vocab: int, steps: int, scorer: bool, dtype: torch.dtype,
                candidates: int = 0, hidden: int = 0) -> int:
    """Transient bytes of one chunk: fp32 z (and s) [P*K, V], fp32 zt [P, V], dz (and ds) in dtype;
    ``candidates`` > 0: the candidate loss's (``loss_candidates.candidate_bytes``, width ``hidden``)."""
    if candidates:
        return positions * loss_candidates.candidate_bytes(vocab, steps, candidates, hidden, dtype)
    per_row = 4 + torch.finfo(dtype).bits // 8
    return positions * vocab * (4 + steps * per_row * (2 if scorer else 1))


def auto_chunk_positions(vocab: int, steps: int, scorer: bool, dtype: torch.dtype, budget_gib: float,
                         candidates: int = 0, hidden: int = 0) -> int:
    """The most positions per chunk whose transient tensors fit ``budget_gib``."""
    return max(1, int(budget_gib * 2**30) // chunk_bytes(1, vocab, steps, scorer, dtype, candidates, hidden))


def check_chunk_fits(positions: int, vocab: int, steps: int, scorer: bool, dtype: torch.dtype,
                     device: torch.device, candidates: int = 0, hidden: int = 0) -> None:
    """On CUDA, refuse a chunk that cannot fit the free memory, naming the largest that fits.
    Checked once per chunk shape (the first micro-batch), not on every step."""
    key = (positions, vocab, steps, scorer, dtype, device, candidates, hidden)
    if device.type != "cuda" or key in _checked:
        return
    free, _ = torch.cuda.mem_get_info(device)
    one = chunk_bytes(1, vocab, steps, scorer, dtype, candidates, hidden)
    need = positions * one
    if need > free:
        fits = free / one
        raise ValueError(
            f"train.loss_chunk_gib: a loss chunk of {positions} positions needs {need / 2**30:.1f} GiB but "
            f"{free / 2**30:.1f} GiB are free on {device}; the largest that fits is {int(fits)} positions "
            f"(~{fits * one / 2**30:.1f} GiB): lower train.loss_chunk_gib.")
    _checked.add(key)


_warned: set[str] = set()
_checked: set[tuple] = set()


def resolve_backend(backend: str, device: torch.device, steps: int) -> str:
    """"auto" -> "triton" on CUDA when Triton is importable and the shape is supported, else "torch"."""
    if backend == "torch":
        return backend
    reason = loss_rows.triton_unsupported(device, steps)
    if reason is None:
        return "triton"
    if backend == "triton" or device.type == "cuda":
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"fused head loss: {reason}; using the torch reference path.", stacklevel=3)
    return "torch"


class FusedTTTHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, states, weight, down, up, t_hidden, t_weight, t_bias, token_weights, chunk,
                compute_dtype, topk, target_topk, scorer_coef, scorer_full, backend, grad_on):
        """states [N, K, H], weight [V', H], down [r, H] / up [V', r] or None, t_hidden [N, Ht],
        t_weight [V', Ht], t_bias [V'] or None, token_weights [N, K] fp32; target_topk: None for
        the full loss, else m of the candidate loss (``loss_candidates``; needs the scorer); grad_on:
        whether the caller's grad mode is on (the gradients are computed here, in the forward, only
        then). Returns the tuple of ``HeadLossOutput`` fields (loss first)."""
        n, k, h = states.shape
        v = weight.shape[0]
        dev = states.device
        scorer = down is not None
        x = states.to(compute_dtype)
        w_c, tw_c = weight.to(compute_dtype), t_weight.to(compute_dtype)
        th = t_hidden.to(compute_dtype)
        d_c, u_c = (down.to(compute_dtype), up.to(compute_dtype)) if scorer else (None, None)
        need_x, need_w = grad_on and ctx.needs_input_grad[0], grad_on and ctx.needs_input_grad[1]
        need_s = grad_on and scorer and (ctx.needs_input_grad[2] or ctx.needs_input_grad[3])
        acc = token_weights.dtype  # fp32 (fp64 when everything is fp64: the tests' reference)
        grad_x = torch.empty(n, k, h, dtype=acc, device=dev) if need_x else None
        grad_w = torch.zeros(v, h, dtype=acc, device=dev) if need_w else None
        grad_down = torch.zeros(down.shape, dtype=acc, device=dev) if need_s else None
        grad_up = torch.zeros(up.shape, dtype=acc, device=dev) if need_s else None
        outs = loss_rows.RowOutputs.empty(n, k, scorer, acc, dev)
        rows_fn = loss_rows.ROW_BACKENDS[backend]
        for p0 in range(0, n, chunk):
            p1 = min(p0 + chunk, n)
            xc = x[p0:p1].reshape(-1, h)  # [P*K, H]
            zt = mm_f32(th[p0:p1], tw_c.T)  # [P, V]
            if t_bias is not None:
                zt += t_bias.to(zt.dtype)
            a = xc @ d_c.T if scorer else None  # [P*K, r]
            s = mm_f32(a, u_c.T) if scorer else None  # [P*K, V]
            if target_topk is not None:  # W at the candidates only; writes its gradients itself
                ds = loss_candidates.candidate_rows(xc, zt, s, w_c, token_weights[p0:p1], k, topk, target_topk,
                                                    scorer_coef, outs, slice(p0, p1), grad_x, grad_w, need_s)
                del zt, s
            else:
                z = mm_f32(xc, w_c.T)  # [P*K, V]
                dz, ds = rows_fn(z, zt, s, token_weights[p0:p1], k, topk, scorer_coef, scorer_full,
                                 compute_dtype, outs, slice(p0, p1), grads=need_x or need_w or need_s)
                del z, zt, s
                if need_x:
                    grad_x[p0:p1] = mm_f32(dz, w_c).view(p1 - p0, k, h)
                if need_w:
                    addmm_f32_(grad_w, dz.T, xc)
            if need_s:
                addmm_f32_(grad_up, ds.T, a)
                addmm_f32_(grad_down, (ds @ u_c).T, xc)
        loss = (outs.kl * token_weights).sum()
        if scorer:
            loss = loss + scorer_coef * (outs.scorer_kl * token_weights).sum()
        ctx.dtypes = (states.dtype, weight.dtype, None if down is None else down.dtype, None if up is None else up.dtype)
        ctx.save_for_backward(grad_x, grad_w, grad_down, grad_up)
        extra = outs.tensors()
        ctx.mark_non_differentiable(*extra)
        return (loss, *extra)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grads = []
        for g, dtype in zip(ctx.saved_tensors, ctx.dtypes):
            grads.append(None if g is None else g.mul_(grad_loss).to(dtype))
        gx, gw, gd, gu = grads
        return gx, gw, gd, gu, *([None] * 12)


def fused_ttt_head_loss(states: Tensor, weight: Tensor, teacher: TeacherHead, token_weights: Tensor,
                        scorer: tuple[Tensor, Tensor] | None = None, topk: int = 128,
                        scorer_coef: float = 1.0, scorer_teacher: str = "target",
                        chunk_positions: int | None = None, chunk_gib: float = 4.0,
                        backend: str = "auto", head_loss: str = "full", target_topk: int = 128) -> HeadLossOutput:
    """See the module docstring. states [N, K, H] (any float dtype; the matmuls run in the autocast
    dtype if autocast is on, else in states' dtype), weight [V', H], teacher over the same V' rows
    with hidden [N, Ht] flattened, token_weights [N, K] (0 = not scored). ``head_loss``: "full"
    (KL over all of V) or "candidates" (KL over the scorer's top-``topk`` and the target's
    top-``target_topk``, ``torchspec.train.loss_candidates``: needs ``scorer`` and the "target"
    scorer teacher; its row work runs in torch whatever ``backend`` says)."""
    if scorer_teacher not in ("target", "full"):
        raise ValueError(f"scorer_teacher={scorer_teacher!r}: use 'target' or 'full'.")
    if head_loss not in ("full", "candidates"):
        raise ValueError(f"head_loss={head_loss!r}: use 'full' or 'candidates'.")
    candidates = head_loss == "candidates"
    if candidates and (scorer is None or scorer_teacher != "target"):
        raise ValueError("head_loss='candidates' needs the efficient head's scorer and scorer_teacher='target' "
                         "(the 'full' teacher is the full head over all of V, the cost it removes).")
    dev = states.device
    dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else states.dtype
    n, k, _ = states.shape
    v = weight.shape[0]
    assert teacher.weight.shape[0] == v, f"teacher rows {teacher.weight.shape[0]} != head rows {v}"
    sizes = (topk + min(target_topk, v), states.shape[-1]) if candidates else (0, 0)  # |C| <= k + m, H
    if chunk_positions is None:
        chunk_positions = auto_chunk_positions(v, k, scorer is not None, dtype, chunk_gib, *sizes)
    check_chunk_fits(min(chunk_positions, n), v, k, scorer is not None, dtype, dev, *sizes)
    down, up = scorer if scorer is not None else (None, None)
    t_hidden = teacher.hidden.reshape(n, -1)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    keep = scored_positions(token_weights) if dev.type == "cpu" else None
    if keep is not None:  # CPU: skip the positions no step scores (a host sync is free here)
        states, t_hidden, token_weights = states[keep], t_hidden[keep], token_weights[keep]
    with torch.autocast(dev.type, enabled=False):
        out = FusedTTTHeadLoss.apply(
            states, weight, down, up, t_hidden, teacher.weight, teacher.bias, token_weights.to(acc),
            min(chunk_positions, states.shape[0]), dtype, topk, target_topk if candidates else None, float(scorer_coef),
            scorer_teacher == "full", "torch" if candidates else resolve_backend(backend, dev, k), torch.is_grad_enabled())
    loss, *rest = out
    if keep is not None:
        rest = [spread(x, keep, n) for x in rest]
    kl, argmax, t_argmax, *scorer_out = rest
    if teacher.argmax is not None:
        t_argmax = teacher.argmax.reshape(n)
    return HeadLossOutput(loss, kl, argmax, t_argmax, *scorer_out)


def scored_positions(token_weights: Tensor) -> Tensor | None:
    """Ids of the positions with any scored step ([N, K] weights); None when that is all of them.
    Keeps one position of an all-masked batch, so every parameter still gets its (zero) gradient."""
    keep = (token_weights > 0).any(-1).nonzero().squeeze(-1)
    if len(keep) == len(token_weights):
        return None
    return keep if len(keep) else keep.new_zeros(1)


def spread(x: Tensor, keep: Tensor, n: int) -> Tensor:
    """Rows of ``x`` at positions ``keep`` -> [n, ...] (zeros / False elsewhere: never scored)."""
    out = x.new_zeros((n, *x.shape[1:]))
    out[keep] = x
    return out
