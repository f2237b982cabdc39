"""Resume checkpoints: everything needed to continue a run bit for bit, written atomically and
verified before use.

Layout under ``<output_dir>/checkpoints/``::

    step_000100/state.pt          step, per-rank RNG states, data-sampler position, world size, extra
    step_000100/engine/           ("none" / "fsdp2") torch.distributed.checkpoint (DCP): ``.metadata``
                                  + ``__<rank>_0.distcp`` per rank: trainable weights (fp32 masters
                                  under bf16), AdamW state, scheduler, keyed by the drafter's names
    step_000100/deepspeed/        ("deepspeed") DeepSpeed's own per-rank files, + engine.json
    step_000100/manifest.json     written last: every other file's size and SHA-256
    latest                        one line: the name of the newest published checkpoint

**Saving** is collective: rank 0 creates ``.step_N.tmp``, every rank writes its own engine shard
into it (nothing is gathered on rank 0), rank 0 writes ``state.pt`` (with every rank's RNG state),
the ranks hash the files (split between them) and rank 0 writes the manifest, renames the directory
into place and only then replaces ``latest``. A run killed at any moment leaves the previous
checkpoint or the new one, never half of one. Frozen weights (the target's embedding) are not
stored. ``async_save=True`` (``train.async_checkpoint``; "none"/"fsdp2"): the engine state is
copied in memory and written by a background thread while training goes on; the checkpoint is
published (manifest, rename, ``latest``) only once that write completed — at the next save or at
``finish_checkpoint()`` — so a kill during it leaves the previous checkpoint.

**Loading** verifies first: every file the manifest lists must be there with its size and
SHA-256 (``verify_checkpoint``). ``find_resume_checkpoint(dir, "auto")`` (and ``torchspec-export``
through ``newest_intact_checkpoint``) takes the checkpoint ``latest`` names if it is intact, else
the newest intact ``step_*``, saying in ONE warning line which ones were skipped and why (truncated
or corrupted file, missing file, no manifest, unreadable ``latest``); when none is intact it is a
ValueError naming the directory and the way out. An explicitly named checkpoint (``train.resume=
<dir>``, ``--step N``) is verified and refused when damaged, never replaced by another one.
Checkpoints of an older torchspec (no manifest, one unsharded ``engine.pt``) are refused with a
message saying so: this version can neither verify nor read them.

SHA-256 because it is cheap here: 42 ms for a 50 MB file on the 2-core dev machine (1.2 GB/s,
SHA-NI through OpenSSL; a plain read from the page cache is 5.5 ms, zlib.crc32 20 ms, blake2b
105 ms), split over the ranks at save and at load.

"none"/"fsdp2" checkpoints resume at any world size and in either of the two engines (DCP
reshards; the global batch must stay the same); DeepSpeed's at the same world size and stage.
Exports for serving are separate. Checkpoints live on a filesystem every rank sees.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchspec.distributed import barrier
from torchspec.io import atomic_write_text, fsync_save, fsync_tree
from torchspec.train.engine_base import LEGACY_ENGINE_FILE

LATEST = "latest"
STATE_FILE = "state.pt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "torchspec-checkpoint-manifest/1"
STEP_DIR = re.compile(r"step_(\d+)")
log = logging.getLogger(__name__)


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


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# --- saving ----------------------------------------------------------------------------------------

@dataclass
class _Unpublished:
    """A checkpoint written (or being written) into ``tmp``, to be renamed to ``final``."""

    tmp: Path
    final: Path
    keep: int
    write: Future | None  # the engine's background write (async save), None when done


_in_flight: list[_Unpublished] = []  # at most one async save waiting to be published


def save_checkpoint(output_dir: str | Path, step: int, engine, sampler_state: dict[str, Any],
                    extra: dict[str, Any], keep: int, async_save: bool = False) -> Path:
    """Collective: every rank calls it with the same arguments. Returns the checkpoint's final path,
    where it is published now (``async_save=False``) or once its background write completed (at
    the next save, or at ``finish_checkpoint()``, which the run must call before it ends)."""
    finish_checkpoint()
    root = Path(output_dir) / "checkpoints"
    name = f"step_{step:06d}"
    tmp, final = root / f".{name}.tmp", root / name
    rank, world = _rank_world()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    write = engine.save(tmp, async_save=async_save)
    rngs = [rng_state()]
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, rng_state())
    if rank == 0:
        state = {"step": step, "rng": rngs, "sampler": sampler_state, "extra": extra, "engine": engine.kind,
                 "world_size": world}
        fsync_save(state, tmp / STATE_FILE)
    unpublished = _Unpublished(tmp, final, keep, write)
    if write is None:
        _publish(unpublished)
    else:
        _in_flight.append(unpublished)
    return final


def finish_checkpoint() -> Path | None:
    """Collective: wait for the async save in flight, if any, and publish it; returns its path.
    A failed background write raises here, and leaves the previous checkpoint as ``latest``."""
    if not _in_flight:
        return None
    unpublished = _in_flight.pop()
    _publish(unpublished)
    return unpublished.final


def publish_if_written() -> Path | None:
    """Collective, non-blocking (the recipe calls it on log steps, the same on every rank): publish the
    async save in flight once every rank's background write has finished; else leave it for later.
    Without it a written checkpoint would wait for the next save, and a kill in between would lose it."""
    if not _in_flight:
        return None
    write = _in_flight[-1].write
    done = torch.tensor([int(write is None or write.done())])
    if _rank_world()[1] > 1:
        if dist.get_backend() == "nccl":
            done = done.cuda()
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
    return finish_checkpoint() if bool(done.item()) else None


def _publish(c: _Unpublished) -> None:
    if c.write is not None:
        c.write.result()  # this rank's shard is on disk (raises what the background write raised)
    barrier()
    write_manifest(c.tmp)
    if _rank_world()[0] == 0:
        if c.final.exists():
            shutil.rmtree(c.final)
        os.replace(c.tmp, c.final)
        atomic_write_text(c.final.parent / LATEST, c.final.name + "\n")
        _prune(c.final.parent, c.keep)
    barrier()


def write_manifest(path: str | Path) -> None:
    """Collective: record the size and SHA-256 of every file under ``path`` in ``path/manifest.json``
    (the ranks hash a share of the files each; rank 0 writes). The last file a checkpoint gets before
    it is renamed into place; a test that edits a checkpoint on purpose calls it to re-seal it."""
    path = Path(path)
    rank, world = _rank_world()
    files = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and f.name != MANIFEST)
    mine = {name: {"size": (path / name).stat().st_size, "sha256": _sha256(path / name)}
            for name in files[rank::world]}
    if world > 1:
        shares: list = [None] * world
        dist.all_gather_object(shares, mine)
        mine = {k: v for share in shares for k, v in share.items()}
    if rank == 0:
        fsync_tree(path)
        manifest = {"format": MANIFEST_FORMAT, "files": {name: mine[name] for name in files}}
        atomic_write_text(path / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def _sha256(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _step_dirs(root: Path) -> list[Path]:
    """The published ``step_*`` directories under ``root``, newest step first."""
    found = [p for p in root.glob("step_*") if STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[len("step_"):]), reverse=True)


def _prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints that have a manifest (damaged ones without count for
    nothing); drop leftovers of interrupted saves."""
    sealed = [p for p in _step_dirs(root) if (p / MANIFEST).is_file()]
    for old in sealed[max(keep, 1):]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(".step_*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)


# --- verifying -------------------------------------------------------------------------------------

_verified: dict[str, str] = {}  # checkpoint dir -> SHA-256 of the manifest it verified against (this process)


def verify_checkpoint(path: str | Path) -> str | None:
    """None when ``path`` holds every file its manifest lists, with the recorded size and SHA-256;
    otherwise what is wrong, naming the file(s). Collective when torch.distributed is initialised
    (every rank calls it; the ranks hash a share of the files each)."""
    path = Path(path)
    rank, world = _rank_world()
    problems, manifest_digest = _local_problems(path, rank, world)
    if world > 1:
        shares: list = [None] * world
        dist.all_gather_object(shares, problems)
        problems = list(dict.fromkeys(p for share in shares for p in share))  # the same on every rank
    if problems:
        return "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    _verified[str(path.resolve())] = manifest_digest
    return None


def _local_problems(path: Path, rank: int, world: int) -> tuple[list[str], str]:
    """What is wrong with ``path`` as far as this rank checks it: the manifest and every file's size,
    and the SHA-256 of this rank's share of the files. Also the manifest's own SHA-256."""
    if not path.is_dir():
        return ["the directory is missing"], ""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        if (path / LEGACY_ENGINE_FILE).is_file():
            return [f"no {MANIFEST}: written by an older torchspec (one unsharded {LEGACY_ENGINE_FILE}), which this "
                    f"version can neither verify nor load; resume it with the torchspec that wrote it"], ""
        return [f"no {MANIFEST} (an incomplete or damaged checkpoint)"], ""
    raw = manifest_file.read_bytes()
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        assert manifest["format"] == MANIFEST_FORMAT and isinstance(files, dict)
        sizes = {str(name): int(entry["size"]) for name, entry in files.items()}
        digests = {str(name): str(entry["sha256"]) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AssertionError, AttributeError):
        return [f"{MANIFEST} is unreadable (damaged)"], ""
    problems, hash_share = [], []
    for i, name in enumerate(sorted(sizes)):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif (size := file.stat().st_size) != sizes[name]:
            what = "truncated" if size < sizes[name] else "longer than written"
            problems.append(f"{name} is {what} ({size} bytes, the manifest says {sizes[name]})")
        elif i % world == rank:
            hash_share.append(name)
    problems += [f"{name} is corrupted (its SHA-256 differs from the manifest's)"
                 for name in hash_share if _sha256(path / name) != digests[name]]
    return problems, hashlib.sha256(raw).hexdigest()


def _already_verified(path: Path) -> bool:
    """Whether this process verified ``path`` against its current manifest (find -> load hashes once)."""
    try:
        raw = (path / MANIFEST).read_bytes()
    except OSError:
        return False
    return _verified.get(str(path.resolve())) == hashlib.sha256(raw).hexdigest()


def newest_intact_checkpoint(root: str | Path, fix: str) -> Path | None:
    """The checkpoint ``root/latest`` names if it verifies, else the newest ``step_*`` that does; the
    ones skipped are named, with what is wrong with each, in ONE warning line. None when ``root``
    holds no checkpoint at all; a ValueError naming ``root`` and ``fix`` when none is intact.
    Collective when torch.distributed is initialised."""
    root = Path(root)
    skipped: list[str] = []
    named = None
    latest = root / LATEST
    if latest.is_file():
        text = latest.read_bytes()
        name = text.decode("utf-8", errors="replace").strip()
        if STEP_DIR.fullmatch(name):
            named = root / name
        else:
            skipped.append(f"{LATEST} holds {text[:40]!r}, not a checkpoint name")
    candidates = ([named] if named is not None else []) + [p for p in _step_dirs(root) if p != named]
    if not candidates and not latest.exists():
        return None
    for path in candidates:
        problem = verify_checkpoint(path)
        if problem is None:
            if skipped and _rank_world()[0] == 0:
                log.warning("checkpoints in %s: skipped %s; using %s", root, "; ".join(skipped), path.name)
            return path
        skipped.append(f"{path.name} ({problem})")
    raise ValueError(f"no intact checkpoint in {root}: {'; '.join(skipped)}. {fix}")


# --- loading ---------------------------------------------------------------------------------------

def find_resume_checkpoint(output_dir: str | Path, resume: str) -> Path | None:
    """``resume``: "never", "auto" (the newest intact checkpoint under output_dir, if any: see the
    module docstring) or an explicit checkpoint dir (verified; refused when damaged). Collective
    when torch.distributed is initialised."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise ValueError(f"train.resume={resume!r}: no {STATE_FILE} there; pass a checkpoints/step_* directory.")
        problem = verify_checkpoint(path)
        if problem is not None:
            raise ValueError(f"train.resume={resume!r} is damaged: {problem}. Pass an intact checkpoints/step_* "
                             f"directory, or train.resume=auto to take the newest intact one.")
        return path
    root = Path(output_dir) / "checkpoints"
    return newest_intact_checkpoint(root, fix=f"Delete {root} to start the run over, or pass train.resume=never "
                                              f"and a new output_dir.")


def load_checkpoint(path: Path, engine, global_batch: int) -> dict[str, Any]:
    """Collective: verify ``path`` (unless ``find_resume_checkpoint`` just did), restore the engine
    (weights, optimizer, scheduler) and this rank's RNG state. Returns the state (step, sampler,
    extra). A changed world size is handled where the format allows it and the global batch is
    unchanged, and refused with a message otherwise."""
    path = Path(path)
    if not _already_verified(path):
        problem = verify_checkpoint(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} is damaged: {problem}. Resume from another one (train.resume=auto "
                             f"takes the newest intact checkpoint) or start a new output_dir.")
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    rank, world = _rank_world()
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
