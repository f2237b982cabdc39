"""The output directory of ``data_pipelines.regenerate``: its identity and record (generation.json), the
check that a resumed output was made with the same settings and target weights, the shards that verify
(a corrupted one is reported and removed), and the book that writes shard k once all its records are resolved.

The layout itself (shards, sidecars, generation.json's format) is ``torchspec.data.regenerated``'s.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from data_pipelines.turns import Conversation
from torchspec.data.regenerated import (
    GENERATION_FILE,
    REGENERATED_FORMAT,
    CorruptShard,
    read_generation,
    sidecar_path,
    source_identity,
    verify_shard,
    with_messages,
    write_shard,
)
from torchspec.io import atomic_write_text

if TYPE_CHECKING:
    import torch

    from data_pipelines.regenerate import RegenerateConfig

# Settings that change what is generated: a rerun into an existing output must keep them.
IDENTITY_KEYS = ("format", "max_conversations", "shard_size", "max_new_tokens", "max_context", "temperature",
                 "top_p", "top_k", "seed")


def identity_of(cfg: RegenerateConfig, target_path: str, tokenizer, dtype: torch.dtype) -> dict:
    """What decides the output, compared with generation.json when a run resumes."""
    config_json = Path(target_path) / "config.json"
    return {"target_config_sha256": hashlib.sha256(config_json.read_bytes()).hexdigest(),
            "source": source_identity(cfg.source), "dtype": str(dtype).removeprefix("torch."),
            "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
            **{k: getattr(cfg, k) for k in IDENTITY_KEYS}}


def intact_shards(out: Path) -> set[int]:
    """Shards that verify; a corrupted one is reported by name and removed (it will be regenerated)."""
    intact = set()
    for leftover in out.glob(".shard_*"):  # temporaries of a writer that was killed
        leftover.unlink()
    for shard in sorted(out.glob("shard_*.jsonl")):
        try:
            verify_shard(shard)
            intact.add(int(shard.stem.split("_")[1]))
        except CorruptShard as err:
            print(f"{err}: regenerating it", flush=True)
            shard.unlink()
            sidecar_path(shard).unlink(missing_ok=True)
    return intact


class ShardBook:
    """Collects finished conversations by record index and writes shard k once every record of it is
    resolved (regenerated or skipped) and no later record can belong to it."""

    def __init__(self, out: Path, shard_size: int, fmt: str):
        self.out, self.size, self.fmt = out, shard_size, fmt
        self.records: Counter[int] = Counter()  # records seen, per open shard
        self.done: dict[int, dict[int, Conversation | str]] = {}  # shard -> record index -> conversation | skip
        self.closed_below = 0  # shards < this can get no more records

    def saw(self, index: int) -> None:
        shard = index // self.size
        self.records[shard] += 1
        self.done.setdefault(shard, {})
        self._close_below(shard)

    def resolve(self, index: int, outcome: Conversation | str) -> None:
        self.done[index // self.size][index] = outcome
        self._flush()

    def finish_input(self) -> None:
        self._close_below(max(self.records, default=-1) + 1)

    def _close_below(self, shard: int) -> None:
        self.closed_below = max(self.closed_below, shard)
        self._flush()

    def _flush(self) -> None:
        for shard in sorted(k for k in self.done if k < self.closed_below and len(self.done[k]) == self.records[k]):
            self._write(shard, self.done.pop(shard))
            del self.records[shard]

    def _write(self, shard: int, outcomes: dict[int, Conversation | str]) -> None:
        records, skipped, finish, turns, tokens = [], Counter(), Counter(), 0, 0
        for index in sorted(outcomes):
            outcome = outcomes[index]
            if isinstance(outcome, str):
                skipped[outcome] += 1
                continue
            if outcome.stopped:
                skipped[f"stopped_{outcome.stopped}" if outcome.replies else outcome.stopped] += 1
            if outcome.replies:
                records.append(with_messages(outcome.record, outcome.output(), self.fmt))
            finish.update(outcome.finish_reasons)
            turns, tokens = turns + len(outcome.replies), tokens + outcome.generated_tokens
        write_shard(self.out, shard, records, {
            "first_record": shard * self.size, "records": len(outcomes), "ids": [r.get("id") for r in records],
            "skipped": dict(skipped), "turns": turns, "generated_tokens": tokens, "finish_reasons": dict(finish)})


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def open_output(out: Path, identity: dict) -> dict | None:
    """The output's generation.json (None for a new output), refused if it was made with other settings."""
    if (out / GENERATION_FILE).is_file():
        generation = read_generation(out)
        changed = [f"{k}={generation['identity'].get(k)!r} (this run: {v!r})"
                   for k, v in identity.items() if generation["identity"].get(k) != v]
        if changed:
            raise ValueError(f"output={out} was generated with other settings: {'; '.join(changed)}; rerun with "
                             f"the settings of {out / GENERATION_FILE} or choose another output.")
        return generation
    if out.exists() and (out.is_file() or any(out.iterdir())):
        raise ValueError(f"output={out} exists and is not a regeneration output; choose another output.")
    out.mkdir(parents=True, exist_ok=True)
    return None


def start_record(out: Path, cfg: RegenerateConfig, identity: dict, generation: dict | None, engine,
                 target_path: str) -> dict:
    """Check the target's weights against a resumed output's and write generation.json (complete=false)."""
    fingerprint = check_fingerprint(out, cfg, generation, engine)
    record = {"format": REGENERATED_FORMAT, "version": 1, "identity": identity, "target": cfg.target,
              "target_path": target_path, "target_fingerprint": fingerprint, "settings": asdict(cfg),
              "created": (generation or {}).get("created", _now()), "updated": _now(),
              "torchspec_version": importlib.metadata.version("torchspec"), "complete": False}
    atomic_write_text(out / GENERATION_FILE, json.dumps(record, indent=1))
    return record


def check_fingerprint(out: Path, cfg: RegenerateConfig, generation: dict | None, engine) -> str:
    """The engine's target weights fingerprint, refused if a resumed output was made by other weights."""
    from torchspec.runtime.loading import decoder_identity

    fingerprint = decoder_identity(engine.decoder)["fingerprint"]
    if generation is not None and generation.get("target_fingerprint", fingerprint) != fingerprint:
        raise ValueError(f"output={out} was generated by a target with weights fingerprint "
                         f"{generation['target_fingerprint']}, {cfg.target} has {fingerprint}; choose another output.")
    return fingerprint


def finish_generation(out: Path, record: dict) -> None:
    """Mark the output complete in generation.json, with the shard list and totals from the sidecars."""
    shards = sorted(out.glob("shard_*.jsonl"))
    sidecars = [json.loads(sidecar_path(s).read_text()) for s in shards]
    if not any(s["conversations"] for s in sidecars):
        raise ValueError(f"source={record['settings']['source']}: not one conversation could be regenerated "
                         f"({[s['skipped'] for s in sidecars]}); check the file and max_context.")
    totals = Counter()
    for s in sidecars:
        totals.update(records=s["records"], conversations=s["conversations"], turns=s["turns"],
                      generated_tokens=s["generated_tokens"])
        totals.update({f"skipped_{k}": v for k, v in s["skipped"].items()})
    record = {**record, "complete": True, "finished": _now(), "shards": [s.name for s in shards], **totals}
    atomic_write_text(out / GENERATION_FILE, json.dumps(record, indent=1))
