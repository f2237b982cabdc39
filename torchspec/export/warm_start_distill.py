"""Distil a converted EAGLE-4 drafter from its EAGLE-3 source (``torchspec-convert --distill-steps N``).

The closed-form conversion (``warm_start.py``) cannot reproduce EAGLE-3's layer: EAGLE-3's q/k/v read
2H inputs and EAGLE-4's read H, and on the real SmolLM2 shape every linear map of EAGLE-4's inputs fits
q/k/v to <1% at full rank but to 36-46% at rank H (``fit_rel_err_*_full_rank``, ``docs/results.md``,
eleventh session); the converted drafter keeps acc_0 0.173 of EAGLE-3's 0.475 and acc_1 0.005 of 0.409.
The width does not bound the drafter's *function*, only a per-matrix fit: a few gradient steps that
match EAGLE-3's output distribution end to end recover most of it (tiny target, CPU, on the fit batch of
8 conversations: held-out acceptance 1.559 -> 1.673 / 1.720 / 1.761 after 15 / 30 / 100 steps, EAGLE-3
1.776; ``tools/warm_start_experiment.py --distill-steps``). At the real SmolLM2 shape (CPU, a 120-step
EAGLE-3 at 1.219, 64 fit conversations, 16 steps at lr 2e-4) the step weights decide it: with the trainer's
0.8 per TTT step the later steps improve at step 0's expense (closed form 1.115 -> 1.061), with 0.1 (the
default here) step 0 comes first: 1.115 -> 1.157, acc_0 0.114 -> 0.152 (``docs/results.md``, eleventh
session). Off by default in ``torchspec-convert``; not yet measured on the GPU.

The objective, per Adam step on ``micro_batch`` fit sequences (cycling through them): each drafter is
unrolled ``ttt_steps`` TTT steps on its own feedback (``train.ttt.unroll_steps``, the trainer's shift and
positions), and at every real input position of every step

    sum_k decay^k KL( EAGLE-3's draft distribution || EAGLE-4's over the same draft-vocabulary rows )

averaged over positions. EAGLE-4's head rows of the draft tokens are EAGLE-3's rows after the conversion,
so the KL compares the two layers. Every EAGLE-4 weight the loss reaches moves (not the frozen embedding,
nor an efficient head's scorer, which stays the conversion's SVD until training distils it); EAGLE-3 is fixed. No target forward is run: the fit's captured states serve every step. The tokens it
reads are ``steps x micro_batch x sequence length`` drafter token passes (``distill_token_passes``), to be
counted against a warm start's budget.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from torchspec.models.eagle3 import Eagle3Drafter
from torchspec.models.eagle4 import Eagle4Drafter
from torchspec.train.ttt import shift_left, unroll_steps


def distillation_loss(e4: Eagle4Drafter, e3: Eagle3Drafter, input_ids: Tensor, aux: list[Tensor],
                      attention_mask: Tensor, ttt_steps: int, decay: float = 0.8) -> Tensor:
    """The module docstring's objective on one batch [B, T] (3 x [B, T, H] captured states): scalar, with
    gradients into ``e4`` only."""
    real = attention_mask.bool()
    pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    rows = e3.draft_to_target_ids(torch.arange(e3.config.draft_vocab_size, device=input_ids.device))
    with torch.no_grad():
        teacher = unroll_steps(e3, input_ids, e3.fuse_target_states(aux), ttt_steps, pos, None, attention_mask)
    student = unroll_steps(e4, input_ids, e4.fuse_target_states(aux), ttt_steps, pos, None, attention_mask)
    head = e4.lm_head.weight[rows]  # [Vd, H]: EAGLE-4's rows of EAGLE-3's draft tokens
    loss = torch.zeros((), device=input_ids.device)
    for k, ((t_normed, _), (s_normed, _)) in enumerate(zip(teacher, student)):
        valid = shift_left(real, k + 1, fill=False) & real  # [B, T] input positions with a next token
        t_logp = F.log_softmax(e3.lm_head(t_normed)[valid].float(), -1)  # [N, Vd]
        s_logp = F.log_softmax(F.linear(s_normed[valid], head).float(), -1)
        loss = loss + decay ** k * F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")
    return loss


def distill_from_eagle3(e4: Eagle4Drafter, e3: Eagle3Drafter, input_ids: Tensor, aux: list[Tensor],
                        attention_mask: Tensor, steps: int, *, lr: float = 1e-3, micro_batch: int = 8,
                        ttt_steps: int = 3, decay: float = 0.1, warmup: int = 10, progress: bool = False
                        ) -> dict[str, float]:
    """``steps`` AdamW steps of the module docstring on the fit batch ([S, T] ids, 3 x [S, T, H] states,
    [S, T] mask), ``micro_batch`` sequences a step in order, cycling; TTT step k weighs ``decay**k``; linear
    warm-up over ``warmup`` steps
    (a full-size first Adam step knocks a converted drafter off what it kept). Both drafters are fp32 and
    left in eval mode; ``progress``: a progress bar on stderr (minutes on a CPU at real shapes). -> metrics: the
    loss of the first and the last step, and the token passes read."""
    from tqdm import tqdm

    assert steps >= 1 and micro_batch >= 1 and ttt_steps >= 1
    e3, e4 = e3.float().eval(), e4.float()
    params = [p for p in e4.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(warmup, 1)))
    e4.train()
    n, first, passes = input_ids.shape[0], None, 0  # tensors until the end: no host sync per step
    for step in tqdm(range(steps), desc="distill", disable=not progress):
        rows = [(step * micro_batch + i) % n for i in range(min(micro_batch, n))]
        mask = attention_mask[rows]
        loss = distillation_loss(e4, e3, input_ids[rows], [a[rows].float() for a in aux], mask, ttt_steps, decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        first = loss.detach() if first is None else first
        passes = passes + mask.sum()
    e4.eval()
    return {"distill_steps": float(steps), "distill_kl_first": float(first), "distill_kl_last": float(loss.detach()),
            "distill_token_passes": float(passes)}


__all__ = ["distill_from_eagle3", "distillation_loss"]
