"""data.eval_path: the held-out set from its own file (e.g. MT-Bench answered by the target), not a split.

* every example of data.path trains, except exact copies of a held-out one (dedup; counted), and the
  held-out set is the first eval_size conversations of eval_path in file order; dedup=false keeps a copy;
* a prepared data.path (its split is fixed) and an eval_path with nothing usable are refused in one line;
* ``tools/heldout_conversations.py`` writes MT-Bench as its 80 two-turn conversations and HumanEval as
  164 one-turn ones, assistant turns as placeholders for ``data_pipelines.regenerate``.
"""

from __future__ import annotations

import json

import pytest

from tests.tool_loader import load_tool
from torchspec.data import build_datasets, build_tiny_tokenizer

MAX_LENGTH = 256


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                         {"role": "assistant", "content": f"It is {2 * i}."}]}


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def key(example) -> tuple:
    return tuple(example.input_ids.tolist()), tuple(example.loss_mask.tolist())


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.mark.parametrize("dedup", [True, False])
def test_the_held_out_set_is_the_eval_files_first_conversations(tmp_path, tokenizer, dedup):
    train_file = write(tmp_path / "train.jsonl", [chat(i) for i in range(20)])  # chat(103) is not in it ...
    eval_file = write(tmp_path / "eval.jsonl", [chat(100 + i) for i in range(8)] + [chat(3)])  # ... chat(3) is
    train, held_out, stats = build_datasets(train_file, tokenizer, max_length=MAX_LENGTH, eval_size=5, seed=0,
                                            max_conversations=None, dedup=dedup, eval_path=eval_file)
    expected, _, _ = build_datasets(write(tmp_path / "e.jsonl", [chat(100 + i) for i in range(5)]), tokenizer,
                                    max_length=MAX_LENGTH, eval_size=0, seed=0, max_conversations=None)
    assert [key(e) for e in held_out] == [key(e) for e in expected]  # first 5, file order
    assert len(train) == 20 and stats.duplicates == 0  # chat(3) is the 9th of eval.jsonl: not held out

    eval_file = write(tmp_path / "eval2.jsonl", [chat(3)] + [chat(100 + i) for i in range(8)])
    train, held_out, stats = build_datasets(train_file, tokenizer, max_length=MAX_LENGTH, eval_size=5, seed=0,
                                            max_conversations=None, dedup=dedup, eval_path=eval_file)
    shared = {key(e) for e in held_out} & {key(e) for e in train}
    assert (len(train), stats.duplicates, len(shared)) == ((19, 1, 0) if dedup else (20, 0, 1))


def test_refusals(tmp_path, tokenizer, monkeypatch):
    train_file = write(tmp_path / "train.jsonl", [chat(i) for i in range(5)])
    empty = write(tmp_path / "none.jsonl", [{"messages": [{"role": "user", "content": "no reply"}]}])
    with pytest.raises(ValueError, match=r"^data.eval_path='.*none.jsonl': no conversation could be read from"):
        build_datasets(train_file, tokenizer, max_length=MAX_LENGTH, eval_size=4, seed=0, max_conversations=None,
                       eval_path=empty)
    monkeypatch.setattr("torchspec.data.prepared.is_prepared_dir", lambda path: path == "prepared")
    with pytest.raises(ValueError, match=r"^data.eval_path='e.jsonl' with the prepared directory 'prepared': its "
                                         r"held-out split is fixed when it is prepared"):
        build_datasets("prepared", tokenizer, max_length=MAX_LENGTH, eval_size=4, seed=0, max_conversations=None,
                       eval_path="e.jsonl")


def test_held_out_prompt_sets_as_conversations(tmp_path):
    tool = load_tool("heldout_conversations")
    mtbench = tool.conversations("mtbench", None)
    assert len(mtbench) == 80 and all(len(r["messages"]) == 4 for r in mtbench)
    assert [m["role"] for m in mtbench[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert mtbench[0]["messages"][1]["content"] == tool.PLACEHOLDER and mtbench[0]["id"] == "mtbench-0"
    humaneval = tool.conversations("humaneval", 3)
    assert len(humaneval) == 3 and humaneval[0]["messages"][0]["content"].startswith("Complete the following Python")
    out = tmp_path / "he.jsonl"
    tool.main(["--prompt-set", "humaneval", "--out", str(out)])
    assert len(out.read_text().splitlines()) == 164
