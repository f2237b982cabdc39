"""Resume checkpoints: everything needed to continue a run bit for bit, written atomically.

Layout under ``<output_dir>/checkpoints/``::

    step_000100/state.pt    step, per-rank RNG states, data-sampler position, world size, extra
    step_000100/engine.pt   ("none" / "fsdp2") full trainable weights, AdamW state, scheduler
    step_000100/deepspeed/  ("deepspeed") DeepSpeed's own per-rank files + engine.json
    latest                  one line: the name of the newest complete checkpoint

Saving is collective: rank 0 creates ``.step_N.tmp``, every rank writes its engine part into it,
rank 0 writes ``state.pt`` (with every rank's RNG state), renames the directory into place and
only then replaces ``latest`` — so a run killed at any moment leaves the previous checkpoint or
the new one, never half of one. Frozen weights (the target's embedding) are not stored.
"none"/"fsdp2" checkpoints are unsharded, so they resume at any world size (with the same global
batch); DeepSpeed's resume at the same world size and stage. Exports for serving are separate.
"""

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchspec.distributed import barrier
from torchspec.io import atomic_write_text, fsync_tree

LATEST = "latest"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: str | Path, step: int, engine, sampler_state: dict[str, Any],
                    extra: dict[str, Any], keep: int) -> Path:
    """Collective: every rank calls it with the same arguments."""
    root = Path(output_dir) / "checkpoints"
    name = f"step_{step:06d}"
    tmp, final = root / f".{name}.tmp", root / name
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    engine.save(tmp)
    rngs = [rng_state()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        rngs = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, rng_state())
    if rank0:
        state = {"step": step, "rng": rngs, "sampler": sampler_state, "extra": extra, "engine": engine.kind,
                 "world_size": len(rngs)}
        with open(tmp / "state.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(root / LATEST, name + "\n")
        _prune(root, keep)
    barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and (p / "state.pt").exists())
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def find_resume_checkpoint(output_dir: str | Path, resume: str) -> Path | None:
    """``resume``: "never", "auto" (latest under output_dir, if any) or an explicit checkpoint dir."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / "state.pt").is_file():
            raise ValueError(f"train.resume={resume!r}: no state.pt there; pass a checkpoints/step_* directory.")
        return path
    latest = Path(output_dir) / "checkpoints" / LATEST
    if not latest.is_file():
        return None
    path = latest.parent / latest.read_text().strip()
    if not (path / "state.pt").is_file():
        raise ValueError(f"{latest} names {path.name}, which is missing; remove {latest} or pass train.resume=never.")
    return path


def load_checkpoint(path: Path, engine, global_batch: int) -> dict[str, Any]:
    """Collective: restore the engine (weights, optimizer, scheduler) and this rank's RNG state.
    Returns the state (step, sampler, extra). A changed world size is handled where the format
    allows it and the global batch is unchanged, and refused with a message otherwise."""
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if state["engine"] != engine.kind and "deepspeed" in (state["engine"], engine.kind):
        raise ValueError(f"checkpoint {path} was written by the {state['engine']!r} engine; this run uses "
                         f"{engine.kind!r}. Resume with parallel.engine={state['engine']}.")
    if state["sampler"].get("batch_size", global_batch) != global_batch:
        raise ValueError(
            f"checkpoint {path} was written with a global batch of {state['sampler']['batch_size']} sequences "
            f"(micro_batch_size x world size), this run has {global_batch}: the data position would not carry "
            f"over. Keep micro_batch_size x WORLD_SIZE equal to resume, or start a new output_dir.")
    engine.load(path)
    set_rng_state(state["rng"][rank] if len(state["rng"]) == world else state["rng"][0])
    return state
