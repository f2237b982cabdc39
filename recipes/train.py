"""Train a drafter on hidden states captured online from a frozen target.

    torchspec-train                                # default job: EAGLE-4 for SmolLM2-135M on ShareGPT, CPU
    torchspec-train train.max_steps=2000 data.max_length=4096 train=gpu
    python recipes/train.py target.path=/ckpt/Qwen3-8B drafter=eagle4 name=qwen3_8b

Read top to bottom: config -> target -> drafter -> data -> optimizer -> resume -> loop -> save.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from torchspec.config import Config, register_configs, validate_against_target, validate_config
from torchspec.data import ResumableBatchSampler, build_datasets, collate
from torchspec.data.vocab import build_vocab_mapping, token_frequencies, vocab_coverage
from torchspec.models import build_drafter
from torchspec.target import TargetModel, load_target_config, load_tokenizer, resolve_target_path
from torchspec.train.checkpoint import (
    atomic_save_dir,
    atomic_write_text,
    find_resume_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from torchspec.train.metrics import MetricsLogger, plot_metrics
from torchspec.train.optim import build_optimizer, build_scheduler, resolve_precision
from torchspec.train.step import StepStats, TTTOptions, evaluate, train_step

log = logging.getLogger("torchspec.train")
register_configs()


def build_config(raw: DictConfig) -> Config:
    cfg: Config = OmegaConf.to_object(raw)
    validate_config(cfg)
    return cfg


def build_target(cfg: Config) -> tuple[TargetModel, str, list[int]]:
    path = resolve_target_path(cfg.target.path, os.path.expanduser(cfg.target.cache_dir))
    aux_ids = validate_against_target(cfg, load_target_config(path))  # before any weight loads
    dtype = torch.bfloat16 if cfg.target.dtype == "bfloat16" else torch.float32
    return TargetModel.from_pretrained(path, aux_layer_ids=aux_ids, dtype=dtype), path, aux_ids


def build_model(cfg: Config, target: TargetModel, aux_ids: list[int], train_set):
    drafter = build_drafter(cfg.drafter, target.config, aux_ids)
    if hasattr(drafter, "set_vocab_mapping"):  # pruned draft vocabulary (EAGLE-3), from the train split only
        freqs = token_frequencies(train_set, target.vocab_size)
        d2t, t2d = build_vocab_mapping(freqs, drafter.config.draft_vocab_size)
        drafter.set_vocab_mapping(d2t, t2d)
        log.info("draft vocabulary %d / %d covers %.1f%% of assistant tokens", drafter.config.draft_vocab_size,
                 target.vocab_size, 100 * vocab_coverage(freqs, t2d))
    drafter.init_from_target(target.embed_tokens_weight, target.lm_head_weight, cfg.drafter.init_lm_head_from_target)
    drafter.lm_head.weight.requires_grad_(not cfg.drafter.freeze_lm_head)
    return drafter.float().train()


def eval_batches(eval_set, batch_size: int, pad_id: int, limit: int | None) -> list[dict]:
    batches = [collate(eval_set[i : i + batch_size], pad_id) for i in range(0, len(eval_set), batch_size)]
    return batches[:limit] if limit else batches


CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(config_path=CONF_DIR, config_name="train", version_base=None)
def main(raw: DictConfig) -> None:
    try:
        train(raw)
    except ValueError as err:  # user errors: a message that names the problem and the fix, no traceback
        print(f"torchspec-train: error: {err}", file=sys.stderr)
        sys.exit(2)


def train(raw: DictConfig) -> None:
    cfg = build_config(raw)
    t = cfg.train
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    torch.manual_seed(t.seed)
    out_dir = Path(t.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(raw, resolve=True))
    device = torch.device("cpu")
    amp_dtype = resolve_precision(t.precision, device)

    started = time.time()
    target, target_path, aux_ids = build_target(cfg)
    log.info("target %s: %d layers, hidden %d, vocab %d, aux layers %s",
             target_path, target.num_layers, target.hidden_size, target.vocab_size, aux_ids)
    tokenizer = load_tokenizer(target_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    d = cfg.data
    train_set, eval_set, skips = build_datasets(
        d.path, tokenizer, fmt=d.format, max_length=d.max_length, eval_size=d.eval_size, seed=d.seed,
        max_conversations=d.max_conversations, on_too_long=d.on_too_long, chat_template=d.chat_template)
    log.info("data: %d train / %d held-out sequences; %s", len(train_set), len(eval_set), skips.summary())
    drafter = build_model(cfg, target, aux_ids, train_set)
    log.info("drafter %s: %.1fM trainable parameters", cfg.drafter.arch,
             sum(p.numel() for p in drafter.parameters() if p.requires_grad) / 1e6)
    sampler = ResumableBatchSampler(len(train_set), t.micro_batch_size, seed=t.seed)
    held_out = eval_batches(eval_set, t.micro_batch_size, pad_id, t.eval_batches)

    opts = TTTOptions(t.ttt_steps, t.step_decay, cfg.drafter.moe_aux_loss_coef if cfg.drafter.moe else 0.0,
                      cfg.drafter.lowrank_coef, cfg.drafter.lowrank_teacher)
    optimizer = build_optimizer(drafter, t.lr, t.weight_decay, t.betas)
    scheduler = build_scheduler(optimizer, t.warmup_steps, t.max_steps, t.min_lr_ratio)
    step = 0
    resume_from = find_resume_checkpoint(out_dir, t.resume)
    if resume_from is not None:
        state = load_checkpoint(resume_from, drafter, optimizer, scheduler)
        sampler.load_state_dict(state["sampler"])
        if "vocab_mapping" in state["extra"]:  # refused loudly if today's data gives another mapping
            drafter.set_vocab_mapping(*state["extra"]["vocab_mapping"])
        step = state["step"]
        log.info("resumed from %s at step %d", resume_from, step)
    logger = MetricsLogger(out_dir, t.report_to, OmegaConf.to_container(raw, resolve=True),
                           t.wandb_project, cfg.name, resume_step=step if resume_from else None)
    log.info("setup took %.1fs", time.time() - started)

    def run_eval() -> dict[str, float]:
        metrics = evaluate(target, drafter, held_out, opts, amp_dtype)
        logger.log(step, metrics)
        log.info("step %d held-out: acceptance length %.3f, acc_0 %.3f, loss %.4f",
                 step, metrics["eval/acceptance_length"], metrics["eval/acc_0"], metrics["eval/loss"])
        return metrics

    def save() -> None:
        extra = {"name": cfg.name, "aux_layer_ids": aux_ids}
        if hasattr(drafter, "d2t"):
            extra["vocab_mapping"] = (drafter.d2t.clone(), drafter.t2d.clone())
        save_checkpoint(out_dir, step, drafter, optimizer, scheduler, sampler.state_dict(), extra,
                        t.keep_checkpoints)

    if step == 0:
        run_eval()
    crash_after = int(os.environ.get("TORCHSPEC_CRASH_AFTER_STEP", "-1"))
    stats, tick = StepStats(), time.time()
    bar = tqdm(total=t.max_steps, initial=step, desc="train", dynamic_ncols=True, mininterval=2)
    while step < t.max_steps:
        micro = [collate([train_set[i] for i in sampler.next_batch()], pad_id) for _ in range(t.grad_accum)]
        grad_norm = train_step(target, drafter, optimizer, scheduler, micro, opts, t.max_grad_norm, amp_dtype, stats)
        step += 1
        bar.update(1)
        if step % t.log_every == 0 or step == t.max_steps:
            metrics = stats.summary("train")
            metrics.update({"train/lr": scheduler.get_last_lr()[0], "train/grad_norm": float(grad_norm),
                            "train/tokens_per_s": stats.tokens / (time.time() - tick), "train/epoch": sampler.epoch})
            logger.log(step, metrics)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", acc0=f"{metrics['train/acc_0']:.2f}",
                            al=f"{metrics['train/acceptance_length']:.2f}")
            stats, tick = StepStats(), time.time()
        if t.eval_every and step % t.eval_every == 0 and step < t.max_steps:
            run_eval()
        if t.save_every and step % t.save_every == 0 and step < t.max_steps:
            save()
        if step == crash_after:  # test hook: die like a killed job, with no cleanup at all
            os._exit(17)
    bar.close()

    final = run_eval()
    save()
    atomic_save_dir(out_dir / "drafter", lambda tmp: drafter.save_pretrained(tmp))
    logger.close()
    if t.plot and (out_dir / "metrics.jsonl").exists():
        plot_metrics(out_dir / "metrics.jsonl", out_dir / "training.png")
    log.info("done in %.1fs: held-out acceptance length %.3f; drafter saved to %s",
             time.time() - started, final["eval/acceptance_length"], out_dir / "drafter")


if __name__ == "__main__":
    main()
