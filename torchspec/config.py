"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore, and validation.

``torchspec/conf/train.yaml`` composes one file from each group (``drafter/``, ``target/``, ``data/``,
``train/``, ``parallel/``) on top of the ``train_schema`` node stored here, so every key is typed
and an unknown key is an error at composition time. ``validate_config`` then checks the values
that need more than a type (ranges, choices, combinations) and ``validate_against_target`` the
ones that need the target's config.json — all before any weight is loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore

from torchspec.models import DRAFTERS, all_drafter_keys, arch_display_name, drafter_keys


@dataclass
class TargetConfig:
    # "smollm2" (the bundled real chat model), a HF checkpoint directory, or a .gguf file.
    path: str = "smollm2"
    # Captured layers: id i = residual stream after decoder layer i (0-indexed).
    # null -> [1, L//2 - 1, L - 4].
    aux_layer_ids: list[int] | None = None
    dtype: str = "float32"  # float32 | bfloat16 | auto (bf16 on CUDA and AMX CPUs): the frozen target's weights
    cache_dir: str = "~/.cache/torchspec"  # where GGUF files are converted to safetensors once


@dataclass
class DrafterTrainingConfig:
    """The drafter.* keys that are training settings, not architecture (never in config.json)."""

    arch: str = "eagle4"  # key of torchspec.models.DRAFTERS: eagle4 | eagle3
    # auto (flex on CUDA, chunked elsewhere) | chunked (SDPA per query block) | flex (CUDA) | eager (reference)
    attn_backend: str = "auto"
    lowrank_coef: float = 1.0  # weight of the efficient head scorer's distillation loss (needs lm_head_rank)
    lowrank_teacher: str = "target"  # target (its distribution) | full (the drafter's full head)
    # The full head's loss (needs lm_head_rank): full (KL over all of V) | candidates (KL over the scorer's
    # top-k joined to the target's top-m, renormalised: the only tokens the drafter can propose; under
    # evaluation, torchspec/train/loss_candidates.py)
    head_loss: str = "full"
    head_loss_target_topk: int = 128  # m of head_loss=candidates
    moe_aux_loss_coef: float = 0.01  # MoE load-balancing loss weight (needs moe)
    # MoE loss-free balancing (needs moe): each optimizer step moves every expert's routing bias by this
    # much towards balance (torchspec/models/moe.py); 0 = off
    moe_bias_rate: float = 0.0
    init_lm_head_from_target: bool = True
    freeze_lm_head: bool = False


# Training keys every architecture reads, and those that tune one architecture feature (used by the
# architectures that declare that flag).
_ALWAYS_USED = {"arch", "attn_backend", "init_lm_head_from_target", "freeze_lm_head"}
_TRAINING_KEY_FEATURE = {"lowrank_coef": "lm_head_rank", "lowrank_teacher": "lm_head_rank", "head_loss": "lm_head_rank",
                         "head_loss_target_topk": "lm_head_rank", "moe_aux_loss_coef": "moe",
                         "moe_bias_rate": "moe"}

# drafter.*: the training keys above plus every architecture flag, DERIVED from the model configs'
# ARCH_FIELDS (torchspec/models/eagle4.py, eagle3.py: the one place a flag, its default and meaning
# are declared). Defaults are EAGLE-4's; sizes default to null = the target's.
DrafterConfig = make_dataclass(
    "DrafterConfig",
    [(name, flag.annotation, field(default=flag.default)) for name, flag in all_drafter_keys().items()],
    bases=(DrafterTrainingConfig,),
)
DrafterConfig.__module__ = __name__
DrafterConfig.__doc__ = "The drafter group: training keys plus the flags of every architecture (see above)."


@dataclass
class DataConfig:
    # "sharegpt" (bundled ShareGPT V3), a .jsonl / .json file, a data_pipelines.regenerate output directory,
    # or a data_pipelines.prepare output directory (read as prepared: no tokenisation; docs/data_pipelines.md)
    path: str = "sharegpt"
    format: str = "auto"  # auto | messages | sharegpt
    max_length: int = 2048
    on_too_long: str = "truncate"  # truncate | skip
    # Training rows hold several conversations (best-fit, up to max_length tokens) with per-document
    # positions and masks, so micro-batches carry almost no padding; the held-out set stays unpacked.
    pack: bool = False
    max_conversations: int | None = None  # read at most this many usable conversations
    eval_size: int = 64  # held-out conversations, fixed by seed
    # Held-out conversations from their own file or regeneration directory (its first eval_size), e.g.
    # MT-Bench answered by the target (tools/heldout_conversations.py + data_pipelines.regenerate), instead
    # of a split of data.path: the held-out metric then measures the prompts serving is judged on.
    eval_path: str | None = None
    seed: int = 0
    # Drop exact duplicate examples (same token ids and mask; the first stays) before the split: greedy
    # regeneration makes ShareGPT's repeated prompts identical conversations, and a held-out copy of a
    # training conversation inflates held-out acceptance.
    dedup: bool = True
    chat_template: str | None = None  # override the tokenizer's Jinja chat template


@dataclass
class TrainConfig:
    output_dir: str = "outputs/default"
    ttt_steps: int = 7
    step_decay: float = 0.8
    micro_batch_size: int = 4
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 0.5
    # auto (bf16 on CUDA and AMX CPUs, else fp32) | bf16 | fp32. bf16: bf16 parameters, fp32 master weights and
    # gradient accumulation in the optimizer (torchspec/train/optim.py).
    precision: str = "auto"
    # Fused LM-head loss (torchspec/train/loss.py): transient memory of one chunk of positions
    # (its logits and logit gradients) and the row-pass backend (auto: Triton on CUDA, else torch).
    loss_chunk_gib: float = 4.0
    loss_backend: str = "auto"  # auto | triton | torch
    compile_layer: bool = False  # torch.compile the drafter's decoder layer (H200, qwen3-8b: -1.5% step time)
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200  # 0: only at step 0 and at the end
    eval_batches: int | None = None  # null: the whole held-out set
    save_every: int = 500  # 0: only at the end
    keep_checkpoints: int = 2
    async_checkpoint: bool = False  # none/fsdp2: write checkpoints in a background thread (published once complete)
    resume: str = "auto"  # auto (latest in output_dir if any) | never | <checkpoint dir>
    # Weights-only start (unlike resume: no optimizer, schedule, data position or step): a drafter
    # directory written by save_pretrained, torchspec-export or torchspec-convert.
    init_from: str | None = None
    report_to: str = "wandb"  # wandb (offline unless WANDB_MODE says otherwise) | none
    wandb_project: str = "torchspec"
    num_threads: int | None = None  # torch CPU threads; null: torch's default
    # Stop cleanly before this many seconds since start (a job's time limit): at a log step, when the next
    # interval would not fit, a synchronous checkpoint and exit 0 without DONE; rerun to resume. null: none.
    max_wall_s: float | None = None
    # A diagnostic: when no training step ends within this many seconds, every thread's Python stack is
    # written to <output_dir>/stalls.txt (again each further period); the run goes on. null: off.
    stall_dump_s: float | None = None
    plot: bool = True


@dataclass
class ParallelConfig:
    # world = dp x tp (torchrun's WORLD_SIZE). The target is tensor-parallel over groups of
    # target_tp consecutive ranks; the drafter is data-parallel over the WHOLE world.
    target_tp: int = 1
    engine: str = "none"  # none (one process) | fsdp2 | deepspeed
    zero_stage: int = 2  # DeepSpeed ZeRO stage: 1 or 2 (3 is refused: see docs)
    deepspeed: dict[str, Any] = field(default_factory=dict)  # merged over the DeepSpeed config we build
    dist_timeout_minutes: float = 30.0  # a collective some rank never joins fails after this


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    name: str = "default"


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=Config)
    for group, node in [("target", TargetConfig), ("drafter", DrafterConfig), ("data", DataConfig),
                        ("train", TrainConfig), ("parallel", ParallelConfig)]:
        cs.store(group=group, name=f"{group}_schema", node=node)


def _choice(value: Any, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {list(choices)}.")


def validate_drafter_keys(d: Any) -> None:
    """Refuse a drafter.* key set (to a non-default value) that ``d.arch`` does not read: an
    architecture reads the keys its config declares (``drafter_keys``) and the training keys of
    the features it has (``_TRAINING_KEY_FEATURE``)."""
    used = set(drafter_keys(d.arch))
    used |= {key for key, feature in _TRAINING_KEY_FEATURE.items() if feature in used}
    for f in fields(DrafterConfig):
        value = getattr(d, f.name)
        if f.name in used or f.name in _ALWAYS_USED or value == f.default:
            continue
        feature = _TRAINING_KEY_FEATURE.get(f.name, f.name)
        owners = [arch for arch in DRAFTERS if feature in drafter_keys(arch)]
        only = ", ".join(arch_display_name(a) for a in owners)
        raise ValueError(f"drafter.{f.name}={_show(value)} is not used by drafter.arch={d.arch} ({only} only); "
                         f"remove it or pick drafter={owners[0]}.")


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def validate_config(cfg: Config) -> None:
    """Checks that need no target: ranges, choices. Raises ValueError naming the key and the fix."""
    from torchspec.models.attention import TTT_ATTENTION

    t = cfg.train
    d = cfg.drafter
    if d.arch not in DRAFTERS:
        raise ValueError(f"drafter.arch={d.arch!r} is unknown; choose one of {sorted(DRAFTERS)}.")
    validate_drafter_keys(d)
    if d.attn_backend not in TTT_ATTENTION:
        raise ValueError(f"drafter.attn_backend={d.attn_backend!r} is not one of {sorted(TTT_ATTENTION)}.")
    if d.moe and not 1 <= d.moe_top_k <= d.moe_num_experts:
        raise ValueError(f"drafter.moe_top_k={d.moe_top_k} must lie in [1, drafter.moe_num_experts={d.moe_num_experts}].")
    _choice(d.lowrank_teacher, "drafter.lowrank_teacher", ("target", "full"))
    if d.lowrank_coef < 0:
        raise ValueError(f"drafter.lowrank_coef={d.lowrank_coef} must be >= 0.")
    if d.moe_bias_rate < 0:
        raise ValueError(f"drafter.moe_bias_rate={d.moe_bias_rate} must be >= 0 (0 turns loss-free balancing off).")
    validate_head_loss(d, t)
    if d.draft_vocab_size is not None and d.draft_vocab_size < 1:
        raise ValueError(f"drafter.draft_vocab_size={d.draft_vocab_size} must be >= 1 or null.")
    if t.ttt_steps < 1:
        raise ValueError(f"train.ttt_steps={t.ttt_steps} must be >= 1 (the number of unrolled draft steps).")
    if not 0 < t.step_decay <= 1:
        raise ValueError(f"train.step_decay={t.step_decay} must lie in (0, 1].")
    for name in ("micro_batch_size", "grad_accum", "max_steps"):
        if getattr(t, name) < 1:
            raise ValueError(f"train.{name}={getattr(t, name)} must be >= 1.")
    if t.lr <= 0:
        raise ValueError(f"train.lr={t.lr} must be > 0.")
    if t.warmup_steps < 0:
        raise ValueError(f"train.warmup_steps={t.warmup_steps} must be >= 0.")
    if t.warmup_steps > t.max_steps:  # a short run (a smoke test) keeps the preset's warmup: clamp, don't refuse
        logging.getLogger(__name__).info("train.warmup_steps=%d is more than train.max_steps=%d: warming up over "
                                         "all %d steps", t.warmup_steps, t.max_steps, t.max_steps)
        t.warmup_steps = t.max_steps
    if len(t.betas) != 2:
        raise ValueError(f"train.betas={t.betas} must hold two numbers (AdamW beta1, beta2).")
    if t.max_wall_s is not None and not t.max_wall_s > 0:
        raise ValueError(f"train.max_wall_s={t.max_wall_s} must be > 0 seconds, or null for no limit.")
    if t.stall_dump_s is not None and not t.stall_dump_s > 0:
        raise ValueError(f"train.stall_dump_s={t.stall_dump_s} must be > 0 seconds, or null for no stack dumps.")
    if t.save_every and t.save_every % t.log_every:
        raise ValueError(
            f"train.save_every={t.save_every} must be a multiple of train.log_every={t.log_every} so a resumed "
            f"run logs exactly the metrics the uninterrupted one would."
        )
    _choice(t.precision, "train.precision", ("auto", "bf16", "fp32"))
    _choice(t.loss_backend, "train.loss_backend", ("auto", "triton", "torch"))
    if not t.loss_chunk_gib > 0:
        raise ValueError(f"train.loss_chunk_gib={t.loss_chunk_gib} must be > 0 (GiB of one loss chunk's logits).")
    _choice(t.report_to, "train.report_to", ("wandb", "none"))
    _choice(cfg.target.dtype, "target.dtype", ("float32", "bfloat16", "auto"))
    validate_data_config(cfg.data)
    if cfg.data.max_length < t.ttt_steps + 3:
        raise ValueError(
            f"data.max_length={cfg.data.max_length} is too short for train.ttt_steps={t.ttt_steps}: "
            f"step k scores token t+k+2, so use max_length >= ttt_steps + 3 (realistically hundreds)."
        )
    p = cfg.parallel
    _choice(p.engine, "parallel.engine", ("none", "fsdp2", "deepspeed"))
    if p.target_tp < 1:
        raise ValueError(f"parallel.target_tp={p.target_tp} must be >= 1.")
    if p.engine == "deepspeed" and p.zero_stage not in (1, 2):
        raise ValueError(
            f"parallel.zero_stage={p.zero_stage}: use 1 or 2. ZeRO-3 computes wrong gradients for a drafter whose "
            f"layer runs K times per forward (the TTT unroll); shard parameters with parallel.engine=fsdp2."
        )
    if p.engine != "deepspeed" and p.deepspeed:
        raise ValueError(f"parallel.deepspeed is set but parallel.engine={p.engine!r}; use parallel.engine=deepspeed.")
    if p.engine == "deepspeed" and t.async_checkpoint:
        raise ValueError("train.async_checkpoint=true needs parallel.engine=none or fsdp2 (DeepSpeed saves synchronously).")


def validate_head_loss(d: Any, t: TrainConfig) -> None:
    """drafter.head_loss=candidates: the efficient head's scorer picks the candidates, its teacher is the
    target (the "full" one is the full head over all of V, the cost it removes), and it runs in torch."""
    _choice(d.head_loss, "drafter.head_loss", ("full", "candidates"))
    if d.head_loss_target_topk < 1:
        raise ValueError(f"drafter.head_loss_target_topk={d.head_loss_target_topk} must be >= 1 (the target's top-m "
                         f"joined to the scorer's top-k).")
    if d.head_loss != "candidates":
        return
    if not d.lm_head_rank:
        raise ValueError(f"drafter.head_loss=candidates needs the efficient LM head (drafter.lm_head_rank > 0, got "
                         f"{_show(d.lm_head_rank)}): set drafter.lm_head_rank=128 or drafter.head_loss=full.")
    if d.lowrank_teacher != "target":
        raise ValueError(f"drafter.head_loss=candidates needs drafter.lowrank_teacher=target (got {d.lowrank_teacher}): "
                         f"the full teacher is the full head over all of V; set drafter.lowrank_teacher=target.")
    if t.loss_backend == "triton":
        raise ValueError("drafter.head_loss=candidates has no Triton row pass (it runs in torch); use "
                         "train.loss_backend=auto or torch.")


def validate_data_config(d: DataConfig) -> None:
    """The data.* checks shared by the trainer and data_pipelines.prepare."""
    _choice(d.format, "data.format", ("auto", "messages", "sharegpt"))
    _choice(d.on_too_long, "data.on_too_long", ("truncate", "skip"))
    if d.max_length < 1:
        raise ValueError(f"data.max_length={d.max_length} must be >= 1 (tokens per sequence).")
    if d.eval_size < 1:
        raise ValueError(f"data.eval_size={d.eval_size} must be >= 1 (held-out eval runs at start and end).")


def validate_against_target(cfg: Config, target_config: Any) -> list[int]:
    """Checks that need the target's config.json (read without weights). Returns the aux ids."""
    from torchspec.targets import default_aux_layer_ids, validate_aux_layer_ids

    num_layers = target_config.num_hidden_layers
    ids = list(cfg.target.aux_layer_ids) if cfg.target.aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    validate_aux_layer_ids(ids, num_layers)
    if cfg.parallel.target_tp > 1:
        from torchspec.targets import validate_tp_for_target

        validate_tp_for_target(target_config, cfg.parallel.target_tp)
    d = cfg.drafter
    if d.draft_vocab_size is not None and d.draft_vocab_size > target_config.vocab_size:
        raise ValueError(
            f"drafter.draft_vocab_size={d.draft_vocab_size} exceeds the target vocabulary ({target_config.vocab_size}); "
            f"choose a smaller draft vocabulary."
        )
    if d.lm_head_rank and d.lm_head_rank > target_config.hidden_size:
        raise ValueError(
            f"drafter.lm_head_rank={d.lm_head_rank} must lie in [1, hidden_size={target_config.hidden_size}] "
            f"(a scorer of higher rank than the hidden size is no cheaper than the full head)."
        )
    heads = d.num_attention_heads or target_config.num_attention_heads
    kv_heads = d.num_key_value_heads or getattr(target_config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(
            f"drafter.num_attention_heads={heads} is not a multiple of drafter.num_key_value_heads={kv_heads}."
        )
    return ids
