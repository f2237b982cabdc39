"""One optimizer step and the held-out evaluation, on any world = dp x tp.

``train_step`` takes this rank's micro-batches of one optimizer step (gradient accumulation),
computes the GLOBAL valid-token count of every TTT step first (summed over micro-batches and
all-reduced over every rank: contract 4, so accumulation, padding and dp size do not change the
effective learning rate), then for each micro-batch runs the frozen target once for the whole
tp group (``target_forward``: the group's union batch in one forward, each rank keeps its own
rows), the drafter's TTT unroll through the engine, and backward. Statistics stay on the device
until a log step, where ``StepStats.summary`` all-reduces them and syncs once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchspec.distributed import all_reduce_sum, gather_tp_batch, scatter_for_rank
from torchspec.models.moe import MoEMLP, load_imbalance
from torchspec.train.loss import TeacherHead
from torchspec.train.ttt import HeadLossConfig, TTTResult, acceptance_length, summarize, valid_counts


@dataclass(frozen=True)
class TTTOptions:
    num_steps: int  # K
    decay: float  # step weight decay**k
    moe_aux_coef: float = 0.0  # MoE load-balancing loss weight
    moe_bias_rate: float = 0.0  # MoE loss-free balancing: routing-bias step per optimizer step (0: off)
    lowrank_coef: float = 1.0  # efficient-head scorer distillation weight
    lowrank_teacher: str = "target"
    head_loss: HeadLossConfig = HeadLossConfig()


@dataclass
class StepStats:
    """Running sums over the micro-batches since the last log (tensors on the device)."""

    loss: torch.Tensor | None = None
    kl_sum: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    chain_tokens: torch.Tensor | None = None  # greedy chain rounds walked over held-out responses (eval)
    chain_rounds: torch.Tensor | None = None
    tokens: torch.Tensor | int = 0  # real (non-padding) tokens, on the device until a log step
    steps: int = 0
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, result: TTTResult, tokens: torch.Tensor | int) -> None:
        def acc(old, new):
            return new.detach().clone() if old is None else old + new.detach()

        self.loss = acc(self.loss, result.loss.double())
        self.kl_sum = acc(self.kl_sum, result.kl_sum.double())
        self.correct = acc(self.correct, result.correct)
        self.valid = acc(self.valid, result.valid)
        self.chain_tokens = acc(self.chain_tokens, result.chain_tokens)
        self.chain_rounds = acc(self.chain_rounds, result.chain_rounds)
        for key, value in result.aux.items():
            self.extra[key] = acc(self.extra.get(key), value.double())
        self.tokens = self.tokens + tokens

    def all_reduce(self) -> None:
        """Sum over every rank: each holds different sequences (loss terms are already divided by
        the global count, so their sum is the global loss)."""
        for name in ("loss", "kl_sum", "correct", "valid", "chain_tokens", "chain_rounds"):
            all_reduce_sum(getattr(self, name))
        for value in self.extra.values():
            all_reduce_sum(value)

    def summary(self, prefix: str) -> dict[str, float]:
        """Host sync happens here (log steps only). Call ``all_reduce`` first on every rank."""
        out = {f"{prefix}/{k}": v for k, v in summarize(self.kl_sum, self.correct, self.valid).items()}
        if float(self.chain_rounds) > 0:  # walked (held-out evaluation)
            out[f"{prefix}/chain_acceptance"] = float(self.chain_tokens / self.chain_rounds)
        if "chain_rounds_by_depth" in self.extra:  # the same walk for a chain of serving depth d = 1..K
            tokens, rounds = self.extra["chain_tokens_by_depth"], self.extra["chain_rounds_by_depth"].clamp(min=1)
            out.update({f"{prefix}/chain_acceptance_d{d + 1}": float(v) for d, v in enumerate(tokens / rounds)})
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


def target_forward(target, batch: dict[str, torch.Tensor], tp_group) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The frozen target on this rank's sequences: (3 aux states, post-norm last hidden state).

    With a tp group, the group's ranks run ONE forward over the union of their micro-batches
    (only token ids, masks, position and document ids travel) and each keeps its own rows; every
    rank of the group must call this the same number of times (the forward contains collectives).
    Packed rows (``document_ids`` in the batch) are computed document by document.
    """
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "document_ids") if k in batch}
    if tp_group is None:
        out = target.capture(**inputs)
        return out.aux_hidden_states, out.last_hidden_state
    union, layout = gather_tp_batch(inputs, tp_group, pad_values={"document_ids": -1})  # padding: no document
    out = target.capture(**union)
    r = dist.get_rank(tp_group)
    return [scatter_for_rank(a, layout, r) for a in out.aux_hidden_states], scatter_for_rank(out.last_hidden_state, layout, r)


def run_micro_batch(target, engine, batch: dict[str, torch.Tensor], opts: TTTOptions,
                    denominators: torch.Tensor, tp_group=None, captured=None, walk_chains: bool = False) -> TTTResult:
    """``captured``: this batch's (aux states, last hidden) if already known (held-out cache);
    ``walk_chains``: also walk serving's greedy chain rounds (``ttt.chain_rounds``; one host read)."""
    aux, last = captured if captured is not None else target_forward(target, batch, tp_group)
    # The teacher stays (post-norm last hidden, LM head): its distribution is computed chunk by
    # chunk inside the fused loss, never as [B, T, V].
    teacher = TeacherHead(last, target.lm_head_weight, target.lm_head_bias)
    return engine.unroll(batch["input_ids"], batch["loss_mask"], aux, teacher, denominators,
                         opts.num_steps, opts.decay, attention_mask=batch["attention_mask"],
                         **packing_keys(batch), moe_aux_coef=opts.moe_aux_coef,
                         lowrank_coef=opts.lowrank_coef, lowrank_teacher=opts.lowrank_teacher,
                         head_loss=opts.head_loss, walk_chains=walk_chains)


def packing_keys(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """position_ids / document_ids of packed rows (absent: one document per row)."""
    return {key: batch[key] for key in ("position_ids", "document_ids") if key in batch}


def global_denominators(batches: list[dict[str, torch.Tensor]], num_steps: int) -> torch.Tensor:
    """[K] valid-token counts of the whole optimizer step over every rank (one small all-reduce)."""
    return all_reduce_sum(sum(valid_counts(b["loss_mask"], num_steps, b.get("document_ids")) for b in batches))


def train_step(target, engine, micro_batches: list[dict[str, torch.Tensor]], opts: TTTOptions,
               stats: StepStats, tp_group=None) -> torch.Tensor:
    """One optimizer step over this rank's ``micro_batches``. Returns the (device) gradient norm."""
    denominators = global_denominators(micro_batches, opts.num_steps)
    loads = None
    for mb in micro_batches:
        result = run_micro_batch(target, engine, mb, opts, denominators, tp_group)
        engine.backward(result.loss)
        stats.add(result, tokens=mb["attention_mask"].sum())
        if opts.moe_bias_rate and "moe_expert_load" in result.aux:
            step_load = result.aux["moe_expert_load"].sum(0)  # [E]: the one MoE layer over the K TTT steps
            loads = step_load if loads is None else loads + step_load
    grad_norm = engine.step()
    if loads is not None:  # global counts: every rank moves its copy of the bias the same way
        loads = all_reduce_sum(loads)
        for module in engine.drafter.modules():
            if isinstance(module, MoEMLP):
                module.balance_step(loads, opts.moe_bias_rate)
    stats.steps += 1
    return grad_norm


EVAL_CACHE_BYTES = 1 << 30  # held-out captures kept between evals up to this size per rank


@torch.no_grad()
def evaluate(target, engine, batches: list[dict[str, torch.Tensor]], opts: TTTOptions,
             tp_group=None, cache: dict[int, tuple] | None = None) -> dict[str, float]:
    """Held-out metrics over this rank's fixed list of batches (every rank the same count).

    ``cache`` (a dict the caller keeps between evals): the frozen target's captures of the fixed
    held-out batches, stored by the first eval while they fit ``EVAL_CACHE_BYTES``, so later evals
    skip the target forward (same values: the target never changes). Only without a tp group: the
    target forward is collective there, and every rank must run the same forwards."""
    engine.module.eval()
    stats = StepStats()
    denominators = global_denominators(batches, opts.num_steps)
    use_cache = cache is not None and tp_group is None
    for i, b in enumerate(batches):
        captured = cache.get(i) if use_cache else None
        if captured is None:
            captured = target_forward(target, b, tp_group)
            size = sum(t.numel() * t.element_size() for t in (*captured[0], captured[1]))
            if use_cache and sum(c[2] for c in cache.values()) + size <= EVAL_CACHE_BYTES:
                cache[i] = (*captured, size)
        stats.add(run_micro_batch(target, engine, b, opts, denominators, tp_group, captured[:2], walk_chains=True),
                  tokens=b["attention_mask"].sum())
    stats.steps = 1
    stats.all_reduce()
    engine.module.train()
    return stats.summary("eval")
