"""Train a drafter on hidden states captured online from a frozen target.

    torchspec-train                                # default job: EAGLE-4 for SmolLM2-135M on ShareGPT, CPU
    torchspec-train target=hf target.path=/ckpt/Qwen3-8B train=gpu data=sharegpt drafter=eagle4
    torchrun --nproc_per_node=8 recipes/train.py parallel=tp4_fsdp2 target=hf target.path=/ckpt/Qwen3-32B

One launch owns everything: world = dp x tp; the target is tensor-parallel over groups of
``parallel.target_tp`` consecutive ranks, the drafter data-parallel over every rank (engine
``none`` | ``fsdp2`` | ``deepspeed``), and every rank trains on its own sequences.
Read top to bottom: config -> distributed -> target -> data -> drafter -> engine -> resume -> loop -> save.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file
from tqdm import tqdm

from torchspec.config import Config, register_configs, validate_against_target, validate_config
from torchspec.data import ResumableBatchSampler, build_datasets, collate, shard_for_rank
from torchspec.data.packing import pack_examples
from torchspec.data.vocab import build_vocab_mapping, token_frequencies, vocab_coverage
from torchspec.distributed import DistInfo, barrier, build_mesh, init_distributed, is_rank0, seed_everything
from torchspec.export.serving import is_export, load_exported_drafter
from torchspec.io import atomic_save_dir, atomic_write_text
from torchspec.models import build_drafter
from torchspec.target import TargetModel, load_target_config, load_tokenizer, resolve_target_path
from torchspec.target.parallelize import load_tp_target
from torchspec.train.checkpoint import find_resume_checkpoint, load_checkpoint, save_checkpoint
from torchspec.train.engine import OptimConfig, build_engine
from torchspec.train.metrics import MetricsLogger, plot_metrics
from torchspec.train.optim import resolve_precision, resolve_target_dtype, warmup_cosine
from torchspec.train.step import StepStats, TTTOptions, evaluate, train_step
from torchspec.train.ttt import HeadLossConfig

log = logging.getLogger("torchspec.train")
register_configs()


def build_config(raw: DictConfig) -> Config:
    cfg: Config = OmegaConf.to_object(raw)
    validate_config(cfg)
    return cfg


def build_target(cfg: Config, info: DistInfo, mesh) -> tuple[TargetModel, str, list[int]]:
    """tp=1: the whole target on this rank. tp>1: built on meta, sharded, and each rank reads only its shards."""
    path = resolve_target_path(cfg.target.path, os.path.expanduser(cfg.target.cache_dir))
    aux_ids = validate_against_target(cfg, load_target_config(path))  # before any weight loads
    dtype = resolve_target_dtype(cfg.target.dtype, info.device)
    if cfg.parallel.target_tp > 1:
        return load_tp_target(path, mesh["tp"], aux_layer_ids=aux_ids, dtype=dtype), path, aux_ids
    return TargetModel.from_pretrained(path, aux_layer_ids=aux_ids, dtype=dtype).to(info.device), path, aux_ids


def build_model(cfg: Config, target: TargetModel, aux_ids: list[int], train_set):
    drafter = build_drafter(cfg.drafter, target.config, aux_ids)
    if hasattr(drafter, "set_vocab_mapping"):  # pruned draft vocabulary (EAGLE-3), from the train split only
        freqs = token_frequencies(train_set, target.vocab_size)
        d2t, t2d = build_vocab_mapping(freqs, drafter.config.draft_vocab_size)
        drafter.set_vocab_mapping(d2t, t2d)
        log.info("draft vocabulary %d / %d covers %.1f%% of assistant tokens", drafter.config.draft_vocab_size,
                 target.vocab_size, 100 * vocab_coverage(freqs, t2d))
    drafter.init_from_target(target.embed_tokens_weight, target.lm_head_weight, cfg.drafter.init_lm_head_from_target)
    if cfg.train.init_from:
        load_initial_weights(drafter, cfg.train.init_from, target)
    drafter.lm_head.weight.requires_grad_(not cfg.drafter.freeze_lm_head)
    return drafter.float().train()


def load_initial_weights(drafter, path: str, target: TargetModel) -> None:
    """train.init_from: copy every weight (and an EAGLE-3 vocab mapping) from a saved drafter whose
    architecture equals the configured one; the target pairing is checked for exports."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"train.init_from={path!r}: no config.json there; pass a drafter directory "
                         f"(save_pretrained, torchspec-export or torchspec-convert output).")
    if is_export(path):
        source = load_exported_drafter(path, target=target)  # strict keys and shapes, target fingerprint
        config, state = source.config, source.state_dict()
    else:  # save_pretrained / torchspec-convert output: strict config keys; tensors checked below
        config = type(drafter.config).from_pretrained(path)
        state = load_file(str(Path(path) / "model.safetensors"))
    mine, theirs = drafter.config.to_dict(), config.to_dict()
    differ = sorted(k for k in type(drafter.config).ARCH_FIELDS if mine.get(k) != theirs.get(k))
    if type(config) is not type(drafter.config) or differ:
        raise ValueError(f"train.init_from={path!r} holds a {type(config).__name__} drafter that differs from the "
                         f"configured {type(drafter.config).__name__} in {differ}; set the drafter config to match it.")
    expected = drafter.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    misshaped = sorted(k for k in set(expected) & set(state) if expected[k].shape != state[k].shape)
    if missing or unexpected or misshaped:
        raise ValueError(f"train.init_from={path!r}: missing tensors {missing[:8]}, unexpected {unexpected[:8]}, "
                         f"mis-shaped {misshaped[:8]}; it was not written for this drafter config.")
    if hasattr(drafter, "set_vocab_mapping"):
        drafter.set_vocab_mapping(state["d2t"], state["t2d"], force=True)  # the weights come with their mapping
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    log.info("initialised all drafter weights from %s (weights only; optimizer and schedule start fresh)", path)


def build_train_engine(cfg: Config, drafter, info: DistInfo):
    t, p = cfg.train, cfg.parallel
    if p.engine == "none" and info.world_size > 1:
        raise ValueError(f"parallel.engine=none trains one unsharded copy without reducing gradients, but WORLD_SIZE="
                         f"{info.world_size}; use parallel=fsdp2 or parallel=deepspeed.")
    amp = resolve_precision(t.precision, info.device)
    optim = OptimConfig(lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas), max_grad_norm=t.max_grad_norm,
                        micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum)
    schedule = functools.partial(warmup_cosine, warmup_steps=t.warmup_steps, max_steps=t.max_steps,
                                 min_lr_ratio=t.min_lr_ratio)
    return build_engine(p.engine, drafter.to(info.device), optim, schedule, mesh=None,
                        precision="bf16" if amp is not None else "fp32",
                        ds_config=dict(p.deepspeed) or None, zero_stage=p.zero_stage,
                        compile_layer=t.compile_layer)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def eval_batches(eval_set, batch_size: int, pad_id: int, limit: int | None, info: DistInfo) -> list[dict]:
    """This rank's share of the held-out set; every rank gets the same number of batches (the
    forward of a sharded drafter and of a TP target are collectives)."""
    usable = len(eval_set) // info.world_size * info.world_size
    if usable == 0:
        raise ValueError(f"data.eval_size={len(eval_set)} is smaller than WORLD_SIZE={info.world_size}; raise it.")
    mine = shard_for_rank(list(range(usable)), info.rank, info.world_size)
    batches = [collate([eval_set[i] for i in mine[j : j + batch_size]], pad_id) for j in range(0, len(mine), batch_size)]
    batches = batches[:limit] if limit else batches
    return [to_device(b, info.device) for b in batches]


CONF_DIR = "pkg://torchspec.conf"  # the configs ship inside the package (pip install . works)


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
    info = init_distributed(timeout_minutes=cfg.parallel.dist_timeout_minutes)
    mesh = build_mesh(info.world_size, cfg.parallel.target_tp, info.device.type)
    tp_group = mesh["tp"].get_group() if cfg.parallel.target_tp > 1 else None
    rank0 = is_rank0()
    out_dir = Path(t.output_dir)
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(raw, resolve=True))

    started = time.time()
    target, target_path, aux_ids = build_target(cfg, info, mesh)
    log.info("target %s: %d layers, hidden %d, vocab %d, aux layers %s; world %d = dp %d x tp %d",
             target_path, target.num_layers, target.hidden_size, target.vocab_size, aux_ids,
             info.world_size, info.world_size // cfg.parallel.target_tp, cfg.parallel.target_tp)
    tokenizer = load_tokenizer(target_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    d = cfg.data
    train_set, eval_set, skips = build_datasets(
        d.path, tokenizer, fmt=d.format, max_length=d.max_length, eval_size=d.eval_size, seed=d.seed,
        max_conversations=d.max_conversations, on_too_long=d.on_too_long, chat_template=d.chat_template)
    log.info("data: %d train / %d held-out sequences; %s", len(train_set), len(eval_set), skips.summary())
    if d.pack:  # several conversations per training row; the held-out set stays one per row
        train_set = pack_examples(train_set, d.max_length)
        log.info("data.pack: %d training rows of up to %d tokens", len(train_set), d.max_length)

    seed_everything(t.seed)  # the same drafter initialisation on every rank
    drafter = build_model(cfg, target, aux_ids, train_set)
    log.info("drafter %s: %.1fM trainable parameters", cfg.drafter.arch,
             sum(p.numel() for p in drafter.parameters() if p.requires_grad) / 1e6)
    engine = build_train_engine(cfg, drafter, info)
    global_batch = t.micro_batch_size * info.world_size  # every rank takes its own micro_batch_size rows
    sampler = ResumableBatchSampler(len(train_set), global_batch, seed=t.seed)
    held_out = eval_batches(eval_set, t.micro_batch_size, pad_id, t.eval_batches, info)
    held_out_captures: dict = {}  # the frozen target's outputs on held_out, reused by later evals
    opts = TTTOptions(t.ttt_steps, t.step_decay, cfg.drafter.moe_aux_loss_coef if cfg.drafter.moe else 0.0,
                      cfg.drafter.lowrank_coef, cfg.drafter.lowrank_teacher,
                      HeadLossConfig(t.loss_chunk_gib, t.loss_backend))

    step = 0
    resume_from = find_resume_checkpoint(out_dir, t.resume)
    if resume_from is not None:
        state = load_checkpoint(resume_from, engine, global_batch)
        sampler.load_state_dict({k: state["sampler"][k] for k in ("epoch", "position")})
        if "vocab_mapping" in state["extra"]:  # refused loudly if today's data gives another mapping
            engine.drafter.set_vocab_mapping(*state["extra"]["vocab_mapping"])
        step = state["step"]
        log.info("resumed from %s at step %d", resume_from, step)
    logger = MetricsLogger(out_dir, t.report_to, OmegaConf.to_container(raw, resolve=True), t.wandb_project,
                           cfg.name, resume_step=step if resume_from else None, enabled=rank0)
    log.info("setup took %.1fs", time.time() - started)

    def run_eval() -> dict[str, float]:
        metrics = evaluate(target, engine, held_out, opts, tp_group, held_out_captures)
        logger.log(step, metrics)
        log.info("step %d held-out: acceptance length %.3f, acc_0 %.3f, loss %.4f",
                 step, metrics["eval/acceptance_length"], metrics["eval/acc_0"], metrics["eval/loss"])
        return metrics

    def save() -> None:
        extra = {"name": cfg.name, "aux_layer_ids": aux_ids}
        if hasattr(engine.drafter, "d2t"):
            extra["vocab_mapping"] = (engine.drafter.d2t.detach().cpu().clone(), engine.drafter.t2d.detach().cpu().clone())
        save_checkpoint(out_dir, step, engine, {**sampler.state_dict(), "batch_size": global_batch}, extra,
                        t.keep_checkpoints)

    if step == 0:
        run_eval()
    crash_after = int(os.environ.get("TORCHSPEC_CRASH_AFTER_STEP", "-1"))
    stats, tick = StepStats(), time.time()
    bar = tqdm(total=t.max_steps, initial=step, desc="train", dynamic_ncols=True, mininterval=2, disable=not rank0)
    while step < t.max_steps:
        micro = [to_device(collate([train_set[i] for i in shard_for_rank(sampler.next_batch(), info.rank, info.world_size)],
                                   pad_id), info.device) for _ in range(t.grad_accum)]
        grad_norm = train_step(target, engine, micro, opts, stats, tp_group)
        step += 1
        bar.update(1)
        if step % t.log_every == 0 or step == t.max_steps:
            stats.all_reduce()
            metrics = stats.summary("train")
            metrics.update({"train/lr": engine.lr, "train/grad_norm": float(grad_norm),
                            "train/tokens_per_s": float(stats.tokens) * info.world_size / (time.time() - tick),
                            "train/epoch": sampler.epoch})
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
    export_drafter(cfg, engine, target, aux_ids, train_set, out_dir / "drafter")
    logger.close()
    if rank0 and t.plot and (out_dir / "metrics.jsonl").exists():
        plot_metrics(out_dir / "metrics.jsonl", out_dir / "training.png")
    log.info("done in %.1fs: held-out acceptance length %.3f; drafter saved to %s",
             time.time() - started, final["eval/acceptance_length"], out_dir / "drafter")
    barrier()


def export_drafter(cfg: Config, engine, target, aux_ids: list[int], train_set, path: Path) -> None:
    """Collective: gather the full drafter weights; rank 0 writes them in save_pretrained format."""
    state = engine.drafter_state_dict()
    if is_rank0():
        drafter = build_drafter(cfg.drafter, target.config, aux_ids)
        drafter.load_state_dict(state, strict=True)
        atomic_save_dir(path, lambda tmp: drafter.save_pretrained(tmp))


if __name__ == "__main__":
    main()
