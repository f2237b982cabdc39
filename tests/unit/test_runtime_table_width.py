"""A forward reads only the block-table columns its longest row needs (``paged_kv.table_columns``):
the width follows the batch's lengths in power-of-two buckets, and outputs (fp32, CPU) are token for token those
of forwards over the whole table, for plain decoding, chains and trees, on ragged batches that cross buckets."""

from __future__ import annotations

import pytest

import torchspec.runtime.paged_kv as paged_kv
import torchspec.runtime.steps as steps_module
from tests.runtime_pair import build_pair
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine

SPECS = [None, SpecConfig(shape="chain", depth=3), SpecConfig(shape="tree", depth=3, topk=2, num_nodes=6)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_tokenizer):
    target, drafter = build_pair(tmp_path_factory.mktemp("pair"), tiny_tokenizer, flavour="llama")
    return load_engine(target, drafter, device="cpu", dtype="float32", max_batch=3, max_context=256, page_size=4)


def test_columns_follow_the_longest_row_in_power_of_two_buckets(engine, monkeypatch):
    monkeypatch.setattr(paged_kv, "MIN_TABLE_KEYS", 16)
    assert engine.pages_per_row == 64
    assert [engine.table_columns_for(k) for k in (1, 16, 17, 32, 33, 100, 128, 129, 256, 10_000)] == \
        [4, 4, 8, 8, 16, 32, 32, 64, 64, 64]
    monkeypatch.setattr(paged_kv, "MIN_TABLE_KEYS", 1024)  # the default: a short batch reads 1,024 keys
    assert engine.table_columns_for(5) == 64  # ... or the whole table when that is smaller


@pytest.mark.parametrize("spec", SPECS, ids=["plain", "chain", "tree"])
def test_narrow_tables_give_the_whole_tables_outputs(engine, tiny_tokenizer, monkeypatch, spec):
    texts = ["hi", "a longer prompt", "one two"]  # its rows grow from ~16 keys past 64 (over 3+ buckets)
    prompts = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    widths = []
    build = steps_module.build_attention_meta

    def spy(block_table, *args, **kwargs):
        widths.append(block_table.shape[1])
        return build(block_table, *args, **kwargs)

    monkeypatch.setattr(steps_module, "build_attention_meta", spy)
    outputs = {}
    for min_keys in (8, 1 << 20):
        monkeypatch.setattr(paged_kv, "MIN_TABLE_KEYS", min_keys)
        engine.configure(spec=spec, concurrency=3)
        widths.clear()
        outputs[min_keys] = [r.token_ids for r in engine.generate(prompts, max_new_tokens=70, ignore_eos=True)]
        seen = sorted(set(widths))
        if min_keys == 8:  # the rows grow through several buckets: 8 keys (2 pages), 16, ... up to 128 (32 pages)
            assert len(seen) >= 3 and seen[-1] < engine.pages_per_row, seen
        else:
            assert seen == [engine.pages_per_row]
    assert outputs[8] == outputs[1 << 20]
    assert engine.free_pages == engine.total_pages  # every page back
