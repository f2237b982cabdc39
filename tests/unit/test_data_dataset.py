"""Tests for torchspec.data.dataset: held-out split, collation, resumable sampling, rank sharding."""

from __future__ import annotations

import json

import pytest
import torch

from torchspec.data import (
    CHATML_TEMPLATE,
    Example,
    ResumableBatchSampler,
    build_datasets,
    build_tiny_tokenizer,
    collate,
    shard_for_rank,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture()
def data_file(tmp_path):
    """40 distinct conversations, one without a reply, one very long, one malformed line."""
    lines = [
        json.dumps({"messages": [
            {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
            {"role": "assistant", "content": f"It is {2 * i}."},
        ]})
        for i in range(40)
    ]
    lines.append(json.dumps({"messages": [{"role": "user", "content": "no reply"}]}))
    lines.append(json.dumps({"messages": [{"role": "user", "content": "long"},
                                          {"role": "assistant", "content": "word " * 400}]}))
    lines.append("{broken")
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _key(example: Example) -> tuple[int, ...]:
    return tuple(example.input_ids.tolist())


def _build(path, tokenizer, **overrides):
    kwargs = dict(max_length=256, eval_size=8, seed=0, max_conversations=None)
    return build_datasets(path, tokenizer, **(kwargs | overrides))


def test_split_is_fixed_by_seed_and_disjoint(data_file, tokenizer):
    train, held_out, stats = _build(data_file, tokenizer)
    assert len(held_out) == 8 and len(train) == 41 - 8
    assert stats.kept == 41
    assert stats.skipped == {"no_assistant_turn": 1, "malformed_json_line": 1}
    train_keys, eval_keys = {_key(e) for e in train}, {_key(e) for e in held_out}
    assert len(train_keys) == len(train) and not train_keys & eval_keys

    torch.manual_seed(1234)  # the global RNG must not matter
    train2, held_out2, _ = _build(data_file, tokenizer)
    assert [_key(e) for e in held_out2] == [_key(e) for e in held_out]
    assert [_key(e) for e in train2] == [_key(e) for e in train]

    _, held_out3, _ = _build(data_file, tokenizer, seed=1)
    assert {_key(e) for e in held_out3} != eval_keys


def test_examples_are_long_tensors_with_masks(data_file, tokenizer):
    train, _, _ = _build(data_file, tokenizer, eval_size=0)
    for example in train:
        assert example.input_ids.dtype == example.loss_mask.dtype == torch.long
        assert example.input_ids.shape == example.loss_mask.shape and len(example) <= 256
        assert 0 < int(example.loss_mask.sum()) < len(example)


def test_too_long_policy_and_max_conversations(data_file, tokenizer):
    train, held_out, stats = _build(data_file, tokenizer, on_too_long="skip")
    assert len(train) + len(held_out) == 40 and stats.skipped["too_long"] == 1
    assert "too_long: 1" in stats.summary()

    train, held_out, stats = _build(data_file, tokenizer, max_conversations=12, eval_size=2)
    assert len(train) == 10 and len(held_out) == 2 and stats.kept == 12
    assert stats.total_skipped == 0  # reading stopped before the bad records


def test_too_few_examples_raise_with_summary(data_file, tokenizer):
    with pytest.raises(ValueError, match=r"only 41 examples survived .*fewer than eval_size \+ 1 = 42.*kept 41"):
        _build(data_file, tokenizer, eval_size=41)
    with pytest.raises(ValueError, match="max_conversations=5"):
        _build(data_file, tokenizer, max_conversations=5, eval_size=5)


def test_chat_template_argument_is_applied(data_file):
    bare = build_tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="data.chat_template"):
        _build(data_file, bare)
    train, _, _ = _build(data_file, bare, chat_template=CHATML_TEMPLATE.replace("helpful", "tiny"))
    assert "You are a tiny assistant." in bare.decode(train[0].input_ids)


def test_collate_pads_right():
    examples = [
        Example(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 1])),
        Example(torch.tensor([8]), torch.tensor([1])),
    ]
    batch = collate(examples, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())


def _take(sampler: ResumableBatchSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_epochs_are_seeded_permutations():
    sampler = ResumableBatchSampler(num_examples=10, batch_size=3, seed=7)
    assert sampler.batches_per_epoch == 3
    for epoch in range(3):
        assert sampler.epoch == epoch
        batches = _take(sampler, 3)
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(7 + epoch)).tolist()[:9]
        assert sum(batches, []) == expected  # last incomplete batch dropped
    assert sampler.state_dict() == {"epoch": 3, "position": 0}
    assert sum(_take(ResumableBatchSampler(10, 3, seed=8), 3), []) != sum(
        _take(ResumableBatchSampler(10, 3, seed=7), 3), []
    )


@pytest.mark.parametrize("stop_after", [0, 1, 3, 5, 7])
def test_sampler_resume_equals_uninterrupted(stop_after):
    reference = _take(ResumableBatchSampler(num_examples=11, batch_size=4, seed=3), 12)
    first = ResumableBatchSampler(num_examples=11, batch_size=4, seed=3)
    head = _take(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = ResumableBatchSampler(num_examples=11, batch_size=4, seed=3)
    _take(resumed, 3)  # a sampler already mid-way through another epoch must forget it
    resumed.load_state_dict(state)
    assert head + _take(resumed, 12 - stop_after) == reference
    assert resumed.epoch == 12 // 2


def test_sampler_rejects_bad_sizes_and_states():
    with pytest.raises(ValueError, match="batch_size=8 is larger than the 5"):
        ResumableBatchSampler(num_examples=5, batch_size=8, seed=0)
    sampler = ResumableBatchSampler(num_examples=8, batch_size=4, seed=0)
    with pytest.raises(ValueError, match="position=2 is out of range"):
        sampler.load_state_dict({"epoch": 0, "position": 2})
    with pytest.raises(ValueError, match="expected \\['epoch', 'position'\\]"):
        sampler.load_state_dict({"epoch": 0})
    assert next(iter(sampler)) == sampler.__class__(8, 4, 0).next_batch()


def test_shard_for_rank():
    batch = [9, 4, 7, 1, 3, 8]
    shards = [shard_for_rank(batch, rank, 3) for rank in range(3)]
    assert shards == [[9, 1], [4, 3], [7, 8]]
    assert sorted(sum(shards, [])) == sorted(batch)
    with pytest.raises(ValueError, match="does not split evenly over world=4"):
        shard_for_rank(batch, 0, 4)
    with pytest.raises(ValueError, match="rank=3 is outside"):
        shard_for_rank(batch, 3, 3)
