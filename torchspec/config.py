"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore, and validation.

``conf/train.yaml`` composes one file from each group (``drafter/``, ``target/``, ``data/``,
``train/``, ``parallel/``) on top of the ``train_schema`` node stored here, so every key is typed
and an unknown key is an error at composition time. ``validate_config`` then checks the values
that need more than a type (ranges, choices, combinations) and ``validate_against_target`` the
ones that need the target's config.json — all before any weight is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


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
class DrafterConfig:
    arch: str = "eagle4"  # key of torchspec.models.DRAFTERS: eagle4 | eagle3
    draft_vocab_size: int | None = None  # EAGLE-3 pruned vocabulary; null = full target vocabulary
    # Sizes: null means "take the target's" (hidden size always equals the target's).
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    fc_norm: bool = True
    fc_post_norm: bool = True
    norm_output: bool = True
    pre_attn_norm: bool = True
    sliding_window: int | None = 4096  # step-0 keys within this many positions; null = full causal
    nope: bool = False  # no positional encoding at all
    # auto (flex on CUDA, chunked elsewhere) | chunked (SDPA per query block) | flex (CUDA) | eager (reference)
    attn_backend: str = "auto"
    lm_head_rank: int = 0  # efficient LM head scorer rank; 0 = dense head only
    lm_head_topk: int = 128  # candidates re-scored by the full head
    lowrank_coef: float = 1.0  # weight of the scorer's distillation loss
    lowrank_teacher: str = "target"  # target (its distribution) | full (the drafter's full head)
    moe: bool = False
    moe_num_experts: int = 8
    moe_top_k: int = 2
    moe_intermediate_size: int | None = None
    moe_shared_expert: bool = False
    moe_norm_topk_prob: bool = True
    moe_extra_norm: bool = True
    moe_aux_loss_coef: float = 0.01  # load-balancing loss weight (training setting, not architecture)
    init_lm_head_from_target: bool = True
    freeze_lm_head: bool = False


@dataclass
class DataConfig:
    path: str = "sharegpt"  # "sharegpt" (bundled ShareGPT V3), or a .jsonl / .json file
    format: str = "auto"  # auto | messages | sharegpt
    max_length: int = 2048
    on_too_long: str = "truncate"  # truncate | skip
    # Training rows hold several conversations (best-fit, up to max_length tokens) with per-document
    # positions and masks, so micro-batches carry almost no padding; the held-out set stays unpacked.
    pack: bool = False
    max_conversations: int | None = None  # read at most this many usable conversations
    eval_size: int = 64  # held-out conversations, fixed by seed
    seed: int = 0
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
    resume: str = "auto"  # auto (latest in output_dir if any) | never | <checkpoint dir>
    # Weights-only start (unlike resume: no optimizer, schedule, data position or step): a drafter
    # directory written by save_pretrained, torchspec-export or torchspec-convert.
    init_from: str | None = None
    report_to: str = "wandb"  # wandb (offline unless WANDB_MODE says otherwise) | none
    wandb_project: str = "torchspec"
    num_threads: int | None = None  # torch CPU threads; null: torch's default
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


def validate_config(cfg: Config) -> None:
    """Checks that need no target: ranges, choices. Raises ValueError naming the key and the fix."""
    from torchspec.models import DRAFTERS
    from torchspec.models.attention import TTT_ATTENTION

    t = cfg.train
    if cfg.drafter.attn_backend not in TTT_ATTENTION:
        raise ValueError(f"drafter.attn_backend={cfg.drafter.attn_backend!r} is not one of {sorted(TTT_ATTENTION)}.")
    if cfg.drafter.moe and not 1 <= cfg.drafter.moe_top_k <= cfg.drafter.moe_num_experts:
        raise ValueError(
            f"drafter.moe_top_k={cfg.drafter.moe_top_k} must lie in [1, drafter.moe_num_experts="
            f"{cfg.drafter.moe_num_experts}]."
        )
    d = cfg.drafter
    _choice(d.lowrank_teacher, "drafter.lowrank_teacher", ("target", "full"))
    if d.lowrank_coef < 0:
        raise ValueError(f"drafter.lowrank_coef={d.lowrank_coef} must be >= 0.")
    if d.arch not in DRAFTERS:
        raise ValueError(f"drafter.arch={d.arch!r} is unknown; choose one of {sorted(DRAFTERS)}.")
    if d.arch == "eagle4" and d.draft_vocab_size is not None:
        raise ValueError(
            f"drafter.draft_vocab_size={d.draft_vocab_size}: EAGLE-4's LM head covers the full target vocabulary "
            f"(its efficient head prunes per token instead); set it to null or use drafter=eagle3."
        )
    if d.arch == "eagle3":
        eagle4_only = {k: getattr(d, k) for k in ("fc_post_norm", "pre_attn_norm", "nope", "moe", "lm_head_rank")
                       if getattr(d, k)}
        if eagle4_only:
            raise ValueError(f"drafter.arch=eagle3 has no {sorted(eagle4_only)}; set them false (they are EAGLE-4 flags).")
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
    if t.warmup_steps < 0 or t.warmup_steps > t.max_steps:
        raise ValueError(f"train.warmup_steps={t.warmup_steps} must lie in [0, train.max_steps={t.max_steps}].")
    if len(t.betas) != 2:
        raise ValueError(f"train.betas={t.betas} must hold two numbers (AdamW beta1, beta2).")
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
    _choice(cfg.data.format, "data.format", ("auto", "messages", "sharegpt"))
    _choice(cfg.data.on_too_long, "data.on_too_long", ("truncate", "skip"))
    if cfg.data.max_length < t.ttt_steps + 3:
        raise ValueError(
            f"data.max_length={cfg.data.max_length} is too short for train.ttt_steps={t.ttt_steps}: "
            f"step k scores token t+k+2, so use max_length >= ttt_steps + 3 (realistically hundreds)."
        )
    if cfg.data.eval_size < 1:
        raise ValueError(f"data.eval_size={cfg.data.eval_size} must be >= 1 (held-out eval runs at start and end).")
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


def validate_against_target(cfg: Config, target_config: Any) -> list[int]:
    """Checks that need the target's config.json (read without weights). Returns the aux ids."""
    from torchspec.target import default_aux_layer_ids, validate_aux_layer_ids

    num_layers = target_config.num_hidden_layers
    ids = list(cfg.target.aux_layer_ids) if cfg.target.aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    validate_aux_layer_ids(ids, num_layers)
    if cfg.parallel.target_tp > 1:
        from torchspec.distributed import validate_tp_for_target

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
