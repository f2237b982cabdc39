"""Prepared data sets: tokenised, masked, split and packed once (``data_pipelines.prepare``), read by the trainer.

A prepared directory holds two HuggingFace ``datasets`` saved with ``save_to_disk`` (Arrow, memory
mapped on load) and a manifest::

    manifest.json   format, fingerprint, identity (tokenizer, chat template, data settings, source),
                    settings, counts per split (rows, conversations, tokens, loss tokens), skip
                    statistics, date, torchspec version
    train/          training rows: one conversation each, or packed rows (``packing.pack_examples``)
    eval/           the held-out conversations, one per row

Both splits have the columns input_ids (int32), loss_mask (int8), and per document of a row its
length and its index in the split (document_lengths, document_indices): ``Rows``.

The examples are those ``build_datasets`` would keep (``dataset.KeptExamples``: exact duplicates
dropped with ``data.dedup``, the ``max_conversations`` cap) and the split is ``dataset.held_out_indices``
over them, so the trainer gets exactly the examples of the in-process path. ``build_datasets`` recognises a prepared
directory by its manifest (``data.path=<dir>``) and calls ``load_prepared``: no tokenisation at
start-up. The training examples come back unpacked, in split order, so ``data.pack`` keeps its
meaning; ``pack_examples`` of them gives the stored rows again (``load_train_rows``).

Fingerprint rule: the sha256 of ``identity`` = the tokenizer (vocabulary hash, special tokens), the
chat template text (hash), the data settings that decide the examples (``EXAMPLE_SETTINGS``),
``pack`` and the source's bytes. ``load_prepared`` compares everything but the source (the trainer
does not read it) with the run's tokenizer and ``data.*`` keys and refuses a mismatch in one line
naming the directory, every differing key and the fix.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from torchspec.cli import read_json
from torchspec.data.dataset import Example
from torchspec.data.formats import SkipStats

PREPARED_FORMAT = "torchspec-prepared"
PREPARED_VERSION = 2  # 2: data.dedup in the identity, skips.duplicates in the manifest
MANIFEST = "manifest.json"
# data.* keys that decide which examples exist and how they split; pack decides only the stored rows.
EXAMPLE_SETTINGS = ("format", "max_length", "on_too_long", "max_conversations", "eval_size", "seed", "dedup")
ROW_SETTINGS = ("pack",)
_REPREPARE = "python -m data_pipelines.prepare"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> dict:
    """What tokenisation depends on: the vocabulary (hash), special tokens and the chat template (hash)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return {"vocab_sha256": _sha256(json.dumps(vocab, ensure_ascii=False)), "vocab_size": len(tokenizer),
            "special_tokens": {k: str(v) if v is not None else None for k, v in special.items()},
            "chat_template_sha256": _sha256(tokenizer.chat_template or "")}


def prepared_identity(tokenizer: PreTrainedTokenizerBase, settings: dict, source: dict) -> dict:
    """The fingerprinted identity of a prepared set: ``settings`` are the ``data.*`` values."""
    return {"version": PREPARED_VERSION, "tokenizer": tokenizer_identity(tokenizer),
            "data": {k: settings[k] for k in EXAMPLE_SETTINGS + ROW_SETTINGS}, "source": source}


def fingerprint(identity: dict) -> str:
    return _sha256(json.dumps(identity, sort_keys=True))


def is_prepared_dir(path: str | Path) -> bool:
    """A directory holding a prepared manifest (any other path is a conversation source)."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == PREPARED_FORMAT
    except (ValueError, AttributeError):
        return True  # a damaged manifest in a prepared directory: read_manifest names it


def read_manifest(path: str | Path) -> dict:
    fix = f"prepare it again ({_REPREPARE} ... output={path})"
    manifest = read_json(Path(path) / MANIFEST, fix)
    if manifest.get("format") != PREPARED_FORMAT or manifest.get("identity", {}).get("version") != PREPARED_VERSION:
        raise ValueError(f"{Path(path) / MANIFEST}: not a version {PREPARED_VERSION} {PREPARED_FORMAT} manifest; {fix}")
    return manifest


def identity_mismatches(prepared: dict, tokenizer: PreTrainedTokenizerBase, settings: dict) -> list[str]:
    """How a prepared set's identity differs from this tokenizer and these ``data.*`` settings."""
    problems = []
    theirs, mine = prepared["tokenizer"], tokenizer_identity(tokenizer)
    if {k: v for k, v in theirs.items() if k != "chat_template_sha256"} != \
            {k: v for k, v in mine.items() if k != "chat_template_sha256"}:
        problems.append(f"it was tokenised with another tokenizer (vocab sha256 {theirs['vocab_sha256'][:12]}, "
                        f"{theirs['vocab_size']} tokens) than the target's ({mine['vocab_sha256'][:12]}, "
                        f"{mine['vocab_size']} tokens)")
    if theirs["chat_template_sha256"] != mine["chat_template_sha256"]:
        problems.append(f"its chat template (sha256 {theirs['chat_template_sha256'][:12]}) differs from this run's "
                        f"({mine['chat_template_sha256'][:12]}, data.chat_template or the tokenizer's)")
    for key in EXAMPLE_SETTINGS:
        if prepared["data"][key] != settings[key]:
            problems.append(f"it was prepared with data.{key}={json.dumps(prepared['data'][key])}, "
                            f"this run has data.{key}={json.dumps(settings[key])}")
    return problems


@dataclass
class Rows:
    """One split as flat columns: the tokens of all rows back to back, and per row its documents.

    Row r holds ``row_documents[r]`` documents; document d (in row order) has ``document_lengths[d]``
    tokens and is example ``document_indices[d]`` of the split (unpacked, split order)."""

    input_ids: np.ndarray  # [N] int32
    loss_mask: np.ndarray  # [N] int8
    row_documents: np.ndarray  # [R]
    document_lengths: np.ndarray  # [D]
    document_indices: np.ndarray  # [D]

    def counts(self) -> dict[str, int]:
        """What the manifest records of a split, and what loading checks."""
        return {"rows": len(self.row_documents), "conversations": len(self.document_lengths),
                "tokens": len(self.input_ids), "loss_tokens": int(self.loss_mask.sum(dtype=np.int64))}

    def examples(self) -> list[Example]:
        """The documents as single-conversation examples, in split order (long tensors)."""
        ids, mask = torch.from_numpy(self.input_ids.astype(np.int64)), torch.from_numpy(self.loss_mask.astype(np.int64))
        lengths = self.document_lengths.tolist()
        out: list[Example | None] = [None] * len(lengths)
        for i, m, index in zip(torch.split(ids, lengths), torch.split(mask, lengths), self.document_indices.tolist()):
            out[index] = Example(i, m)
        assert all(e is not None for e in out), "document_indices are not a permutation"
        return out  # type: ignore[return-value]

    def rows(self, packed: bool) -> list[Example]:
        """The rows as stored; packed rows carry their document_lengths."""
        ids, mask = torch.from_numpy(self.input_ids.astype(np.int64)), torch.from_numpy(self.loss_mask.astype(np.int64))
        starts = np.concatenate([[0], np.cumsum(self.row_documents)])
        docs = [tuple(self.document_lengths[a:b].tolist()) for a, b in zip(starts[:-1], starts[1:])]
        lengths = [sum(d) for d in docs]
        return [Example(i, m, d if packed else None)
                for i, m, d in zip(torch.split(ids, lengths), torch.split(mask, lengths), docs)]


def save_rows(rows: Rows, directory: Path) -> None:
    """``rows`` as a ``datasets.Dataset`` saved to ``directory`` (Arrow)."""
    import datasets
    import pyarrow as pa

    starts = np.concatenate([[0], np.cumsum(rows.row_documents)]).astype(np.int64)
    token_starts = np.concatenate([[0], np.cumsum(rows.document_lengths)]).astype(np.int64)
    row_offsets = token_starts[starts]

    def column(values: np.ndarray, offsets: np.ndarray) -> pa.LargeListArray:  # int64 offsets: > 2^31 tokens
        return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(values))

    table = pa.table({
        "input_ids": column(rows.input_ids.astype(np.int32), row_offsets),
        "loss_mask": column(rows.loss_mask.astype(np.int8), row_offsets),
        "document_lengths": column(rows.document_lengths.astype(np.int32), starts),
        "document_indices": column(rows.document_indices.astype(np.int32), starts),
    })
    datasets.Dataset(datasets.table.InMemoryTable(table)).save_to_disk(str(directory))


def read_rows(directory: Path) -> Rows:
    import datasets
    import pyarrow as pa

    try:
        table = datasets.load_from_disk(str(directory)).data.table
        columns = {name: table.column(name).combine_chunks() for name in
                   ("input_ids", "loss_mask", "document_lengths", "document_indices")}
    except (FileNotFoundError, KeyError, pa.ArrowException, ValueError) as err:
        raise ValueError(f"{directory}: unreadable prepared split ({type(err).__name__}: "
                         f"{' '.join(str(err).split())[:160]}); prepare it again ({_REPREPARE})") from err
    flat = {name: array.flatten().to_numpy(zero_copy_only=False) for name, array in columns.items()}
    return Rows(flat["input_ids"], flat["loss_mask"], columns["document_lengths"].value_lengths().to_numpy(),
                flat["document_lengths"], flat["document_indices"])


def read_split(path: str | Path, split: str, manifest: dict) -> Rows:
    """A split of a prepared directory, its row and token counts checked against the manifest."""
    rows = read_rows(Path(path) / split)
    counts, found = manifest["counts"][split], rows.counts()
    if found != counts or len(rows.loss_mask) != len(rows.input_ids) \
            or int(rows.document_lengths.sum()) != len(rows.input_ids) or int(rows.row_documents.sum()) != len(rows.document_lengths):
        raise ValueError(f"{Path(path) / split}: holds {found}, but {MANIFEST} says {counts}; the directory is "
                         f"damaged, prepare it again ({_REPREPARE})")
    return rows


@dataclass
class PreparedData:
    train: list[Example]  # one conversation each, in split order (what build_datasets returns)
    eval: list[Example]
    stats: SkipStats
    manifest: dict


def load_prepared(path: str | Path, tokenizer: PreTrainedTokenizerBase, settings: dict) -> PreparedData:
    """Read a prepared directory for a run whose tokenizer (chat template set) and ``data.*`` values
    are given; a mismatch (module docstring) or a damaged directory is a ValueError naming it."""
    manifest = read_manifest(path)
    problems = identity_mismatches(manifest["identity"], tokenizer, settings)
    if problems:
        raise ValueError(f"data.path={path}: {'; '.join(problems)}; prepare it for this run ({_REPREPARE} "
                         f"with these data.* values and the run's target, into another output) or set the run's "
                         f"data.* keys to those in {Path(path) / MANIFEST}")
    train, evaluation = read_split(path, "train", manifest), read_split(path, "eval", manifest)
    skips = manifest["skips"]
    stats = SkipStats(kept=skips["kept"], skipped=Counter(skips["skipped"]), repaired=Counter(skips["repaired"]),
                      duplicates=skips["duplicates"])
    return PreparedData(train.examples(), evaluation.examples(), stats, manifest)


def load_train_rows(path: str | Path) -> list[Example]:
    """The stored training rows (packed ones with their document_lengths), to use them as they are."""
    manifest = read_manifest(path)
    return read_split(path, "train", manifest).rows(packed=manifest["identity"]["data"]["pack"])
