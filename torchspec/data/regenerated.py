"""Regenerated conversations on disk: JSONL shards with sidecars, written atomically, verified on read.

``python -m data_pipelines.regenerate`` (docs/data_pipelines.md) writes one directory per run::

    generation.json       the run's settings (target, sampling, limits, seed, dtype, date, torchspec
                          version); "complete": true and the list of shards once every shard is written
    shard_00000.jsonl     conversations in the input's own record format (ShareGPT "conversations" or
                          OpenAI "messages"; "id" and every other field kept), in input order
    shard_00000.json      its sidecar: record range, conversation count, ids, bytes, sha256, counters

Shard k holds the conversations of input records ``[k * shard_size, (k + 1) * shard_size)``. The shard
is written to a temporary name, fsynced and renamed, then its sidecar the same way, so a shard without
a sidecar was cut off by a kill. ``verify_shard`` refuses (``CorruptShard``, naming the file) a shard
with no sidecar, a line that is not a JSON object (a truncated write), or a count, id list, size or
sha256 that disagrees with its sidecar: such a shard is regenerated, never read as data.

Readers go through ``read_source``: a conversation file through ``formats.iter_conversations``, a
regenerated directory shard by shard, each verified first; an unfinished run or a corrupted shard
is a ValueError naming it and the fix. The input of a regeneration is read by ``formats.iter_records``
(the raw records with their normalised messages); a shard's records are normalised by the same
``formats.normalize_records``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from torchspec.cli import read_json
from torchspec.data.formats import (
    Message,
    SkipStats,
    iter_conversations,
    normalize_records,
    resolve_path,
)
from torchspec.io import atomic_write_bytes, atomic_write_text

GENERATION_FILE = "generation.json"
REGENERATED_FORMAT = "torchspec-regenerated"
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}
_FIX = "rerun python -m data_pipelines.regenerate with output={dir} (it regenerates missing and corrupted shards)"


class CorruptShard(ValueError):
    """A shard that disagrees with its sidecar, or has none; the message names the file and why."""


def shard_path(directory: str | Path, index: int) -> Path:
    return Path(directory) / f"shard_{index:05d}.jsonl"


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(".json")


def is_regenerated_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / GENERATION_FILE).is_file()


def read_generation(directory: str | Path) -> dict:
    """generation.json of a regeneration output, checked to be one."""
    fix = _FIX.format(dir=directory)
    record = read_json(Path(directory) / GENERATION_FILE, fix)
    if record.get("format") != REGENERATED_FORMAT:
        raise ValueError(f"{Path(directory) / GENERATION_FILE}: format={record.get('format')!r}, expected "
                         f"{REGENERATED_FORMAT!r}; point at a data_pipelines.regenerate output")
    return record


def write_shard(directory: str | Path, index: int, records: list[dict], sidecar: dict) -> dict:
    """Write shard ``index`` (one JSON record per line) and then its sidecar, each atomically.

    ``sidecar`` carries the caller's fields (record range, ids, counters); the conversation count,
    size and sha256 of the bytes written are added here. Returns the sidecar as written."""
    shard = shard_path(directory, index)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    atomic_write_bytes(shard, data)
    sidecar = {**sidecar, "shard": shard.name, "conversations": len(records), "bytes": len(data),
               "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write_text(sidecar_path(shard), json.dumps(sidecar, indent=1))
    return sidecar


def verify_shard(shard: Path) -> tuple[list[dict], dict]:
    """The records and sidecar of ``shard``; ``CorruptShard`` (naming it and the problem) otherwise."""
    side = sidecar_path(shard)
    if not shard.is_file():
        raise CorruptShard(f"{shard} is missing")
    if not side.is_file():
        raise CorruptShard(f"{shard} has no sidecar {side.name} (its writer was killed)")
    try:
        sidecar = json.loads(side.read_text())
        expected_count, expected_ids = int(sidecar["conversations"]), list(sidecar["ids"])
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptShard(f"{side} is not a valid sidecar ({type(err).__name__}: {err})") from err
    data = shard.read_bytes()
    records = []
    lines = data.split(b"\n")  # not str.splitlines: U+2028 inside a JSON string is not a line break
    for number, line in enumerate(lines[:-1] if lines[-1] == b"" else lines, 1):
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            record = None
        if not isinstance(record, dict):
            raise CorruptShard(f"{shard} line {number} is not a JSON object (truncated or garbled)")
        records.append(record)
    if len(records) != expected_count:
        raise CorruptShard(f"{shard} holds {len(records)} conversations, its sidecar says {expected_count}")
    if len(data) != sidecar.get("bytes") or hashlib.sha256(data).hexdigest() != sidecar.get("sha256"):
        raise CorruptShard(f"{shard} does not match the size / sha256 in its sidecar")
    if [r.get("id") for r in records] != expected_ids:
        raise CorruptShard(f"{shard} holds other conversation ids than its sidecar lists")
    return records, sidecar


def record_format(record: dict, fmt: str) -> str:
    """``messages`` (OpenAI) or ``sharegpt``: the shape of ``record`` under ``fmt`` (auto: by its keys)."""
    return fmt if fmt != "auto" else ("messages" if "messages" in record else "sharegpt")


def with_messages(record: dict, messages: list[Message], fmt: str) -> dict:
    """``record`` (every other field kept) with its message list replaced by ``messages``, in its own shape."""
    if record_format(record, fmt) == "messages":
        return {**record, "messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
    return {**record, "conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]}
                                        for m in messages]}


def complete_shards(directory: str | Path) -> list[Path]:
    """The shards of a finished regeneration, in order; ValueError if it is not finished."""
    generation = read_generation(directory)
    if not generation.get("complete"):
        raise ValueError(f"{directory}: the regeneration is not finished ({GENERATION_FILE} says complete=false); "
                         f"{_FIX.format(dir=directory)}")
    return [Path(directory) / name for name in generation["shards"]]


def read_source(path: str, fmt: str, stats: SkipStats) -> Iterator[list[Message]]:
    """Normalised conversations of a file (``iter_conversations``) or of a finished regeneration
    directory, whose shards are verified one by one before they are read."""
    if not is_regenerated_dir(path):
        yield from iter_conversations(path, fmt, stats)
        return
    for shard in complete_shards(path):
        try:
            records, _ = verify_shard(shard)
        except CorruptShard as err:
            raise ValueError(f"{err}; it is not read as training data: {_FIX.format(dir=path)}") from err
        for _, messages, _ in normalize_records(records, fmt, stats):
            if messages is not None:
                yield messages


def source_identity(path: str) -> dict:
    """What a data set built from ``path`` depends on: the bytes of a file (sha256, size), or the
    shards of a regeneration (their verified sha256s). The path itself is not part of it."""
    if is_regenerated_dir(path):
        digest = hashlib.sha256()
        for shard in complete_shards(path):
            try:
                _, sidecar = verify_shard(shard)
            except CorruptShard as err:
                raise ValueError(f"{err}; {_FIX.format(dir=path)}") from err
            digest.update(sidecar["sha256"].encode())
        return {"kind": "regenerated", "sha256": digest.hexdigest()}
    with resolve_path(path) as p, open(p, "rb") as f:
        digest = hashlib.file_digest(f, "sha256")
        return {"kind": "file", "sha256": digest.hexdigest(), "bytes": p.stat().st_size}
