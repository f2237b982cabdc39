"""One optimizer step and the held-out evaluation.

``train_step`` takes the micro-batches of one optimizer step (gradient accumulation), computes
the global valid-token count of every TTT step first (contract 4: the loss of every micro-batch
is divided by the count of the whole step, so accumulation and padding do not change the
effective learning rate), then for each micro-batch runs the frozen target once and the TTT
unroll of the drafter, and backpropagates. No host synchronisation happens here: the summed
statistics stay on the device until the recipe logs them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from torchspec.models.moe import load_imbalance
from torchspec.train.ttt import TTTResult, acceptance_length, summarize, ttt_unroll, valid_counts


@dataclass(frozen=True)
class TTTOptions:
    num_steps: int  # K
    decay: float  # step weight decay**k
    moe_aux_coef: float = 0.0  # MoE load-balancing loss weight
    lowrank_coef: float = 1.0  # efficient-head scorer distillation weight
    lowrank_teacher: str = "target"


@dataclass
class StepStats:
    """Running sums over the micro-batches since the last log (tensors on the device)."""

    loss: torch.Tensor | None = None
    kl_sum: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    tokens: int = 0
    steps: int = 0
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, result: TTTResult, tokens: int) -> None:
        def acc(old, new):
            return new.detach().clone() if old is None else old + new.detach()

        self.loss = acc(self.loss, result.loss)
        self.kl_sum = acc(self.kl_sum, result.kl_sum)
        self.correct = acc(self.correct, result.correct)
        self.valid = acc(self.valid, result.valid)
        for key, value in result.aux.items():
            self.extra[key] = acc(self.extra.get(key), value)
        self.tokens += tokens

    def summary(self, prefix: str) -> dict[str, float]:
        """Host sync happens here (log steps only)."""
        out = {f"{prefix}/{k}": v for k, v in summarize(self.kl_sum, self.correct, self.valid).items()}
        out[f"{prefix}/loss"] = float(self.loss) / max(self.steps, 1)
        if "moe_expert_load" in self.extra:  # [K, E] token-slot counts summed since the last log
            load = self.extra["moe_expert_load"]
            out[f"{prefix}/moe_load_imbalance"] = float(load_imbalance(load.sum(0)))
            out.update({f"{prefix}/moe_load_imbalance_{k}": float(v) for k, v in enumerate(load_imbalance(load))})
            out[f"{prefix}/moe_aux_loss"] = float(self.extra["moe_aux_loss"].mean()) / max(self.steps, 1)
        if "lowrank_full_in_topk" in self.extra:  # efficient head: top-k recall, per depth and overall
            valid = self.valid.clamp(min=1)
            full, tgt = self.extra["lowrank_full_in_topk"], self.extra["lowrank_target_in_topk"]
            out[f"{prefix}/topk_recall_full"] = float(full.sum() / valid.sum())
            out[f"{prefix}/topk_recall_target"] = float(tgt.sum() / valid.sum())
            out.update({f"{prefix}/topk_recall_full_{k}": float(v) for k, v in enumerate(full / valid)})
            out.update({f"{prefix}/topk_recall_target_{k}": float(v) for k, v in enumerate(tgt / valid)})
            out[f"{prefix}/acceptance_length_efficient_lb"] = acceptance_length(
                self.extra["lowrank_correct_in_topk"] / valid)
        return out


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def run_micro_batch(target, drafter, batch: dict[str, torch.Tensor], opts: TTTOptions,
                    denominators: torch.Tensor, amp_dtype: torch.dtype | None) -> TTTResult:
    device = batch["input_ids"].device
    out = target(batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.no_grad():
        target_logits = target.target_logits(out.last_hidden_state)  # [B, T, V] fp32
    with autocast(device, amp_dtype):
        return ttt_unroll(drafter, batch["input_ids"], batch["loss_mask"], out.aux_hidden_states,
                          target_logits, opts.num_steps, opts.decay, denominators.to(device),
                          attention_mask=batch["attention_mask"], moe_aux_coef=opts.moe_aux_coef,
                          lowrank_coef=opts.lowrank_coef, lowrank_teacher=opts.lowrank_teacher)


def train_step(target, drafter, optimizer, scheduler, micro_batches: list[dict[str, torch.Tensor]],
               opts: TTTOptions, max_grad_norm: float, amp_dtype: torch.dtype | None,
               stats: StepStats) -> torch.Tensor:
    """One optimizer step over ``micro_batches``. Returns the (device) gradient norm."""
    denominators = sum(valid_counts(mb["loss_mask"], opts.num_steps) for mb in micro_batches)
    for mb in micro_batches:
        result = run_micro_batch(target, drafter, mb, opts, denominators, amp_dtype)
        result.loss.backward()
        stats.add(result, tokens=int(mb["attention_mask"].numel()))
    params = [p for p in drafter.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    stats.steps += 1
    return grad_norm


@torch.no_grad()
def evaluate(target, drafter, batches: list[dict[str, torch.Tensor]], opts: TTTOptions,
             amp_dtype: torch.dtype | None) -> dict[str, float]:
    """Held-out metrics over a fixed list of batches (same batches every time)."""
    was_training = drafter.training
    drafter.eval()
    stats = StepStats()
    denominators = sum(valid_counts(b["loss_mask"], opts.num_steps) for b in batches)
    for b in batches:
        stats.add(run_micro_batch(target, drafter, b, opts, denominators, amp_dtype),
                  tokens=int(b["attention_mask"].numel()))
    stats.steps = 1
    drafter.train(was_training)
    return stats.summary("eval")
