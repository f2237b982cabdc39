"""data.dedup: exact duplicate examples are dropped before the held-out split (torchspec.data.dataset.KeptExamples).

Greedy regeneration turns identical ShareGPT prompts into identical conversations (7.9% of the records
regenerated on the H200 repeat another's user turns); a held-out copy of a training conversation inflates
held-out acceptance. The file below holds
exact copies (same token ids and mask) and near-copies one token apart:

* dedup (the default) keeps the first occurrence of each example in file order, drops and counts the
  copies ("dropped N exact duplicate conversations"), keeps the near-copies, and no held-out example
  equals a training one, with the same seed and eval_size that leak a copy without dedup;
* ``max_conversations`` counts kept examples, not copies;
* dedup=false keeps today's examples, copies included.

The prepared path drops the same copies: tests/unit/test_data_pipelines_prepare.py.
"""

from __future__ import annotations

import json

import pytest

from torchspec.data import Example, build_datasets, build_tiny_tokenizer, tokenize_conversation

DISTINCT = 30
EVAL = 10
MAX_LENGTH = 256


def chat(i: int, answer: int | None = None) -> dict:
    answer = 2 * i if answer is None else answer
    return {"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                         {"role": "assistant", "content": f"It is {answer}."}]}


# (conversation, is an exact copy of an earlier one), in file order
RECORDS = [(chat(i), False) for i in range(DISTINCT)]
for position, record in [(3, (chat(0), True)), (9, (chat(0), True)), (17, (chat(5), True)), (25, (chat(12), True)),
                         (28, (chat(7, answer=15), False)),  # "It is 15." vs "It is 14.": one token apart, kept
                         (31, (chat(0), True)), (34, (chat(20), True))]:
    RECORDS.insert(position, record)
COPIES = sum(copy for _, copy in RECORDS)
KEPT = len(RECORDS) - COPIES


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("dedup") / "chats.jsonl"
    path.write_text("".join(json.dumps(conversation) + "\n" for conversation, _ in RECORDS))
    return str(path)


def key(example: Example) -> tuple:
    return tuple(example.input_ids.tolist()), tuple(example.loss_mask.tolist())


def build(path: str, tokenizer, **overrides):
    settings = {"max_length": MAX_LENGTH, "eval_size": EVAL, "seed": 0, "max_conversations": None} | overrides
    return build_datasets(path, tokenizer, **settings)


def test_exact_copies_are_dropped_before_the_split(data_file, tokenizer):
    train, held_out, stats = build(data_file, tokenizer)
    assert len(train) + len(held_out) == stats.kept == KEPT and len(held_out) == EVAL
    assert stats.duplicates == COPIES == 6 and stats.total_skipped == 0
    assert f"dropped {COPIES} exact duplicate conversations" in stats.summary()
    keys = [key(e) for e in train + held_out]
    assert len(set(keys)) == len(keys)  # no copy left, so no held-out example is also a training one

    everything, _, _ = build(data_file, tokenizer, eval_size=0)  # every kept example, in file order
    first_occurrences = [tokenize_conversation(tokenizer, c["messages"], MAX_LENGTH, "truncate")
                         for c, copy in RECORDS if not copy]
    assert [key(e) for e in everything] == [(tuple(ids), tuple(mask)) for ids, mask in first_occurrences]
    near = [e for e in everything if "Question 7:" in tokenizer.decode(e.input_ids)]
    assert len(near) == 2  # one token apart: both kept


def test_without_dedup_the_copies_stay_and_leak_into_the_held_out_set(data_file, tokenizer):
    train, held_out, stats = build(data_file, tokenizer, dedup=False)
    assert len(train) + len(held_out) == stats.kept == len(RECORDS) and stats.duplicates == 0
    assert "duplicate" not in stats.summary()
    assert {key(e) for e in train} & {key(e) for e in held_out}  # the leak dedup exists to prevent


def test_max_conversations_counts_kept_examples(data_file, tokenizer):
    cap = 20  # RECORDS[:23] hold 20 distinct conversations and 3 copies
    train, held_out, stats = build(data_file, tokenizer, max_conversations=cap, eval_size=4)
    assert len(train) + len(held_out) == stats.kept == cap and stats.duplicates == 3
    assert sum(not copy for _, copy in RECORDS[:23]) == cap and not RECORDS[23][1]
