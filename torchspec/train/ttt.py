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
1..k at t itself (``torchspec.models.attention``; with a sliding window only the step-0 keys
``torchspec.attend.in_window`` admits), i.e. exactly the draft KV cache the drafter would have
after drafting k tokens beyond the committed prefix x_0..x_{t+1}. The step itself is THE drafter
step that serving runs too (``drafter.step`` with the drafter's TTT attend here, a paged attend
there; ``tests/unit/test_drafter_step_parity.py`` pins the two together).

Loss (contract 4): per valid token, forward KL(p_target || q_draft) in fp32; step k summed over
its valid tokens, divided by the GLOBAL number of valid tokens of step k (summed over data-parallel
ranks and gradient-accumulation micro-batches, passed in as ``denominators``), weighted decay**k.
All K steps are scored after the unroll in one fused pass (``torchspec.train.loss``), their states
stacked by target position p = t + k + 1 so each position's teacher distribution is computed once.

Packed rows (``document_ids``, ``position_ids`` per document): RoPE uses the position inside the
document, attention stays inside the document, and step k at t is valid only if x_t and the
predicted x_{t+k+2} belong to the same document (``scored_mask``).

Acceptance, two ways: ``acceptance_length`` multiplies the per-step accuracies (marginals over
different positions; every log step); ``chain_rounds`` (held-out evaluation) walks the greedy chain
rounds of depth K that serving runs over each response, round after round, and gives what serving
reports: committed tokens per round. A draft counts as correct only if it is the token serving would
propose (an efficient head drafts its best top-k candidate, so a dense argmax outside the scorer's
top-k is not accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.profiler import record_function

from torchspec.distributed import all_reduce_sum
from torchspec.models.lm_head import EfficientLMHead
from torchspec.train.loss import TeacherHead, fused_ttt_head_loss


@dataclass
class TTTResult:
    """Per-step sums for one micro-batch (tensors of shape [K]; no host sync happened)."""

    loss: torch.Tensor  # scalar, already normalised by ``denominators``
    kl_sum: torch.Tensor  # [K] sum of KL over valid tokens
    correct: torch.Tensor  # [K] valid tokens whose draft argmax equals the target argmax
    valid: torch.Tensor  # [K] number of valid tokens
    chain_tokens: torch.Tensor  # scalar fp64: tokens greedy chain rounds commit (``chain_rounds``; 0 unless walked)
    chain_rounds: torch.Tensor  # scalar fp64: those rounds
    aux: dict[str, torch.Tensor]  # extra per-model metrics (e.g. MoE load) summed over steps


@dataclass(frozen=True)
class HeadLossConfig:
    """How the fused head loss runs (``torchspec.train.loss``): memory per chunk, backend, and what the
    full head's KL spans (``drafter.head_loss``)."""

    chunk_gib: float = 4.0  # transient memory of one chunk of positions (logits, gradients)
    backend: str = "auto"  # auto (Triton on CUDA) | triton | torch (the reference)
    kind: str = "full"  # full (all of V) | candidates (an efficient head's top-k + the target's top-m)
    target_topk: int = 128  # m of "candidates"


def scored_mask(loss_mask: torch.Tensor, num_steps: int, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] loss mask -> [B, T, K] bool by TARGET position p: step k's state at t = p - k - 1 is
    scored at p iff p - k - 1 >= 0, the predicted token x_{p+1} exists and has loss_mask 1, and (packed
    rows) x_t and x_{p+1} belong to the same document."""
    b, t = loss_mask.shape
    nxt = shift_left(loss_mask.bool(), 1, False)  # [B, T] mask of x_{p+1}
    out = []
    for k in range(num_steps):
        ok = nxt & (torch.arange(t, device=loss_mask.device) >= k + 1)
        if document_ids is not None:
            ok = ok & (shift_right(document_ids, k + 1, -2) == shift_left(document_ids, 1, -3))
        out.append(ok)
    return torch.stack(out, dim=-1)


def valid_counts(loss_mask: torch.Tensor, num_steps: int, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] loss mask -> [K] count of valid (scored) tokens per TTT step."""
    return scored_mask(loss_mask, num_steps, document_ids).sum((0, 1)).to(torch.float64)


def chain_rounds(correct: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor,
                 document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy chain rounds of depth K serving runs over every response, from [B, T, K] bool tensors by
    TARGET position: ``correct`` (the token serving would propose is the target's) and ``valid``
    (``scored_mask``), and the [B, T] loss mask / document ids -> (tokens committed, rounds), fp64 scalars:
    the depth-K entries of ``chain_rounds_by_depth``.

    Step k from input position t predicts x_{t+k+2} (target position t + k + 1). Serving takes a
    response's first token x_P from the prefill, so a round can start at t iff x_{t+1} is a response token
    of t's document and step 0 from t is scored: the first at t = P - 1. A round commits 1 + the leading
    run of correct steps, cut to the response (at most E - t - 1 tokens for a response ending at x_E), and
    the next round starts that many positions later; then the next response (or document) begins. This
    is serving's own weighting of positions: a stretch the drafter gets right is crossed in few rounds.
    """
    tokens, rounds = chain_rounds_by_depth(correct, valid, loss_mask, document_ids)
    return tokens[-1], rounds[-1]


def chain_rounds_by_depth(correct: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor,
                          document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``chain_rounds`` for a chain of every serving depth d = 1..K (the walk over the first d steps:
    they do not depend on K) -> (tokens [K], rounds [K]) fp64. Reads the tensors to the host once."""
    b, t, k = correct.shape
    by_start = torch.stack([shift_left(correct[..., i], i + 1, False) for i in range(k)], -1).cpu()
    starts = shift_left(valid[..., 0], 1, False).cpu()  # [B, T]: step 0 from t is scored
    generated = shift_left(loss_mask.bool(), 1, False)  # x_{t+1} is a response token ...
    if document_ids is not None:  # ... of t's own document
        generated = generated & (shift_left(document_ids, 1, -3) == document_ids)
    leading = by_start.long().cumprod(-1)  # [B, T, K]: steps 0..i from t all correct
    positions = torch.arange(t).expand(b, t)
    left = _next_at_or_after(~starts)[:, :t] - positions  # scored starts from t to the response's end
    next_round = _next_at_or_after(starts & generated.cpu())  # [B, T+1]: the first round start at or after x
    rows = torch.arange(b)
    totals = []
    for depth in range(1, k + 1):
        committed = torch.minimum(1 + leading[..., :depth].sum(-1), left)  # [B, T]
        pos = next_round[:, 0].clone()
        tokens = rounds = 0
        while bool((live := pos < t).any()):
            c = committed[rows, pos.clamp(max=t - 1)]
            tokens, rounds = tokens + int(c[live].sum()), rounds + int(live.sum())
            pos = torch.where(live, next_round[rows, (pos + c).clamp(max=t)], t)
        totals.append((float(tokens), float(rounds)))
    out = torch.tensor(totals, dtype=torch.float64, device=valid.device)  # [K, 2]
    return out[:, 0].contiguous(), out[:, 1].contiguous()


def _next_at_or_after(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B, T + 1] long: the first u >= x with mask[u], T where there is none."""
    b, t = mask.shape
    index = torch.where(mask, torch.arange(t), t)
    index = torch.cat([index, torch.full((b, 1), t)], 1)
    return index.flip(1).cummin(1).values.flip(1)


def shift_left(x: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n] along dim 1, padded with ``fill`` at the end."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def shift_right(x: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t - n] along dim 1, padded with ``fill`` at the start."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([pad, x[:, : x.shape[1] - n]], dim=1)


def drafter_teacher(teacher: TeacherHead, drafter) -> TeacherHead:
    """The teacher over the drafter's output vocabulary: EAGLE-3's pruned draft vocabulary (the
    loss renormalises inside it) or EAGLE-4's full one. The argmax stays over the full vocabulary."""
    ids = drafter.draft_vocab_ids()
    return teacher if ids is None else teacher.restricted(ids)


def unroll_steps(drafter, input_ids: torch.Tensor, hidden: torch.Tensor, num_steps: int,
                 position_ids: torch.Tensor, document_ids: torch.Tensor | None = None,
                 token_mask: torch.Tensor | None = None, moe_stats: list | None = None
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The K drafter steps of the unroll (shift and positions of contract 3), unscored: step k at
    position t feeds token x_{t+k+1}, RoPE position t + k and the feedback of step k-1 (``hidden``
    = the fused target states for step 0). Returns (normed, feedback) [B, T, H] per step, by input
    position t."""
    attend = drafter.ttt_attend(document_ids)  # one KV list for the whole unroll
    real = token_mask if token_mask is not None else torch.ones_like(input_ids)
    out = []
    for k in range(num_steps):
        normed, hidden = drafter.step(shift_left(input_ids, k + 1), hidden, position_ids + k, attend,
                                      token_mask=shift_left(real, k + 1), moe_stats=moe_stats)
        out.append((normed, hidden))
    return out


def ttt_unroll(
    drafter,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    aux_hidden_states: list[torch.Tensor],
    teacher: TeacherHead,
    num_steps: int,
    decay: float,
    denominators: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    moe_aux_coef: float = 0.0,
    lowrank_coef: float = 1.0,
    lowrank_teacher: str = "target",
    head_loss: HeadLossConfig = HeadLossConfig(),
    walk_chains: bool = False,
) -> TTTResult:
    """Run K = ``num_steps`` TTT steps, then score all of them in one fused head-loss pass.

    input_ids, loss_mask, attention_mask, position_ids (per document, packed rows), document_ids
    (-1 on padding): [B, T]; aux_hidden_states: 3 x [B, T, H]; teacher: the target's post-norm last
    hidden [B, T, H] and LM head; denominators: [K] global valid counts. An efficient LM head's
    low-rank scorer is distilled in the same pass (teacher: the target distribution or the drafter's
    full head; its input state is detached) with the same token weights, times ``lowrank_coef``.
    ``head_loss.kind="candidates"`` restricts the full head's KL to the scorer's top-k and the target's
    top-m (``torchspec.train.loss_candidates``): the drafter's argmax is then the served proposal, so
    ``correct`` counts served drafts and ``kl_sum`` sums the KL over the candidates.
    An MoE drafter's load-balancing loss of step k enters as ``moe_aux_coef * terms_k / K``
    (``load_balancing_terms``): the aux of the micro-batch of every rank, weighted by its share of the
    step's scored tokens like the KL (contract 4), so neither it nor its weight depends on padding or on
    how the global micro-batch is split over data-parallel ranks.
    """
    b, t = input_ids.shape
    assert t >= 2, "sequences need at least 2 tokens"
    if position_ids is None:
        position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
    hidden = drafter.fuse_target_states(aux_hidden_states)  # [B, T, H]
    moe_stats: list = []
    steps = unroll_steps(drafter, input_ids, hidden, num_steps, position_ids, document_ids, attention_mask, moe_stats)
    states = [shift_right(normed, k + 1) for k, (normed, _) in enumerate(steps)]  # by target position p = t + k + 1
    states = torch.stack(states, dim=2).reshape(b * t, num_steps, -1)  # [B*T, K, H]
    valid = scored_mask(loss_mask, num_steps, document_ids).reshape(b * t, num_steps)  # [N, K]
    step_weight = decay ** torch.arange(num_steps, device=valid.device, dtype=torch.float64)
    token_weights = valid * (step_weight / denominators.to(valid.device).clamp(min=1)).float()
    head = drafter.lm_head
    efficient = isinstance(head, EfficientLMHead)
    with record_function("head_loss"):
        out = fused_ttt_head_loss(
            states, head.weight, drafter_teacher(teacher, drafter), token_weights,
            scorer=(head.down, head.up) if efficient else None, topk=head.topk if efficient else 0,
            scorer_coef=lowrank_coef, scorer_teacher=lowrank_teacher,
            chunk_gib=head_loss.chunk_gib, backend=head_loss.backend,
            head_loss=head_loss.kind, target_topk=head_loss.target_topk)
    loss = out.loss
    target_argmax = out.target_argmax[:, None]  # [N, 1]
    correct = (drafter.draft_to_target_ids(out.argmax) == target_argmax) & valid  # [N, K]
    aux: dict[str, torch.Tensor] = {}
    if walk_chains:  # serving proposes the dense argmax only when it is among an efficient head's top-k
        served = correct & out.full_in_topk if efficient else correct  # [N, K]
        by_depth = chain_rounds_by_depth(served.view(b, t, num_steps), valid.view(b, t, num_steps),
                                         loss_mask, document_ids)  # serving depths 1..K
        aux["chain_tokens_by_depth"], aux["chain_rounds_by_depth"] = by_depth  # [K] each
        chain_tokens, chain_count = by_depth[0][-1], by_depth[1][-1]
    else:
        chain_tokens = chain_count = torch.zeros((), dtype=torch.float64, device=valid.device)
    if efficient:
        aux["lowrank_kl_sum"] = torch.where(valid, out.scorer_kl, 0).sum(0).double().detach()
        aux["lowrank_full_in_topk"] = (out.full_in_topk & valid).sum(0).double()
        aux["lowrank_target_in_topk"] = (out.target_in_topk & valid).sum(0).double()
        aux["lowrank_correct_in_topk"] = (out.full_in_topk & (out.argmax == target_argmax) & valid).sum(0).double()
    valids = valid.sum(0)  # [K]
    if moe_stats:
        terms = load_balancing_terms(moe_stats, valids, denominators)  # [K], this rank's part
        loss = loss + moe_aux_coef * terms.sum() / num_steps
        aux["moe_aux_loss"] = terms.detach()  # summed over ranks and micro-batches: the step's aux per TTT step
        aux["moe_expert_load"] = torch.stack([st.expert_load for st in moe_stats]).double()  # [K, E]
    return TTTResult(
        loss=loss,
        kl_sum=torch.where(valid, out.kl, 0).sum(0).detach(),
        correct=correct.sum(0).to(torch.float64),
        valid=valids.to(torch.float64),
        chain_tokens=chain_tokens,
        chain_rounds=chain_count,
        aux=aux,
    )


def load_balancing_terms(moe_stats: list, valids: torch.Tensor, denominators: torch.Tensor) -> torch.Tensor:
    """This rank's part of each TTT step's MoE load-balancing loss, [K]; summed over the data-parallel ranks
    it is, per step k, (scored tokens of this micro-batch on every rank / ``denominators[k]``) x the aux
    E sum_e f_e P_e of ``torchspec.models.moe`` over the micro-batch of every rank.

    f_e (no gradient) comes from the expert loads all-reduced over the world (one [K, E + 2] all-reduce with
    the token counts and the scored counts ``valids`` [K]); this rank contributes P_e's share
    prob_sum_e / N_global, so the ranks' parts add up to the global aux exactly, whatever the split. Per-rank
    auxes averaged instead (what this replaced) balance each rank's tokens, a different objective that moves
    with the data-parallel size. Across gradient-accumulation micro-batches each micro-batch is balanced on
    its own global tokens (their order is not known in advance), weighted by its share of the step."""
    loads = torch.stack([st.expert_load.float() for st in moe_stats])  # [K, E]
    dev = loads.device
    counts = torch.stack([torch.as_tensor(st.num_tokens, dtype=torch.float32, device=dev) for st in moe_stats])
    num_experts = loads.shape[1]
    glob = all_reduce_sum(torch.cat([loads, counts[:, None], valids.float().to(dev)[:, None]], 1))  # [K, E + 2]
    slots = glob[:, :num_experts]
    f = slots / slots.sum(-1, keepdim=True).clamp(min=1)  # token-slot fractions (each token has top-k slots)
    p_share = torch.stack([st.prob_sum for st in moe_stats]) / glob[:, num_experts:num_experts + 1].clamp(min=1)
    share = glob[:, -1] / denominators.to(dev).float().clamp(min=1)  # [K] this micro-batch's share of the step
    return share * num_experts * (f * p_share).sum(-1)


def acceptance_length(step_accuracy: torch.Tensor) -> float:
    """Simulated acceptance length = 1 + sum_k prod_{i<=k} acc_i: the product of marginals over
    different positions (steps are correlated; ``chain_rounds`` walks serving's rounds).

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


