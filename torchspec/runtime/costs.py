"""What a plain decode step must read, and the device's copy rate: the memory floor of a step.

A decode step of a dense target reads every layer weight and the LM head once (the embedding only the
batch's rows) plus the K/V of every committed position of every row; at the device's measured
device-to-device copy rate (bytes read + written per second) that is the least time it can take.
``hbm_fraction = bytes_per_plain_step / step time / copy rate``: how close a step runs to it.
``torchspec-bench`` and ``tools/bench_runtime_efficiency.py`` report it per row.
"""

from __future__ import annotations

import torch


def copy_rate_bytes_per_s(device: str | torch.device) -> float | None:
    """The measured device-to-device copy rate (bytes read + written per second) on CUDA; None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    n = 1 << 30  # 1 GiB each way: far past the L2
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n / sorted(times)[len(times) // 2]


def bytes_per_plain_step(engine, concurrency: int, mean_ctx: float) -> float:
    """Bytes one plain decode step of ``engine`` must read at ``concurrency`` rows of ``mean_ctx``
    committed positions: every layer weight and the lm_head once (the embedding reads only the
    batch's rows), plus the K/V of every committed position of every row (this rank's shards)."""
    d = engine.decoder
    weights = sum(p.numel() * p.element_size() for n, p in d.named_parameters() if not n.startswith("embed_tokens"))
    if d.lm_head is None:  # tied: the embedding matrix is the head
        weights += d.embed_tokens_weight.numel() * d.embed_tokens_weight.element_size()
    kv = engine.caches.target.k
    kv_per_token = 2 * kv.shape[0] * kv.shape[-2] * kv.shape[-1] * kv.element_size()  # cache layers x (K, V)
    return weights + concurrency * mean_ctx * kv_per_token


def step_costs(round_ms: float, plain_step_ms: float, step_bytes: float, copy_rate: float | None) -> dict:
    """A row's cost keys: ``round_ms``, ``plain_step_ms`` (the plain row's round at the same concurrency),
    ``round_cost_plain_steps`` and ``hbm_fraction`` (of the plain step; None without a copy rate)."""
    return {"round_ms": round_ms, "plain_step_ms": plain_step_ms, "round_cost_plain_steps": round_ms / plain_step_ms,
            "hbm_fraction": step_bytes / (plain_step_ms / 1e3) / copy_rate if copy_rate else None}


__all__ = ["bytes_per_plain_step", "copy_rate_bytes_per_s", "step_costs"]
