"""The warm start's fits: EAGLE-3's TTT unroll recorded as samples, and the reduced-rank regression that
gives EAGLE-4's eh_proj and q/k/v (the method: ``warm_start.py``'s docstring, "eh_proj and q/k/v").

* ``collect_eagle3_samples``: per TTT step, what EAGLE-3's layer read and produced on fit inputs.
* ``fit_attention_input``: targets ``[q3/s_q, k3/s_k, v3/s_v, sqrt(w) g/s_g]`` from EAGLE-4's eh_proj input,
  rank H, re-parametrised so the residual block decodes as the identity; q/k/v then re-solved by ridge
  least squares from the exact ``RMSNorm(z)``. Its errors come with those of the unconstrained (full-rank)
  fit of the same targets (``*_full_rank``): the gap between the two is what the width H costs.
* ``attention_fit_error``: the same relative errors on held-out samples, for an already converted drafter.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchspec.models.eagle3 import Eagle3Drafter
from torchspec.models.eagle4 import Eagle4Drafter
from torchspec.train.ttt import shift_left

# Ridge strength of the fits, relative to the mean input variance. Directions the samples barely
# visit (few distinct tokens, low-rank hidden states) must not get huge weights that training then
# meets off-distribution. Measured on the tiny target (tools/warm_start_experiment.py, H=64): ridge
# 1e-6 fits best (held-out q/k/v errors 0.24/0.19/0.36, acceptance 1.68 at step 0) but its
# ill-conditioned weights then train badly (1.68 after 150 steps, vs 1.95 from random init);
# 1e-3 starts at 1.55 and trains best (1.97); 1e-2 starts at 1.52.
RIDGE = 1e-3


# --- EAGLE-3 samples -----------------------------------------------------------------------------


@torch.no_grad()
def collect_eagle3_samples(e3: Eagle3Drafter, input_ids: Tensor, aux: list[Tensor],
                           attention_mask: Tensor | None = None, num_steps: int = 3) -> list[dict[str, Tensor]]:
    """Run EAGLE-3's TTT unroll (no loss) and record, per step k, what the layer saw and produced:
    ids [B, T] (input token), g [B, T, H] (incoming hidden = residual), a [B, T, 2H] (attention
    input), x [B, T, H] (layer output, pre-norm), mlp [B, T, H] (MLP output), valid [B, T]."""
    b, t = input_ids.shape
    real = attention_mask.bool() if attention_mask is not None else torch.ones(b, t, dtype=torch.bool)
    positions = torch.arange(t).expand(b, t)
    seen: dict[str, Tensor] = {}
    hooks = [e3.layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("a", i[0])),
             e3.layer.self_attn.register_forward_hook(lambda m, i, o: seen.__setitem__("attn", o)),
             e3.layer.mlp.register_forward_hook(lambda m, i, o: seen.__setitem__("mlp", o))]
    try:
        hidden, cache, steps = e3.fuse_target_states(aux), [], []
        for k in range(min(num_steps, t - 1)):
            ids = shift_left(input_ids, k + 1)
            valid = shift_left(real, k + 1, fill=False) & real
            g = hidden
            _, hidden = e3.step(ids, hidden, positions + k, e3.ttt_attend(kv=cache))
            x = g + seen["attn"] + seen["mlp"]  # the layer's output, summed in its own order (forward)
            steps.append({"ids": ids, "g": g, "a": seen["a"], "x": x, "mlp": seen["mlp"], "valid": valid})
    finally:
        for h in hooks:
            h.remove()
    return steps


def e4_attention_inputs(e4: Eagle4Drafter, steps: list[dict[str, Tensor]], aux: list[Tensor]) -> Tensor:
    """EAGLE-4's eh_proj input a' = cat(embed_norm(e), hidden_norm(g')) for the positions EAGLE-3
    saw, where g' is how EAGLE-4 represents EAGLE-3's hidden: its own fusion at step 0, and the
    feedback EAGLE-4 would produce from EAGLE-3's layer output (norm(x) or x) after that. -> [N, 2H]"""
    out = []
    for k, s in enumerate(steps):
        if k == 0:
            g4 = e4.fuse_target_states(aux)
        else:
            x = steps[k - 1]["x"]
            g4 = e4.norm(x) if e4.config.norm_output else x
        emb = e4.embed_tokens(s["ids"]).to(g4.dtype)
        out.append(torch.cat([e4.embed_norm(emb), e4.hidden_norm(g4)], -1)[s["valid"]])
    return torch.cat(out)


def flat_samples(steps: list[dict[str, Tensor]], key: str) -> Tensor:
    return torch.cat([s[key][s["valid"]] for s in steps])


@torch.no_grad()
def attention_fit_error(e3: Eagle3Drafter, e4: Eagle4Drafter, input_ids: Tensor, aux: list[Tensor],
                        attention_mask: Tensor | None = None, num_steps: int = 3) -> dict[str, float]:
    """Relative errors ||e4 - e3||_F / ||e3||_F of q, k, v (EAGLE-4's q/k/v(pre_attn_norm(eh_proj(a')))
    vs EAGLE-3's q/k/v(a)) and of the residual (eh_proj(a') vs EAGLE-3's incoming hidden), on the
    positions of EAGLE-3's own TTT unroll over the given samples (before RoPE)."""
    steps = collect_eagle3_samples(e3, input_ids, aux, attention_mask, num_steps)
    a3, g3 = flat_samples(steps, "a").double(), flat_samples(steps, "g").double()
    z = e4.eh_proj(e4_attention_inputs(e4, steps, aux))
    u = e4.layer.input_layernorm(z)
    attn3, attn4 = e3.layer.self_attn, e4.layer.self_attn
    out = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        ref = a3 @ getattr(attn3, name).weight.double().T
        out[name[0]] = float((getattr(attn4, name)(u).double() - ref).norm() / ref.norm())
    out["residual"] = float((z.double() - g3).norm() / g3.norm())
    return out


# --- the fit ---------------------------------------------------------------------------------------


def _ridge(x: Tensor, y: Tensor, rel: float = RIDGE) -> Tensor:
    """argmin_B ||x B - y||^2 + lam ||B||^2, lam = rel * mean diag(x^T x). x [N, d], y [N, m] -> [d, m]."""
    gram = x.T @ x
    lam = rel * gram.diagonal().mean().clamp(min=1e-12)
    return torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=x.dtype), x.T @ y)


def _rms_rows(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def fit_attention_input(a4: Tensor, qkv: list[Tensor], g: Tensor, eps: float, residual_weight: float = 1.0,
                        ridge: float = RIDGE) -> tuple[Tensor, list[Tensor], dict[str, float]]:
    """Reduced-rank fit of eh_proj [H, 2H] and q/k/v [n_i, H] (see the module docstring).

    a4 [N, 2H] eh_proj inputs; qkv: EAGLE-3's q, k, v outputs [N, n_i]; g [N, H] EAGLE-3 residual.
    Returns (eh_proj weight, [q, k, v] weights, relative errors on these samples), float64."""
    assert residual_weight > 0, "the residual block fixes eh_proj's output basis; it needs a weight > 0"
    h = g.shape[1]
    blocks = [*qkv, g]
    scales = [b.pow(2).mean().sqrt().clamp(min=1e-12) for b in blocks]  # unit-RMS blocks
    weights = [1.0, 1.0, 1.0, math.sqrt(residual_weight)]
    targets = torch.cat([b * (w / s) for b, w, s in zip(blocks, weights, scales)], -1)  # [N, D]
    coef = _ridge(a4, targets, ridge)  # [2H, D] unconstrained least squares
    full = a4 @ coef  # [N, D]: the best any linear map of a4 does, before the rank-H bottleneck
    # Best rank-H approximation of the fitted values a4 @ coef: project on the top-H eigenvectors
    # of coef^T (a4^T a4) coef (= right singular vectors of a4 @ coef, without forming it).
    evals, evecs = torch.linalg.eigh(coef.T @ (a4.T @ a4) @ coef)
    basis = evecs[:, evals.argsort(descending=True)[:h]]  # [D, H]
    decode_res = basis.T[:, -h:] * (scales[-1] / weights[-1])  # [H, H]: coords -> residual g
    eh = coef @ basis @ decode_res  # [2H, H]: z = a4 @ eh ~ g, in EAGLE-3's residual basis
    u = _rms_rows(a4 @ eh, eps)  # exactly what q/k/v read (pre_attn_norm weight 1)
    m = _ridge(u, torch.cat(qkv, -1), ridge)  # [H, sum n_i]
    qkv_w = [w.T for w in m.split([b.shape[1] for b in qkv], dim=1)]
    errors = {}
    for name, w, ref in zip("qkv", qkv_w, qkv):
        errors[f"fit_rel_err_{name}"] = float((u @ w.T - ref).norm() / ref.norm())
    errors["fit_rel_err_residual"] = float((a4 @ eh - g).norm() / g.norm())
    # the same errors of the unconstrained (full-rank) fit: what is left is not the width bottleneck's
    cols = torch.cumsum(torch.tensor([0] + [b.shape[1] for b in blocks]), 0).tolist()
    for name, lo, hi, b, w, sc in zip(("q", "k", "v", "residual"), cols, cols[1:], blocks, weights, scales):
        errors[f"fit_rel_err_{name}_full_rank"] = float((full[:, lo:hi] * (sc / w) - b).norm() / b.norm())
    return eh.T, qkv_w, errors


__all__ = ["RIDGE", "attention_fit_error", "collect_eagle3_samples", "e4_attention_inputs", "fit_attention_input",
           "flat_samples"]
