"""Atomic, durable file writes shared by training, export, conversion and the runtime's CLIs.

A reader (or a crash) sees the old file or the new one, never half of one: data goes to a
temporary name in the same directory, is fsynced, then renamed over the final name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a fsynced temporary file and a rename."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_save_dir(final: str | Path, write: Callable[[Path], Any]) -> None:
    """Call ``write(tmp_dir)``, fsync what it wrote, then rename tmp_dir to ``final`` (replacing an older one)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        write(tmp)
        fsync_tree(tmp)
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


def fsync_tree(path: str | Path) -> None:
    """fsync every file under ``path`` (before a rename publishes the directory)."""
    for file in Path(path).rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())


def fsync_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to ``path`` and fsync it (the caller renames the enclosing directory into place)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
