"""Learning-rate schedule (linear warmup then cosine decay to ``min_lr_ratio * lr``, used by every
engine's LambdaLR) and the precision choice (bf16 autocast where the device has it)."""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-indexed)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype for the drafter (None = fp32). Master weights always stay fp32."""
    if precision == "fp32":
        return None
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
    else:
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if precision == "bf16" and not supported:
        raise ValueError(f"train.precision=bf16 but {device.type} here has no bf16 support; use train.precision=fp32.")
    return torch.bfloat16 if supported else None
