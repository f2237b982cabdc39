"""Conversations -> chat-templated, assistant-masked, tokenised, split and packed Arrow data sets.

    python -m data_pipelines.prepare                                  # configs/prepare_sharegpt.yaml
    python -m data_pipelines.prepare --config prepare_sharegpt data.path=outputs/data/regenerated/smollm2 \\
        data.max_length=1024 output=outputs/data/prepared/smollm2_1024
    torchspec-train data.path=outputs/data/prepared/smollm2_1024 data.max_length=1024 ...   # the same data.* keys

Reads a ShareGPT / OpenAI-messages file (or a finished ``data_pipelines.regenerate`` output, every
shard verified) with ``torchspec.data`` (``read_source``), tokenises it with ``Dataset.map`` over
``num_proc`` processes (``template.tokenize_conversation``: the trainer's chat template and mask),
keeps the examples the trainer keeps (``dataset.KeptExamples``: exact duplicates dropped with
``data.dedup``, then the first ``data.max_conversations``), splits them with the trainer's rule
(``dataset.held_out_indices``), packs the training split with ``packing.pack_examples`` when
``data.pack``, and writes ``torchspec.data.prepared``'s layout.

Fingerprint and reuse: an output whose manifest has this run's fingerprint (tokenizer, chat template,
``data.*``, the source's bytes) is reused ("reused <dir>"); any change rebuilds it. Resume: the
source is tokenised in chunks of ``chunk_size`` conversations, each cached as Arrow files in a work
directory named by the fingerprint, so a killed run restarts where it was; the result is written to
a temporary directory and renamed into place, so ``output`` is always a whole prepared set or absent.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import itertools
import json
import math
import os
import shutil
import time
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import MISSING
from tqdm import tqdm

from data_pipelines.config import run_pipeline
from torchspec.config import DataConfig, validate_data_config
from torchspec.data.dataset import Example, KeptExamples, held_out_indices
from torchspec.data.formats import SkipConversation, SkipStats
from torchspec.data.packing import pack_examples
from torchspec.data.prepared import (
    EXAMPLE_SETTINGS,
    MANIFEST,
    PREPARED_FORMAT,
    ROW_SETTINGS,
    Rows,
    fingerprint,
    is_prepared_dir,
    prepared_identity,
    read_manifest,
    save_rows,
)
from torchspec.data.regenerated import read_source, source_identity
from torchspec.data.template import tokenize_conversation
from torchspec.io import atomic_save_dir, atomic_write_text

PROG = "data_pipelines.prepare"


@dataclass
class PrepareConfig:
    target: str = "smollm2"  # whose tokenizer and chat template: the trainer's target.path
    cache_dir: str = "~/.cache/torchspec"  # where a .gguf target is converted once
    output: str = MISSING  # the prepared directory: torchspec-train data.path=<output>
    num_proc: int = 4  # processes of Dataset.map
    chunk_size: int = 4096  # conversations per tokenisation chunk (the unit a killed run restarts from)
    data: DataConfig = field(default_factory=DataConfig)  # the trainer's data.* keys; data.path is the source


def prepare(cfg: PrepareConfig) -> Path:
    """Build (or reuse) ``cfg.output``; returns it. See the module docstring."""
    from torchspec.targets import load_tokenizer, resolve_target_path

    d, out = cfg.data, Path(cfg.output)
    validate_data_config(d)
    if cfg.num_proc < 1 or cfg.chunk_size < 1:
        raise ValueError(f"num_proc={cfg.num_proc} and chunk_size={cfg.chunk_size} must be >= 1.")
    if out.exists() and not is_prepared_dir(out) and (out.is_file() or any(out.iterdir())):
        raise ValueError(f"output={out} exists and is not a prepared directory; choose another output.")
    target_path = resolve_target_path(cfg.target, os.path.expanduser(cfg.cache_dir))
    tokenizer = load_tokenizer(target_path)
    if d.chat_template is not None:
        tokenizer.chat_template = d.chat_template
    settings = {k: getattr(d, k) for k in EXAMPLE_SETTINGS + ROW_SETTINGS}
    identity = prepared_identity(tokenizer, settings, source_identity(d.path))
    fp = fingerprint(identity)
    if is_prepared_dir(out):
        try:
            old = read_manifest(out)
        except ValueError as err:  # damaged: rebuilt like a changed one
            print(f"rebuilding {out}: {err}", flush=True)
        else:
            if old["fingerprint"] == fp:
                print(f"reused {out} (fingerprint {fp[:12]}: {old['counts']['train']['conversations']} train / "
                      f"{old['counts']['eval']['conversations']} held-out conversations); nothing to do", flush=True)
                return out
            print(f"rebuilding {out}: {', '.join(_changed(old['identity'], identity))} changed", flush=True)

    started = time.perf_counter()
    work = out.parent / f".{out.name}.work-{fp[:16]}-{cfg.chunk_size}"
    work.mkdir(parents=True, exist_ok=True)
    tokens = tokenize_source(cfg, tokenizer, fp, work)
    train, evaluation, stats = split_and_pack(tokens, d)
    manifest = {"format": PREPARED_FORMAT, "fingerprint": fp, "identity": identity,
                "settings": {"target": cfg.target, "tokenizer_path": target_path, "data": asdict(d)},
                "counts": {"train": train.counts(), "eval": evaluation.counts()},
                "skips": {"kept": stats.kept, "skipped": dict(stats.skipped), "repaired": dict(stats.repaired),
                          "duplicates": stats.duplicates},
                "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "torchspec_version": importlib.metadata.version("torchspec")}

    def write(tmp: Path) -> None:
        save_rows(train, tmp / "train")
        save_rows(evaluation, tmp / "eval")
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))  # last: a manifest means complete

    atomic_save_dir(out, write)
    for stale in out.parent.glob(f".{out.name}.work-*"):  # ours, and those of killed runs of other settings
        shutil.rmtree(stale, ignore_errors=True)
    elapsed = time.perf_counter() - started
    read, total = tokens.conversations, int(tokens.lengths.sum())
    print(f"prepared {out}: {stats.summary()}; {train.counts()['rows']} train rows, {total} tokens in "
          f"{elapsed:.1f} s ({read / elapsed:.1f} conversations/s, {total / elapsed:.0f} tokens/s)", flush=True)
    return out


def _changed(old: dict, new: dict) -> list[str]:
    keys = [f"data.{k}" for k in new["data"] if old.get("data", {}).get(k) != new["data"][k]]
    if old.get("tokenizer", {}).get("chat_template_sha256") != new["tokenizer"]["chat_template_sha256"]:
        keys.append("chat template")
    if {k: v for k, v in old.get("tokenizer", {}).items() if k != "chat_template_sha256"} != \
            {k: v for k, v in new["tokenizer"].items() if k != "chat_template_sha256"}:
        keys.append("tokenizer")
    if old.get("source") != new["source"]:
        keys.append("source data")
    return keys or ["format version"]


@dataclass
class Tokenized:
    """Every tokenised conversation, in source order, as flat columns (skipped ones have length 0),
    and which of them are examples (``KeptExamples``, as ``build_datasets`` keeps them)."""

    input_ids: np.ndarray  # [N] int32
    loss_mask: np.ndarray  # [N] int8
    lengths: np.ndarray  # [C] tokens per conversation
    examples: list[int]  # source positions of the kept examples, in source order
    stats: SkipStats  # reading, tokenisation skips and duplicates, counted as build_datasets counts them
    conversations: int  # conversations read and tokenised


def _tokenize_batch(batch: dict, tokenizer, max_length: int, on_too_long: str) -> dict:
    """Dataset.map function (in a worker process): the trainer's tokenisation, skips as reasons."""
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "skip": []}
    for messages in batch["messages"]:
        try:
            ids, mask = tokenize_conversation(tokenizer, messages, max_length, on_too_long)
            reason = ""
        except SkipConversation as skip:
            ids, mask, reason = [], [], skip.reason
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["skip"].append(reason)
    return out


def tokenize_source(cfg: PrepareConfig, tokenizer, fp: str, work: Path) -> Tokenized:
    """Tokenise the source chunk by chunk (each cached under ``work``) and select the examples in source
    order, until ``max_conversations`` are kept or the source ends."""
    import datasets

    d, cap = cfg.data, cfg.data.max_conversations
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "loss_mask": datasets.List(datasets.Value("int8")),
                                  "skip": datasets.Value("string")})
    stats, read = SkipStats(), 0
    kept = KeptExamples(stats, d.dedup, cap)
    ids, masks, lengths, examples = [], [], [], []
    bar = tqdm(total=cap, desc="prepare", unit="conv", dynamic_ncols=True, mininterval=1)
    progress_bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()  # one bar for the whole source, not one per chunk
    try:
        with closing(read_source(d.path, d.format, stats)) as stream:
            for k in itertools.count():
                want = cfg.chunk_size if cap is None else min(cfg.chunk_size, max(64, math.ceil(1.25 * (cap - kept.kept))))
                chunk = list(itertools.islice(stream, want))
                if not chunk:
                    break
                processes = min(cfg.num_proc, len(chunk))
                table = datasets.Dataset.from_dict({"messages": chunk}).map(  # num_proc=1 would still fork one
                    _tokenize_batch, batched=True, batch_size=64, num_proc=processes if processes > 1 else None,
                    remove_columns=["messages"], features=features, new_fingerprint=f"{fp[:16]}-{k}",
                    cache_file_name=str(work / f"chunk_{k:05d}.arrow"),
                    fn_kwargs={"tokenizer": tokenizer, "max_length": d.max_length, "on_too_long": d.on_too_long},
                ).data.table
                ids.append(table.column("input_ids").combine_chunks().flatten().to_numpy())
                masks.append(table.column("loss_mask").combine_chunks().flatten().to_numpy())
                lengths.append(table.column("input_ids").combine_chunks().value_lengths().to_numpy())
                before, starts = kept.kept, np.concatenate([[0], np.cumsum(lengths[-1])])
                for j, reason in enumerate(table.column("skip").to_pylist()):  # as build_datasets, one by one
                    if reason:
                        stats.skip(reason)
                    elif kept.keep(ids[-1][starts[j]:starts[j + 1]], masks[-1][starts[j]:starts[j + 1]]):
                        examples.append(read + j)
                    if kept.full:
                        break
                read += len(chunk)
                bar.update(kept.kept - before if cap is not None else len(chunk))
                bar.set_postfix(tokens=int(sum(x.sum() for x in lengths)))
                if kept.full:
                    break
    finally:
        bar.close()
        if progress_bars:
            datasets.utils.logging.enable_progress_bar()
    flat = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
    stats.kept = kept.kept
    return Tokenized(flat(ids, np.int32), flat(masks, np.int8), flat(lengths, np.int64), examples, stats, read)


def split_and_pack(tokens: Tokenized, d: DataConfig) -> tuple[Rows, Rows, SkipStats]:
    """The kept examples split by the trainer's rule, the training split packed."""
    stats, survivors = tokens.stats, tokens.examples
    if len(survivors) < d.eval_size + 1:
        raise ValueError(f"only {len(survivors)} examples survived from {d.path!r}, fewer than data.eval_size + 1 = "
                         f"{d.eval_size + 1} ({stats.summary()}); use a larger file, a smaller data.eval_size, or a "
                         f"larger data.max_length")
    held_out = held_out_indices(len(survivors), d.eval_size, d.seed)
    train = [s for i, s in enumerate(survivors) if i not in held_out]
    evaluation = [s for i, s in enumerate(survivors) if i in held_out]
    plan = packing_plan(tokens.lengths[train].tolist(), d.max_length) if d.pack else [[i] for i in range(len(train))]
    return _rows(tokens, train, plan), _rows(tokens, evaluation, [[i] for i in range(len(evaluation))]), stats


def packing_plan(lengths: list[int], max_length: int) -> list[list[int]]:
    """``pack_examples``'s rows as lists of example indices. pack_examples sees only lengths and order,
    so stand-in examples (a constant tensor of their own index) get packed exactly as the real ones
    would, and the first token of each document of a row names it."""
    stand_ins = [Example(torch.full((n,), i, dtype=torch.int32), torch.zeros(n, dtype=torch.int8))
                 for i, n in enumerate(lengths)]
    plan = []
    for row in pack_examples(stand_ins, max_length):
        starts = np.cumsum([0, *row.document_lengths[:-1]])
        plan.append(row.input_ids[torch.from_numpy(starts)].tolist())
    return plan


def _rows(tokens: Tokenized, split: list[int], plan: list[list[int]]) -> Rows:
    """The split's documents (source positions ``split``) laid out row by row as ``plan`` says."""
    order = np.array([i for row in plan for i in row], dtype=np.int64)  # split positions, in row order
    source = np.array(split, dtype=np.int64)[order]
    starts = np.concatenate([[0], np.cumsum(tokens.lengths)])[source]
    lengths = tokens.lengths[source]
    out_starts = np.cumsum(lengths) - lengths
    index = np.arange(int(lengths.sum())) - np.repeat(out_starts, lengths) + np.repeat(starts, lengths)
    return Rows(tokens.input_ids[index], tokens.loss_mask[index], np.array([len(r) for r in plan], dtype=np.int64),
                lengths, order)


def main(argv: list[str] | None = None) -> None:
    run_pipeline(PROG, __doc__, PrepareConfig, "prepare_sharegpt", prepare, argv)


if __name__ == "__main__":
    main()
