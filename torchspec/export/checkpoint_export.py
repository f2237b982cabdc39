"""Export the drafter of any step of a training run: ``<run_dir>/config.yaml`` + ``checkpoints/step_N``
-> a serving export directory (format: ``torchspec.export.serving``).

The command behind ``torchspec-export`` (recipes/export.py), for a drafter other than the run's own
end-of-run export (``<run_dir>/drafter``): another step or dtype, or a run from before training wrote
serving exports. The checkpoint is verified as a resume verifies it; of the target only the config,
the embedding and the lm_head are read, never the model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from torchspec.export.serving import DTYPES, export_drafter, read_target_embeddings, target_identity


def _checkpoint_dir(run_dir: Path, step: int | str | None) -> Path:
    """The checkpoint to export, verified as a resume verifies it (``torchspec/train/checkpoint.py``):
    the latest intact one (a damaged latest is skipped with a warning), or exactly ``step``."""
    from torchspec.train.checkpoint import MANIFEST, newest_intact_checkpoint, verify_checkpoint

    root = run_dir / "checkpoints"
    if step is None or step == "latest":
        path = newest_intact_checkpoint(root, fix=f"Export the run's final drafter ({run_dir / 'drafter'}) "
                                                  f"instead, or train again to write a new checkpoint.")
        if path is None:
            raise ValueError(f"{run_dir} has no checkpoints/latest: no complete checkpoint to export. "
                             f"Pass a training run's output_dir.")
        return path
    path = root / f"step_{int(step):06d}"
    problem = verify_checkpoint(path)
    if problem is not None:
        have = sorted(p.name for p in root.glob("step_*") if (p / MANIFEST).is_file()) if root.is_dir() else []
        raise ValueError(f"checkpoint {path} cannot be exported ({problem}); {run_dir} has {have or 'none'}.")
    return path


def export_from_checkpoint(run_dir: str | Path, out_dir: str | Path, *, step: int | str | None = None,
                           dtype: torch.dtype | str = "bfloat16") -> dict[str, Any]:
    """Rebuild the drafter of a training run at ``step`` (default: latest) and export it.

    For a run whose own end-of-run export (``<run_dir>/drafter``) is not the one wanted: another
    step, dtype or layout, or a run from before training wrote serving exports. Of the target it
    reads only the config, the embedding and the lm_head (`read_target_embeddings`, in the run's
    ``target.dtype``, so the frozen embedding is bit-identical to training's); the model is never built.
    """
    from omegaconf import OmegaConf

    from torchspec.config import Config, validate_config
    from torchspec.models import build_drafter
    from torchspec.targets import resolve_target_path
    from torchspec.train.engine_base import ENGINE_DIR, read_engine_state

    run_dir = Path(run_dir)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ValueError(f"{config_file} is missing: pass the output_dir of a torchspec-train run.")
    cfg: Config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(config_file)))
    validate_config(cfg)
    ckpt = _checkpoint_dir(run_dir, step)
    state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)
    if state["engine"] == "deepspeed":
        raise ValueError(
            f"{ckpt} was written by the DeepSpeed engine (per-rank ZeRO shards under deepspeed/). Export from the "
            f"run's final serving export, {run_dir / 'drafter'}, instead, or consolidate the shards with "
            f"DeepSpeed's zero_to_fp32 (deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint).")
    weights = read_engine_state(ckpt, "model")["model"]  # DCP shards of any world size, whole

    target_path = resolve_target_path(cfg.target.path, os.path.expanduser(cfg.target.cache_dir))
    # target.dtype=auto (bf16 on CUDA): read in fp32; the export's own dtype rounds them as the run did
    read_dtype = DTYPES.get(cfg.target.dtype, torch.float32)
    target = read_target_embeddings(target_path, state["extra"]["aux_layer_ids"], read_dtype)
    aux_ids = target.aux_layer_ids

    drafter = build_drafter(cfg.drafter, target.config, aux_ids)
    if "vocab_mapping" in state["extra"]:
        drafter.set_vocab_mapping(*state["extra"]["vocab_mapping"])
    drafter.lm_head.weight.requires_grad_(not cfg.drafter.freeze_lm_head)  # as recipes/train.py build_model
    # The checkpoint's "model" holds the trainable parameters and the persistent buffers (EAGLE-3's d2t/t2d).
    params = dict(drafter.named_parameters())
    frozen = sorted(n for n, p in params.items() if not p.requires_grad)
    expected = {n: t for n, t in drafter.state_dict().items() if n not in frozen}
    head_from_target = "lm_head.weight" in frozen
    if head_from_target and not cfg.drafter.init_lm_head_from_target:
        raise ValueError("drafter.freeze_lm_head=true with init_lm_head_from_target=false: the frozen random LM head "
                         "is not in the checkpoint, so it cannot be exported.")
    unexpected = sorted(set(frozen) - {"embed_tokens.weight", "lm_head.weight"})
    assert not unexpected, f"frozen drafter weights with no source: {unexpected}"

    missing, unknown = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    shapes = [f"{k} {list(weights[k].shape)} (expected {list(expected[k].shape)})"
              for k in sorted(set(weights) & set(expected)) if weights[k].shape != expected[k].shape]
    if missing or unknown or shapes:
        raise ValueError(f"{ckpt / ENGINE_DIR} does not match the drafter of {config_file}: missing {missing}, "
                         f"unknown {unknown}, mis-shaped {shapes}.")
    with torch.no_grad():
        # EAGLE-3: the head rows are picked through the mapping set above. An efficient head's scorer
        # is SVD-initialised here and then overwritten by the checkpoint's trained one.
        drafter.init_from_target(target.embed_tokens_weight, target.lm_head_weight, init_lm_head=head_from_target)
    drafter.load_state_dict(weights, strict=False)  # keys checked above; EAGLE-3 locks its mapping
    training = {"step": int(state["step"]), "train_tokens": state["extra"]["train_tokens"]} \
        if "train_tokens" in state["extra"] else None  # checkpoints from before the count was kept have none
    summary = export_drafter(drafter.float(), out_dir, dtype=dtype, target_identity=target_identity(target),
                             training=training)
    return {**summary, "checkpoint": str(ckpt), "step": int(state["step"])}
