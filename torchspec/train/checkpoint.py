"""Resume checkpoints: everything needed to continue a run bit for bit, written atomically.

Layout under ``<output_dir>/checkpoints/``::

    step_000100/state.pt   trainable drafter weights, optimizer, scheduler, RNG states,
                           data-sampler position, step, config fingerprint
    latest                 one line: the name of the newest complete checkpoint

A checkpoint is first written to a temporary directory beside its final name and renamed into
place only when complete, and ``latest`` is replaced with ``os.replace`` after that, so a run
killed at any moment leaves either the previous checkpoint or the new one, never half of one.
Frozen weights (the target's embedding) are not stored: they come back from the target.
Exported drafters for serving are separate (``save_pretrained``; see docs/architecture.md).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

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


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in names}


def atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_save_dir(final: Path, write: Any) -> None:
    """Call ``write(tmp_dir)`` then rename tmp_dir to ``final`` (replacing an older one)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        write(tmp)
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(
    output_dir: str | Path, step: int, model: torch.nn.Module, optimizer, scheduler,
    sampler_state: dict[str, Any], extra: dict[str, Any], keep: int,
) -> Path:
    root = Path(output_dir) / "checkpoints"
    name = f"step_{step:06d}"
    state = {
        "step": step,
        "model": trainable_state_dict(model),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "sampler": sampler_state,
        "extra": extra,
    }

    def write(tmp: Path) -> None:
        with open(tmp / "state.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    atomic_save_dir(root / name, write)
    atomic_write_text(root / LATEST, name + "\n")
    _prune(root, keep)
    return root / name


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


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer, scheduler) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG; returns the state (step, sampler, extra)."""
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    expected = set(trainable_state_dict(model))
    got = set(state["model"])
    if expected != got:
        raise ValueError(
            f"checkpoint {path} does not match this drafter: missing {sorted(expected - got)[:8]}, "
            f"unexpected {sorted(got - expected)[:8]}. Resume with the drafter config it was written "
            f"with, or start a new output_dir."
        )
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state
