"""Train a drafter on hidden states captured online from a frozen target.

    torchspec-train                                # default job: EAGLE-4 for SmolLM2-135M on ShareGPT, CPU
    torchspec-train target=hf target.path=/ckpt/Qwen3-8B train=gpu data=sharegpt drafter=eagle4
    torchrun --nproc_per_node=8 recipes/train.py parallel=tp4_fsdp2 target=hf target.path=/ckpt/Qwen3-32B

One launch owns everything: world = dp x tp; the target is tensor-parallel over groups of
``parallel.target_tp`` consecutive ranks, the drafter data-parallel over every rank (engine
``none`` | ``fsdp2`` | ``deepspeed``), and every rank trains on its own sequences.
Read top to bottom: config -> distributed -> checks (target config, tokenizer, data; nothing is written before
they pass) -> output dir -> target -> drafter -> engine -> resume -> loop -> save.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file
from tqdm import tqdm

from torchspec.cli import user_errors
from torchspec.config import Config, validate_against_target
from torchspec.data import Example, ResumableBatchSampler, build_datasets, collate, shard_for_rank
from torchspec.data.packing import pack_examples
from torchspec.data.prepared import is_prepared_dir, load_train_rows, read_manifest
from torchspec.distributed import (
    DistInfo,
    all_reduce_sum,
    barrier,
    build_mesh,
    close_distributed,
    init_distributed,
    is_rank0,
    seed_everything,
)
from torchspec.export.serving import export_drafter, is_export, load_exported_drafter, target_identity
from torchspec.models import build_drafter
from torchspec.targets import TargetDecoder, load_target_config, load_tokenizer, resolve_target_path
from torchspec.train.checkpoint import (
    find_resume_checkpoint,
    finish_checkpoint,
    load_checkpoint,
    publish_if_written,
    save_checkpoint,
)
from torchspec.train.compose import build_config, compose_config, train_help
from torchspec.train.engine import OptimConfig, build_engine
from torchspec.train.metrics import MetricsLogger, plot_metrics
from torchspec.train.optim import resolve_precision, resolve_target_dtype, warmup_cosine
from torchspec.train.run_dir import (
    DONE,
    LOG_FORMAT,
    StallWatch,
    WallClockLimit,
    check_output_dir,
    claim_output_dir,
    finished_run,
    log_file,
    mark_done,
)
from torchspec.train.step import StepStats, TTTOptions, evaluate, train_step
from torchspec.train.ttt import HeadLossConfig

log = logging.getLogger("torchspec.train")


def build_target(cfg: Config, info: DistInfo, mesh) -> tuple[TargetDecoder, str, list[int]]:
    """Built on meta, then each rank reads only its slices: the whole target at tp=1, else its tp group's shard."""
    path = resolve_target_path(cfg.target.path, os.path.expanduser(cfg.target.cache_dir))
    aux_ids = validate_against_target(cfg, load_target_config(path))  # before any weight loads
    dtype = resolve_target_dtype(cfg.target.dtype, info.device)
    tp_group = mesh["tp"].get_group() if cfg.parallel.target_tp > 1 else None
    target = TargetDecoder.from_pretrained(path, aux_layer_ids=aux_ids, dtype=dtype, device=info.device,
                                           tp_group=tp_group)
    return target, path, aux_ids


def pack_train_set(data_path: str, train_set: list[Example], max_length: int) -> list[Example]:
    """data.pack: several conversations per training row (the held-out set stays one per row). A prepared
    directory packed at preparation already holds these rows, ``pack_examples`` of its training examples
    with the same max_length (build_datasets checked its data.* values): they are read, not packed again."""
    if is_prepared_dir(data_path) and read_manifest(data_path)["identity"]["data"]["pack"]:
        return load_train_rows(data_path)
    return pack_examples(train_set, max_length)


def build_model(cfg: Config, target: TargetDecoder, aux_ids: list[int], train_set):
    drafter = build_drafter(cfg.drafter, target.config, aux_ids)
    fitted = drafter.fit_vocab(train_set)  # EAGLE-3: pruned draft vocabulary from the train split only
    if fitted:
        log.info(fitted)
    drafter.init_from_target(target.embed_tokens_weight, target.lm_head_weight, cfg.drafter.init_lm_head_from_target)
    if cfg.train.init_from:
        load_initial_weights(drafter, cfg.train.init_from, target)
    drafter.lm_head.weight.requires_grad_(not cfg.drafter.freeze_lm_head)
    return drafter.float().train()


def load_initial_weights(drafter, path: str, target: TargetDecoder) -> None:
    """train.init_from: copy every weight (and an EAGLE-3 vocab mapping) from a saved drafter whose
    architecture equals the configured one (its config.json was checked before anything was written,
    in ``train``); the target pairing is checked for exports."""
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


def main(argv: list[str] | None = None) -> None:
    """``torchspec-train [group=option | key=value ...]``: Hydra overrides of torchspec/conf/train.yaml.

    Composed with Hydra's compose API, not ``@hydra.main``: hydra.main creates its run directory (here
    train.output_dir) before the recipe validates anything, and reports its own errors in several lines
    with exit 1. Here nothing is written before validation and every user error is one line, exit 2
    (torchspec/cli.py); ``TORCHSPEC_DEBUG=1`` (or ``--debug``) shows the traceback instead."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(train_help(__doc__))
        return
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stdout)
    handlers = list(logging.getLogger().handlers)
    try:
        with user_errors("torchspec-train", debug="--debug" in argv):
            train(compose_config([a for a in argv if a != "--debug"]))
        close_distributed()  # a finished run only: a failing rank exits without waiting on the others
    finally:  # the run's train.log handler (see train) goes with the run
        for handler in set(logging.getLogger().handlers) - set(handlers):
            logging.getLogger().removeHandler(handler)
            handler.close()


def train(raw: DictConfig) -> None:
    cfg = build_config(raw)
    t = cfg.train
    check_output_dir(raw, t.output_dir)  # before anything else: an existing run's directory is not for another run
    if (finished := finished_run(cfg)) is not None:  # touches no file, loads nothing
        if os.environ.get("RANK", "0") == "0":
            print(finished)
        return
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    info = init_distributed(timeout_minutes=cfg.parallel.dist_timeout_minutes)
    mesh = build_mesh(info.world_size, cfg.parallel.target_tp, info.device.type)
    tp_group = mesh["tp"].get_group() if cfg.parallel.target_tp > 1 else None
    rank0 = is_rank0()

    started = time.time()
    # Everything a user can get wrong is checked before the output directory is touched and before a
    # weight loads: the target's config (aux ids, sizes), its tokenizer, the data, the resume source.
    target_path = resolve_target_path(cfg.target.path, os.path.expanduser(cfg.target.cache_dir))
    validate_against_target(cfg, load_target_config(target_path))
    resume_from = find_resume_checkpoint(t.output_dir, t.resume)  # verified (hashed) once, here
    if t.init_from and not (Path(t.init_from) / "config.json").is_file():
        raise ValueError(f"train.init_from={t.init_from!r}: no config.json there; pass a drafter directory "
                         f"(save_pretrained, torchspec-export or torchspec-convert output).")
    tokenizer = load_tokenizer(target_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    d = cfg.data
    train_set, eval_set, skips = build_datasets(
        d.path, tokenizer, fmt=d.format, max_length=d.max_length, eval_size=d.eval_size, seed=d.seed,
        max_conversations=d.max_conversations, on_too_long=d.on_too_long, chat_template=d.chat_template,
        dedup=d.dedup, eval_path=d.eval_path)
    conversations = len(train_set)
    if d.pack:
        train_set = pack_train_set(d.path, train_set, d.max_length)
    global_batch = t.micro_batch_size * info.world_size  # every rank takes its own micro_batch_size rows
    sampler = ResumableBatchSampler(len(train_set), global_batch, seed=t.seed)

    out_dir = Path(t.output_dir)
    if rank0:  # validated: now the run may write
        claim_output_dir(raw, t.output_dir)
        logging.getLogger().addHandler(log_file(out_dir / "train.log"))
    log.info("data: %d train / %d held-out sequences; %s", conversations, len(eval_set), skips.summary())
    if d.pack:
        log.info("data.pack: %d training rows of up to %d tokens", len(train_set), d.max_length)
    target, target_path, aux_ids = build_target(cfg, info, mesh)
    log.info("target %s: %d layers, hidden %d, vocab %d, aux layers %s; world %d = dp %d x tp %d",
             target_path, target.num_layers, target.hidden_size, target.vocab_size, aux_ids,
             info.world_size, info.world_size // cfg.parallel.target_tp, cfg.parallel.target_tp)

    seed_everything(t.seed)  # the same drafter initialisation on every rank
    drafter = build_model(cfg, target, aux_ids, train_set)
    log.info("drafter %s: %.1fM trainable parameters", cfg.drafter.arch,
             sum(p.numel() for p in drafter.parameters() if p.requires_grad) / 1e6)
    engine = build_train_engine(cfg, drafter, info)
    held_out = eval_batches(eval_set, t.micro_batch_size, pad_id, t.eval_batches, info)
    held_out_captures: dict = {}  # the frozen target's outputs on held_out, reused by later evals
    moe = cfg.drafter.moe
    opts = TTTOptions(t.ttt_steps, t.step_decay, cfg.drafter.moe_aux_loss_coef if moe else 0.0,
                      cfg.drafter.moe_bias_rate if moe else 0.0, cfg.drafter.lowrank_coef, cfg.drafter.lowrank_teacher,
                      HeadLossConfig(t.loss_chunk_gib, t.loss_backend, cfg.drafter.head_loss,
                                     cfg.drafter.head_loss_target_topk))

    step = 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, engine, global_batch)
        sampler.load_state_dict({k: state["sampler"][k] for k in ("epoch", "position")})
        if "vocab_mapping" in state["extra"]:  # refused loudly if today's data gives another mapping
            engine.drafter.set_vocab_mapping(*state["extra"]["vocab_mapping"])
        step = state["step"]
        log.info("resumed from %s at step %d", resume_from, step)
    trained_tokens = state["extra"].get("train_tokens", 0) if resume_from is not None else 0  # real, all ranks
    logger = MetricsLogger(out_dir, t.report_to, OmegaConf.to_container(raw, resolve=True), t.wandb_project,
                           cfg.name, resume_step=step if resume_from else None, enabled=rank0)
    log.info("setup took %.1fs", time.time() - started)

    state_bytes = 3 * sum(p.numel() * p.element_size() for p in engine.drafter.parameters() if p.requires_grad)
    limit = WallClockLimit(started, t.max_wall_s, state_bytes)  # weights + Adam's two moments
    stall = StallWatch(t.stall_dump_s, out_dir / (f"stalls_rank{info.rank}.txt" if info.world_size > 1 else "stalls.txt"))

    def run_eval() -> dict[str, float]:
        began = time.time()
        metrics = evaluate(target, engine, held_out, opts, tp_group, held_out_captures)
        limit.eval_s = time.time() - began
        logger.log(step, metrics)
        log.info("step %d held-out: acceptance length %.3f, acc_0 %.3f, loss %.4f",
                 step, metrics["eval/acceptance_length"], metrics["eval/acc_0"], metrics["eval/loss"])
        return metrics

    def save(final_eval: dict[str, float] | None = None, sync: bool = False) -> None:
        extra = {"name": cfg.name, "aux_layer_ids": aux_ids, "train_tokens": trained_tokens}
        mapping = engine.drafter.vocab_mapping()  # EAGLE-3's (d2t, t2d); None for a full-vocabulary head
        if mapping is not None:
            extra["vocab_mapping"] = tuple(m.detach().cpu().clone() for m in mapping)
        if final_eval is not None:  # already in metrics.jsonl: a resume from this checkpoint must not log it again
            extra["final_eval"] = {k: float(v) for k, v in final_eval.items()}
        # The final checkpoint is written synchronously: the export and DONE come only after it is published.
        began = time.time()
        save_checkpoint(out_dir, step, engine, {**sampler.state_dict(), "batch_size": global_batch}, extra,
                        t.keep_checkpoints, async_save=t.async_checkpoint and final_eval is None and not sync)
        if sync or not t.async_checkpoint:
            limit.save_s = time.time() - began

    def out_of_time() -> bool:
        """train.max_wall_s, decided alike on every rank (any rank's clock can stop the run)."""
        eval_next = bool(t.eval_every) and step // t.eval_every != (step + t.log_every) // t.eval_every
        stop = torch.tensor([float(limit.should_stop(time.time(), eval_next))], device=info.device)
        return bool(all_reduce_sum(stop).item() > 0)

    start_step = step  # >= max_steps: resumed from the final checkpoint, the end of the run is what is left
    if rank0 and step < t.max_steps:
        (out_dir / DONE).unlink(missing_ok=True)  # a finished run continued (train.max_steps raised) or restarted
    if step == 0:
        run_eval()
    crash_after = int(os.environ.get("TORCHSPEC_CRASH_AFTER_STEP", "-1"))
    stats, tick = StepStats(), time.time()
    bar = tqdm(total=t.max_steps, initial=step, desc="train", dynamic_ncols=True, mininterval=2, disable=not rank0)
    stall.beat()
    while step < t.max_steps:
        micro = [to_device(collate([train_set[i] for i in shard_for_rank(sampler.next_batch(), info.rank, info.world_size)],
                                   pad_id, packed=d.pack), info.device) for _ in range(t.grad_accum)]
        grad_norm = train_step(target, engine, micro, opts, stats, tp_group)
        step += 1
        stall.beat()
        bar.update(1)
        if step % t.log_every == 0 or step == t.max_steps:
            stats.all_reduce()
            metrics = stats.summary("train")
            trained_tokens += int(stats.tokens) * info.world_size
            limit.interval_s = time.time() - tick
            metrics.update({"train/lr": engine.lr, "train/grad_norm": float(grad_norm),
                            "train/tokens_per_s": float(stats.tokens) * info.world_size / (time.time() - tick),
                            "train/tokens": trained_tokens, "train/epoch": sampler.epoch})
            logger.log(step, metrics)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", acc0=f"{metrics['train/acc_0']:.2f}",
                            al=f"{metrics['train/acceptance_length']:.2f}")
            stats, tick = StepStats(), time.time()
            publish_if_written()  # an async checkpoint whose write has finished
        if t.eval_every and step % t.eval_every == 0 and step < t.max_steps:
            run_eval()
        if t.save_every and step % t.save_every == 0 and step < t.max_steps:
            save()
        if step == crash_after:  # test hook: die like a killed job, with no cleanup at all
            os._exit(17)
        if t.max_wall_s and step % t.log_every == 0 and step < t.max_steps and out_of_time():
            if not (t.save_every and step % t.save_every == 0):  # this step has no checkpoint yet
                save(sync=True)
            finish_checkpoint()  # publishes an asynchronous save of this step once written
            bar.close()
            logger.close()
            log.info("train.max_wall_s=%g: stopped at step %d after %.0f s with its checkpoint in %s; rerun the "
                     "same command to resume", t.max_wall_s, step, time.time() - started, out_dir / "checkpoints")
            stall.close()
            barrier()
            return
    bar.close()
    stall.close()

    # The end, in an order a kill at any moment can be resumed from without repeating a line of
    # metrics.jsonl: final eval (logged) -> final checkpoint (records that eval) -> serving export ->
    # DONE. A rerun killed after the final checkpoint resumes at max_steps and only exports and marks.
    if resume_from is not None and step == start_step and "final_eval" in state["extra"]:
        final = state["extra"]["final_eval"]
        log.info("step %d: the final checkpoint's held-out eval is logged already; writing the export", step)
    else:
        final = run_eval()
        save(final_eval=final)
    dtype = "float32" if resolve_precision(t.precision, info.device) is None else "bfloat16"
    export_for_serving(cfg, engine, target, aux_ids, out_dir / "drafter", dtype,
                       training={"step": step, "train_tokens": trained_tokens})
    logger.close()
    if rank0:
        if t.plot and (out_dir / "metrics.jsonl").exists():
            plot_metrics(out_dir / "metrics.jsonl", out_dir / "training.png")
        mark_done(out_dir, step, final)
    log.info("done in %.1fs: held-out acceptance length %.3f; serving export in %s",
             time.time() - started, final["eval/acceptance_length"], out_dir / "drafter")
    barrier()


def export_for_serving(cfg: Config, engine, target, aux_ids: list[int], path: Path, dtype: str,
                       training: dict[str, int]) -> None:
    """Collective: gather the full drafter weights; rank 0 writes the serving export (the format of
    torchspec-export: strict config.json + model.safetensors + target fingerprint), atomically."""
    state = engine.drafter_state_dict()
    if is_rank0():
        drafter = build_drafter(cfg.drafter, target.config, aux_ids)
        drafter.load_state_dict(state, strict=True)
        if path.is_dir() and any(path.iterdir()) and not is_export(path):
            shutil.rmtree(path)  # the save_pretrained drafter/ of a run trained before exports were written here
        export_drafter(drafter, path, dtype=dtype, target_identity=target_identity(target), training=training)


if __name__ == "__main__":
    main()
