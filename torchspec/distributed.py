"""Process group, the (dp, tp) device mesh, and small rank helpers.

World = dp x tp. Ranks ``k*tp .. k*tp + tp - 1`` (CONSECUTIVE ranks, i.e. the GPUs of one node
for tp <= GPUs per node) form tp group ``k``: they hold one tensor-parallel copy of the frozen
target and all feed it the same input, the union of their own micro-batches
(`gather_tp_batch`); each rank then keeps its own rows (`scatter_for_rank`) for the drafter,
which is data-parallel over the whole world. Nothing V-sized ever crosses processes: every rank
computes target logits for its own rows with the replicated lm_head.

Single process (no torchrun): `init_distributed` still creates a 1-rank process group (from an
in-memory store, no port), so meshes, DTensors and DeepSpeed/FSDP take the same code path at
world size 1 as under torchrun. Every helper here is also a no-op without any process group, so
library code may call them unconditionally.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# A collective that some peer never joins (a crashed rank, a rank stuck in a data loader, ranks
# disagreeing on the number of steps) raises after this long with the name of the collective --
# gloo raises on the waiting rank; NCCL's watchdog aborts the communicator and logs the op --
# instead of hanging silently forever. Long enough for a 27B checkpoint load or an eval pass
# on rank 0 while the others wait in a barrier.
DEFAULT_TIMEOUT_MINUTES = 30.0

MESH_DIM_NAMES = ("dp", "tp")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(
    backend: str | None = None,
    timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
    device_type: str | None = None,
) -> DistInfo:
    """Initialise the default process group from torchrun's env (or a 1-rank group without it).

    device_type: None picks ``cuda`` when available (rank uses ``cuda:LOCAL_RANK``), else ``cpu``;
    "cpu" forces CPU even on a GPU machine (gloo tests). backend: None picks ``nccl`` for cuda,
    ``gloo`` for cpu. Calling it again returns the existing group's info (idempotent).
    """
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if under_torchrun else 0
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_type)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        # device_id binds NCCL's communicator to this rank's GPU (no "guessing device ID" hang risk).
        kwargs = {
            "timeout": timedelta(minutes=timeout_minutes),
            "device_id": device if device.type == "cuda" else None,
        }
        if under_torchrun:
            # env:// reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
            dist.init_process_group(backend=backend, init_method="env://", **kwargs)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return DistInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device
    )


def close_distributed() -> None:
    """Destroy the process group at the end of a run. Left to the interpreter's exit, its background
    threads can die joinable and abort a rank after its work is done ("terminate called without an
    active exception", SIGABRT: seen once in the two-process kill-and-resume test, 2026-12-03)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def validate_mesh(world_size: int, target_tp: int) -> int:
    """Check that ``world_size = dp * target_tp``; return dp. ValueError naming the values and the fix."""
    if target_tp < 1:
        raise ValueError(f"parallel.target_tp={target_tp} must be >= 1 (1 = no tensor parallelism).")
    if world_size % target_tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"WORLD_SIZE={world_size} is not divisible by parallel.target_tp={target_tp}: the world is dp x tp, "
            f"and dp = {world_size}/{target_tp} = {world_size / target_tp:g} is not an integer. Set "
            f"parallel.target_tp to one of {divisors}, or launch a multiple of {target_tp} processes "
            f"(torchrun --nproc-per-node)."
        )
    return world_size // target_tp


def build_mesh(world_size: int, target_tp: int, device_type: str | None = None) -> DeviceMesh:
    """A 2-D ``("dp", "tp")`` mesh of shape ``(world_size // target_tp, target_tp)``.

    Row-major layout: tp groups are consecutive ranks (``mesh["tp"]`` of rank r is
    ``r // tp * tp ... + tp - 1``), dp groups stride by tp. Needs `init_distributed` first;
    pass its ``DistInfo.device.type`` as `device_type` (None: cuda when available, else cpu).
    """
    dp = validate_mesh(world_size, target_tp)
    if world_size != dist.get_world_size():
        raise ValueError(
            f"build_mesh(world_size={world_size}) but the process group has {dist.get_world_size()} ranks; "
            "pass DistInfo.world_size from init_distributed()."
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, (dp, target_tp), mesh_dim_names=MESH_DIM_NAMES)


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """In-place sum over `group` (default: the world); returns `tensor`. No-op without a group."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def seed_everything(seed: int, rank_offset: int = 0) -> None:
    """Seed python, numpy and torch (all devices) with ``seed + rank_offset``.

    Use ``rank_offset=0`` where ranks must agree (drafter init), and the rank where they must
    differ (dropout, sampling). Ranks of one tp group never draw randomness for the target.
    """
    s = seed + rank_offset
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


@dataclass(frozen=True)
class TPBatchLayout:
    """Where each tp rank's own micro-batch sits in the tp group's union batch.

    Rank r's rows are ``[r * rows_per_rank, r * rows_per_rank + shapes[r][0])`` and its own length
    is ``shapes[r][1]``; the rest is padding (right-padded columns, whole pad rows).
    """

    shapes: tuple[tuple[int, int], ...]  # (B_r, T_r) per tp rank, in tp-rank order
    rows_per_rank: int  # max B_r


def gather_tp_batch(
    batch: dict[str, Tensor], group: dist.ProcessGroup | None = None, pad_values: dict[str, int] | None = None
) -> tuple[dict[str, Tensor], TPBatchLayout]:
    """All-gather each rank's ``[B_r, T_r, ...]`` tensors into the tp group's union batch.

    Every tensor is right-padded to ``[max B, max T]`` (with ``pad_values[name]``, default 0:
    attention_mask 0 hides the pad from the causal target, which leaves real positions unchanged),
    then concatenated in tp-rank order: ``[tp * max B, max T, ...]``, identical on every rank of
    the group. Pad rows are fully masked: their target outputs are garbage (possibly NaN) and are
    dropped by `scatter_for_rank`. Only token ids and masks travel (tiny integer tensors); one
    host sync per call reads the group's shapes. Without a process group: returns `batch`.
    """
    pad_values = pad_values or {}
    first = next(iter(batch.values()))
    own = tuple(first.shape[:2])
    for name, x in batch.items():
        assert tuple(x.shape[:2]) == own, f"{name} has shape {tuple(x.shape)}, expected [B, T] = {own} first"
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(batch), TPBatchLayout(shapes=(own,), rows_per_rank=own[0])
    n = dist.get_world_size(group)
    shape = torch.tensor(own, device=first.device)
    shapes = [torch.empty_like(shape) for _ in range(n)]
    dist.all_gather(shapes, shape, group=group)
    shapes = tuple(tuple(s.tolist()) for s in shapes)
    rows, cols = max(b for b, _ in shapes), max(t for _, t in shapes)
    out = {}
    for name, x in batch.items():
        padded = x.new_full((rows, cols, *x.shape[2:]), pad_values.get(name, 0))
        padded[: own[0], : own[1]] = x
        parts = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(parts, padded, group=group)
        out[name] = torch.cat(parts)  # [n * rows, cols, ...]
    return out, TPBatchLayout(shapes=shapes, rows_per_rank=rows)


def scatter_for_rank(x: Tensor, layout: TPBatchLayout, tp_rank: int) -> Tensor:
    """This rank's own ``[B_r, T_r, ...]`` rows of a union-batch tensor (a view, no communication).

    The TP target's outputs are replicated across the tp group, so "scatter" is local slicing.
    """
    b, t = layout.shapes[tp_rank]
    start = tp_rank * layout.rows_per_rank
    return x[start : start + b, :t]
