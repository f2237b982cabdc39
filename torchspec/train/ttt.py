"""Training-time test (TTT): unroll the drafter K steps over a batch and score it against the target.

Shift and mask (contract 3), with x_0..x_{T-1} the tokens and h_t the captured target states at
position t (h_t is what the target used to predict x_{t+1}):

    step k, position t:  input token  x_{t+k+1}
                         input hidden g_t^(0) = fuse(h_t);  g_t^(k) = drafter feedback of step k-1 at t
                         RoPE position t + k          (the depth-k draft sits k slots after t+1)
                         predicts     x_{t+k+2}, scored against the target distribution at
                                      position t+k+1, softmax(lm_head(last_hidden_{t+k+1}))
                         valid iff    t + k + 2 <= T - 1  and  loss_mask[t+k+2] == 1
                                      ("mask of the predicted token")

Worked toy example, T = 6, tokens [s, u, A, B, C, e], loss_mask [0, 0, 1, 1, 1, 1] (assistant = A..e):

    k=0: t=0 feeds (h_0, u) -> predicts A (mask[2]=1, valid);  t=1 feeds (h_1, A) -> B;
         t=2 -> C; t=3 -> e; t=4 would predict x_6 (does not exist: invalid); t=5 invalid.
    k=1: t=0 feeds (g_0^(1), A) -> predicts B (mask[3]); t=1 -> C; t=2 -> e; t=3, 4, 5 invalid.
    k=2: t=0 feeds (g_0^(2), B) -> predicts C; t=1 -> e; t>=2 invalid.

Attention: the query of step k at t sees step-0 keys at positions <= t and the keys of steps
1..k at t itself (``torchspec.models.attention``; with a sliding window only step-0 keys at
t - window < s <= t), i.e. exactly the draft KV cache
the drafter would have after drafting k tokens beyond the committed prefix x_0..x_{t+1}.

Loss (contract 4): per valid token, forward KL(p_target || q_draft) in fp32; step k summed over
its valid tokens, divided by the GLOBAL number of valid tokens of step k (summed over data-parallel
ranks and gradient-accumulation micro-batches, passed in as ``denominators``), weighted decay**k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchspec.models.lm_head import EfficientLMHead, lowrank_distill_loss
from torchspec.train.loss import fused_linear_soft_ce


@dataclass
class TTTResult:
    """Per-step sums for one micro-batch (tensors of shape [K]; no host sync happened)."""

    loss: torch.Tensor  # scalar, already normalised by ``denominators``
    kl_sum: torch.Tensor  # [K] sum of KL over valid tokens
    correct: torch.Tensor  # [K] valid tokens whose draft argmax equals the target argmax
    valid: torch.Tensor  # [K] number of valid tokens
    aux: dict[str, torch.Tensor]  # extra per-model metrics (e.g. MoE load) summed over steps


def valid_counts(loss_mask: torch.Tensor, num_steps: int) -> torch.Tensor:
    """[B, T] loss mask -> [K] count of valid (scored) tokens per TTT step."""
    return torch.stack([loss_mask[:, k + 2 :].sum() for k in range(num_steps)]).to(torch.float64)


def shift_left(x: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n] along dim 1, padded with ``fill`` at the end."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def target_distribution(target_logits: torch.Tensor, drafter=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 target logits [B, T, V] -> (probs [B, T, V'], entropy [B, T], argmax [B, T]).

    V' = V, except for a drafter with a pruned vocabulary (EAGLE-3): its ``target_probs_for_loss``
    renormalises the target distribution inside the draft vocabulary. The argmax is always over
    the full target vocabulary, so accuracy is measured in target-vocab space (contract 5).
    """
    argmax = target_logits.argmax(-1)
    if hasattr(drafter, "target_probs_for_loss"):
        probs = drafter.target_probs_for_loss(target_logits)  # [B, T, Vd]
        return probs, -torch.special.xlogy(probs, probs).sum(-1), argmax
    logp = torch.log_softmax(target_logits.float(), dim=-1)
    probs = logp.exp()
    entropy = -(probs * logp).sum(-1)
    return probs, entropy, argmax


def ttt_unroll(
    drafter,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    aux_hidden_states: list[torch.Tensor],
    target_logits: torch.Tensor,
    num_steps: int,
    decay: float,
    denominators: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    moe_aux_coef: float = 0.0,
    lowrank_coef: float = 1.0,
    lowrank_teacher: str = "target",
) -> TTTResult:
    """Run K = ``num_steps`` TTT steps.

    input_ids, loss_mask, attention_mask: [B, T]; aux_hidden_states: 3 x [B, T, H]; target_logits:
    [B, T, V] fp32 (from the target's post-norm last hidden state); denominators: [K] global valid
    counts. An efficient LM head's low-rank scorer is trained by ``lowrank_distill_loss`` (teacher:
    the target distribution or the drafter's full head; the drafter state is detached) with the
    same token weights, times ``lowrank_coef``. An MoE drafter's load-balancing loss of step k enters as
    ``moe_aux_coef * aux_k * valid_k / denominators[k] / K`` — normalised like the KL (contract 4),
    so its weight does not depend on micro-batching, padding or data-parallel size.
    """
    b, t = input_ids.shape
    assert t >= 2, "sequences need at least 2 tokens"
    target_probs, target_entropy, target_argmax = target_distribution(target_logits, drafter)
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    hidden = drafter.fuse_target_states(aux_hidden_states)  # [B, T, H]
    kv_cache: list = []
    moe_stats: list = []
    lowrank_stats: list = []
    efficient_head = isinstance(getattr(drafter, "lm_head", None), EfficientLMHead)
    real = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    loss = hidden.new_zeros((), dtype=torch.float32)
    kl_sums, corrects, valids = [], [], []
    for k in range(num_steps):
        step_ids = shift_left(input_ids, k + 1)  # x_{t+k+1}
        normed, hidden = drafter.step(step_ids, hidden, positions + k, kv_cache,
                                      token_mask=shift_left(real, k + 1), moe_stats=moe_stats)
        valid = loss_mask[:, k + 2 :].bool()  # [B, n]: mask of the predicted token x_{t+k+2}
        n = valid.shape[1]  # positions t = 0..T-k-3 can be valid at step k
        tgt = slice(k + 1, k + 1 + n)  # target distribution at position t+k+1
        mask = valid.float()
        token_weights = mask * ((decay**k) / denominators[k].clamp(min=1).float())
        step_loss, cross, draft_argmax = fused_linear_soft_ce(
            normed[:, :n], drafter.lm_head.weight, target_probs[:, tgt], token_weights)
        loss = loss + step_loss - (token_weights * target_entropy[:, tgt]).sum()  # CE -> KL (a constant)
        if efficient_head:
            scorer_loss, st = lowrank_distill_loss(
                normed[:, :n], drafter.lm_head, token_weights,
                teacher_probs=target_probs[:, tgt] if lowrank_teacher == "target" else None,
                full_argmax=draft_argmax, target_argmax=target_argmax[:, tgt])
            loss = loss + lowrank_coef * scorer_loss
            lowrank_stats.append(st)
        kl_sum = ((cross - target_entropy[:, tgt]) * mask).sum()
        draft_target_ids = drafter.draft_to_target_ids(draft_argmax)
        kl_sums.append(kl_sum.detach())
        corrects.append(((draft_target_ids == target_argmax[:, tgt]) & valid).sum())
        valids.append(valid.sum())
    aux: dict[str, torch.Tensor] = {}
    for key in ("kl_sum", "full_in_topk", "target_in_topk", "correct_in_topk"):
        if lowrank_stats:
            aux[f"lowrank_{key}"] = torch.stack([st[key] for st in lowrank_stats]).double().detach()  # [K]
    if moe_stats:
        weights = torch.stack(valids).float() / denominators.clamp(min=1).float() / num_steps  # [K]
        moe_aux = torch.stack([st.aux_loss for st in moe_stats])  # [K]
        loss = loss + moe_aux_coef * (weights * moe_aux).sum()
        aux["moe_aux_loss"] = moe_aux.detach()
        aux["moe_expert_load"] = torch.stack([st.expert_load for st in moe_stats]).double()  # [K, E]
    return TTTResult(
        loss=loss,
        kl_sum=torch.stack(kl_sums),
        correct=torch.stack(corrects).to(torch.float64),
        valid=torch.stack(valids).to(torch.float64),
        aux=aux,
    )


def acceptance_length(step_accuracy: torch.Tensor) -> float:
    """Simulated acceptance length = 1 + sum_k prod_{i<=k} acc_i.

    The leading 1 is the bonus token the target always contributes in a verification round;
    a drafter that is never right gives 1.0, a perfect K-step drafter gives K + 1.
    """
    return float(1.0 + torch.cumprod(step_accuracy.double(), dim=0).sum())


def summarize(kl_sum: torch.Tensor, correct: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """Summed per-step statistics (already reduced over ranks) -> loggable metrics."""
    acc = correct / valid.clamp(min=1)
    out = {f"acc_{k}": float(a) for k, a in enumerate(acc)}
    out.update({f"kl_{k}": float(s) for k, s in enumerate(kl_sum / valid.clamp(min=1))})
    out["acceptance_length"] = acceptance_length(acc)
    return out


