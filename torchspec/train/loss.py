"""Fused LM head + soft cross-entropy, chunked over tokens: the drafter's [N, V] logits are never
materialised whole, and their gradient is produced in the same pass.

For rows i (tokens) with drafter state h_i, head W [V, H], target probabilities p_i and per-token
weights w_i (0 for masked tokens; decay**k / global count otherwise):

    loss = sum_i w_i * CE_i,   CE_i = -sum_v p_iv log softmax(W h_i)_v
    dloss/dz_i = w_i * (softmax(z_i) - p_i)          (sum_v p_iv = 1)

KL(p || q) = CE - entropy(p), so the gradient is that of the forward KL; the entropy is added
back for the reported KL. With a vocabulary of 248K and 4K-token sequences the logits of one
TTT step would be 4 GB in fp32; chunks of ``chunk_elems`` logits keep it to a few hundred MB,
and computing the gradients during the forward avoids a second pass over the vocabulary
(the approach of fused linear cross-entropy kernels such as Liger's).
"""

from __future__ import annotations

import torch


class FusedLinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target_probs, token_weights, compute_dtype, chunk_rows):
        """hidden [B, N, H], weight [V, H], target_probs [B, N, V] fp32 (each [b] a contiguous
        block of rows; the tensor may be a slice of a longer [B, T, V]), token_weights [B, N] fp32.

        Returns (weighted loss scalar, CE per token [B, N] fp32, draft argmax [B, N]).
        """
        b, n, _ = hidden.shape
        h_c = hidden.to(compute_dtype)
        w_c = weight.to(compute_dtype)
        ce = torch.empty(b, n, dtype=torch.float32, device=hidden.device)
        argmax = torch.empty(b, n, dtype=torch.long, device=hidden.device)
        grad_h = torch.empty_like(hidden, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for i in range(b):
            for start in range(0, n, chunk_rows):
                rows = slice(start, min(start + chunk_rows, n))
                z = (h_c[i, rows] @ w_c.T).float()  # [c, V]
                argmax[i, rows] = z.argmax(-1)
                logq = torch.log_softmax(z, dim=-1)
                p = target_probs[i, rows]
                ce[i, rows] = -torch.linalg.vecdot(p, logq)
                if grad_h is None and grad_w is None:
                    continue
                dz = logq.exp_().sub_(p).mul_(token_weights[i, rows, None]).to(compute_dtype)  # [c, V]
                if grad_h is not None:
                    grad_h[i, rows] = (dz @ w_c).float()
                if grad_w is not None:
                    grad_w.add_((dz.T @ h_c[i, rows]).float())
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(ce, argmax)
        loss = (ce * token_weights).sum()
        return loss, ce, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_argmax):
        grad_h, grad_w = ctx.saved_tensors
        gh = (grad_h * grad_loss).to(ctx.hidden_dtype) if grad_h is not None else None
        gw = (grad_w * grad_loss).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None


def fused_linear_soft_ce(hidden: torch.Tensor, weight: torch.Tensor, target_probs: torch.Tensor,
                         token_weights: torch.Tensor, chunk_elems: int = 1 << 24):
    """See module docstring. hidden [N, H] in any dtype; the matmuls run in the autocast dtype if
    autocast is on, else in hidden's dtype; softmax and CE always in fp32."""
    dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype
    chunk_rows = max(1, chunk_elems // weight.shape[0])
    with torch.autocast(hidden.device.type, enabled=False):
        loss, ce, argmax = FusedLinearSoftCE.apply(hidden, weight, target_probs, token_weights.float(), dtype, chunk_rows)
    return loss, ce, argmax
