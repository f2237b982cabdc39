"""Tensor-parallel runtime set-up for the generate / bench CLIs: process group, device, a guard.

Under torchrun every rank runs the same engine loop: the target is sharded over the tp group
(``TargetDecoder.from_pretrained(path, tp_group=...)``), the drafter is replicated, and every
rank samples with the same seeded generator from the same (all-reduced) logits, so all ranks
commit the same tokens. ``check_tp_consistency`` verifies that after ``generate`` at the cost of
one all-gather of an int64 per rank.

    group, device = init_tp_from_env()
    engine = load_engine(target, drafter, device=device, tp_group=group)
    results = engine.generate(prompts, ...)
    check_tp_consistency([r.token_ids for r in results], group)
    if is_rank0():
        print(...)
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist

from torchspec.distributed import init_distributed, is_rank0

__all__ = ["check_tp_consistency", "init_tp_from_env", "is_rank0"]


def init_tp_from_env(backend: str | None = None) -> tuple[dist.ProcessGroup | None, torch.device]:
    """(tp group, this rank's device) from torchrun's environment.

    WORLD_SIZE > 1: initialise the default process group (nccl with ``cuda:LOCAL_RANK`` when
    CUDA is available, else gloo on CPU; ``backend="gloo"`` forces CPU) and return the whole
    world as the tp group. A single process gets ``(None, cuda or cpu)`` and no process group.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = init_distributed(backend=backend, device_type="cpu" if backend == "gloo" else None)
    return dist.group.WORLD, info.device


def _tokens_hash(tokens: list[list[int]]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for row in tokens:
        h.update(len(row).to_bytes(8, "little"))
        h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in row))
    return int.from_bytes(h.digest(), "little", signed=True)


def check_tp_consistency(tokens: list[list[int]], group: dist.ProcessGroup | None) -> None:
    """Raise RuntimeError if the ranks of ``group`` generated different ``tokens``; no-op without one.

    Every rank must call it (it is a collective). The error names the (global) ranks whose tokens
    differ from the group's first rank's.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([_tokens_hash(tokens)], dtype=torch.long, device=device)
    hashes = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(hashes, mine, group=group)
    hashes = [int(h.item()) for h in hashes]
    ranks = dist.get_process_group_ranks(group)
    diverged = [r for r, h in zip(ranks, hashes) if h != hashes[0]]
    if diverged:
        raise RuntimeError(
            f"tensor-parallel ranks diverged: ranks {diverged} generated different tokens from rank {ranks[0]} "
            f"(token hashes by rank: {dict(zip(ranks, hashes))}). Every rank must see the same prompts, "
            f"sampling parameters and seed."
        )
