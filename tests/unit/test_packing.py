"""Sequence packing: the packer, collate's position/document ids, and the parity that matters: a
packed row computes exactly what its documents compute in rows of their own -- in the drafter's
TTT attention (every backend, with windows and diagonal steps), in a whole drafter step (RoPE
positions restarting per document), and in the tensor-parallel target's union forward."""

from __future__ import annotations

import warnings

import pytest
import torch

from torchspec.data import Example, ResumableBatchSampler, build_datasets, collate
from torchspec.data.packing import document_positions, pack_examples
from torchspec.models.attention import (
    _build_block_mask,
    ttt_attention_chunked,
    ttt_attention_eager,
    ttt_attention_flex,
)
from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter
from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter
from torchspec.targets import TargetDecoder


def example(n: int, first: int = 0) -> Example:
    ids = torch.arange(first, first + n)
    return Example(ids, (ids % 2 == 0).long())


# --- packer and collate ----------------------------------------------------------------------------

def test_best_fit_decreasing_toy_example():
    examples = [example(n, first=10 * i) for i, n in enumerate([5, 3, 6, 2, 4])]
    rows = pack_examples(examples, max_length=8)
    assert [r.document_lengths for r in rows] == [(6, 2), (5, 3), (4,)]
    # Row 0 is conversation 2 then conversation 3, ids and loss masks side by side.
    assert rows[0].input_ids.tolist() == examples[2].input_ids.tolist() + examples[3].input_ids.tolist()
    assert rows[0].loss_mask.tolist() == examples[2].loss_mask.tolist() + examples[3].loss_mask.tolist()


def test_every_conversation_packed_once_within_max_length():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 65, (300,), generator=g).tolist()
    examples = [example(n, first=1000 * i) for i, n in enumerate(lengths)]
    rows = pack_examples(examples, max_length=64)
    assert all(len(r) <= 64 and sum(r.document_lengths) == len(r) for r in rows)
    starts = sorted(int(d[0]) for r in rows for d in r.input_ids.split(list(r.document_lengths)))
    assert starts == [1000 * i for i in range(300)]
    assert len(rows) <= 1.1 * sum(lengths) / 64 + 1  # best fit fills rows almost completely
    again = pack_examples(examples, max_length=64)  # deterministic: no RNG involved
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(rows, again))


def test_packer_rejects_bad_input():
    with pytest.raises(ValueError, match="longer than max_length=4"):
        pack_examples([example(5)], max_length=4)
    with pytest.raises(ValueError, match="already packed"):
        pack_examples(pack_examples([example(2), example(2)], max_length=4), max_length=4)


def test_collate_packed_and_unpacked_rows():
    packed = pack_examples([example(3), example(2, first=50)], max_length=8)[0]
    batch = collate([packed, example(7, first=80)], pad_id=0, packed=True)
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 2, [1] * 7]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1, -1, -1], [0] * 7]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3], list(range(7))]
    masks = example(3).loss_mask.tolist() + example(2, 50).loss_mask.tolist()
    assert batch["loss_mask"][0].tolist() == masks + [0, 0]
    real = batch["attention_mask"].bool()
    assert torch.equal(document_positions(batch["document_ids"])[real], batch["position_ids"][real])
    unpacked = collate([example(3), example(5)], pad_id=0)  # unpacked data: arange, no document ids
    assert unpacked["position_ids"].tolist() == [list(range(5))] * 2
    assert "document_ids" not in unpacked
    as_packed = collate([example(3), example(5)], pad_id=0, packed=True)
    assert as_packed["document_ids"].tolist() == [[0, 0, 0, -1, -1], [0] * 5]
    assert all(t.dtype == torch.long for t in batch.values())


def test_packed_rows_sample_resumably(tiny_chat_jsonl, tiny_tokenizer):
    """Packing is a pure function of the examples, so the packed data loader resumes exactly."""
    train, _, _ = build_datasets(tiny_chat_jsonl, tiny_tokenizer, max_length=512, eval_size=4, seed=0,
                                 max_conversations=None)
    rows = pack_examples(train, 512)
    assert len(rows) < len(train) and sum(len(r) for r in rows) == sum(len(e) for e in train)

    def batches(sampler, n):
        return [collate([rows[i] for i in sampler.next_batch()], pad_id=0)["input_ids"] for _ in range(n)]

    reference = batches(ResumableBatchSampler(len(rows), 2, seed=1), 9)
    first = ResumableBatchSampler(len(rows), 2, seed=1)
    head = batches(first, 4)
    resumed = ResumableBatchSampler(len(rows), 2, seed=1)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(head + batches(resumed, 5), reference))


# --- TTT attention ---------------------------------------------------------------------------------

# Two rows of T = 13: three documents (one of length 1), and one document plus 4 padding tokens.
DOC_LENGTHS = [(5, 1, 7), (9,)]
T = 13


def doc_ids() -> torch.Tensor:
    rows = []
    for lengths in DOC_LENGTHS:
        row = [d for d, n in enumerate(lengths) for _ in range(n)]
        rows.append(row + [-1] * (T - len(row)))
    return torch.tensor(rows)


def spans(lengths):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n


def random_qkv(steps, b=2, h=3, d=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)

    def make():
        return torch.randn(b, h, T, d, generator=g).requires_grad_(grad)

    return make(), [make() for _ in range(steps + 1)], [make() for _ in range(steps + 1)]


def flex_cpu(*args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        return ttt_attention_flex(*args)


BACKENDS = {"eager": ttt_attention_eager,
            "chunked": lambda *a: ttt_attention_chunked(*a, chunk_size=4),
            "flex": flex_cpu}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("window", [None, 1, 3, 40])
@pytest.mark.parametrize("steps", [0, 2])
def test_packed_attention_equals_documents_run_alone(backend, window, steps):
    fn = BACKENDS[backend]
    q, keys, values = random_qkv(steps, seed=steps)
    packed = fn(q, keys, values, 0.35, window, doc_ids())
    for row, lengths in enumerate(DOC_LENGTHS):
        for lo, hi in spans(lengths):
            part = (slice(row, row + 1), slice(None), slice(lo, hi))  # [1, h, n, D] of this document
            alone = ttt_attention_eager(q[part], [k[part] for k in keys], [v[part] for v in values], 0.35, window)
            torch.testing.assert_close(packed[part], alone, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(packed).all()  # padding queries see padding keys: no empty softmax row
    if window != 1:  # positive control: without document ids the later documents see earlier ones
        leaky = fn(q, keys, values, 0.35, window)
        assert not torch.allclose(leaky[0, :, 5:], packed[0, :, 5:], atol=1e-3)


@pytest.mark.parametrize("window", [None, 2, 5])
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_chunked_matches_eager_with_documents_values_and_grads(window, steps):
    q, keys, values = random_qkv(steps, seed=10 + steps, grad=True)
    inputs = [q, *keys, *values]
    cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    ref = ttt_attention_eager(q, keys, values, 0.35, window, doc_ids())
    out = ttt_attention_chunked(q, keys, values, 0.35, window, doc_ids(), chunk_size=4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for i, (g, r) in enumerate(zip(torch.autograd.grad(out, inputs, cotangent),
                                   torch.autograd.grad(ref, inputs, cotangent))):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=f"gradient of input {i}")


def test_single_document_ids_change_nothing():
    q, keys, values = random_qkv(2, seed=3)
    one = torch.zeros(2, T, dtype=torch.long)
    for fn in BACKENDS.values():
        torch.testing.assert_close(fn(q, keys, values, 0.35, 4, one), fn(q, keys, values, 0.35, 4), rtol=0, atol=0)


def test_flex_document_block_mask_skips_other_documents():
    """Two documents of 256 tokens in a 512 row: the second document's query tiles skip the
    first document's step-0 tiles (2 + k diagonal tiles each, instead of 4 + k with causal only)."""
    docs = torch.tensor([[0] * 256 + [1] * 256])
    mask = _build_block_mask(512, 3, None, torch.device("cpu"), docs)
    assert (mask.kv_num_blocks + mask.full_kv_num_blocks).flatten().tolist() == [4, 5, 4, 5]


# --- drafter step ----------------------------------------------------------------------------------

def tiny_drafter(arch: str, backend: str):
    torch.manual_seed(0)
    sizes = dict(vocab_size=37, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                 intermediate_size=24, aux_layer_ids=[0, 1, 2], target_num_layers=4, rope_theta=100.0)
    if arch == "eagle3":
        return Eagle3Drafter(Eagle3Config(**sizes, draft_vocab_size=37), attn_backend=backend).eval()
    return Eagle4Drafter(Eagle4Config(**sizes, sliding_window=4), attn_backend=backend).eval()


@pytest.mark.parametrize("arch,backend", [("eagle4", "eager"), ("eagle4", "chunked"), ("eagle3", "chunked"),
                                          ("eagle4", "flex")])
def test_drafter_steps_on_packed_row_equal_documents_alone(arch, backend):
    """K = 3 drafter steps (RoPE at position_ids + k, document_ids into attention) over packed rows
    give, document by document, what the same per-step inputs give in rows of their own."""
    drafter, steps = tiny_drafter(arch, backend), 3
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 37, (2, T), generator=g) for _ in range(steps)]
    hidden0 = torch.randn(2, T, 16, generator=g)
    zeros = [torch.zeros(sum(n), dtype=torch.long) for n in DOC_LENGTHS]  # only the layout matters here
    batch = collate([Example(z, z, n if len(n) > 1 else None) for z, n in zip(zeros, DOC_LENGTHS)], pad_id=0, packed=True)
    assert torch.equal(batch["document_ids"], doc_ids())

    def unroll(ids_k, hidden, positions, documents):
        cache, outs = [], []
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k in range(steps):
                normed, hidden = drafter.step(ids_k[k], hidden, positions + k, drafter.ttt_attend(documents, kv=cache))
                outs.append(normed)
        return outs

    packed = unroll(ids, hidden0, batch["position_ids"], batch["document_ids"])
    for row, lengths in enumerate(DOC_LENGTHS):
        for lo, hi in spans(lengths):
            alone = unroll([x[row : row + 1, lo:hi] for x in ids], hidden0[row : row + 1, lo:hi],
                           torch.arange(hi - lo)[None], None)
            for k in range(steps):
                torch.testing.assert_close(packed[k][row : row + 1, lo:hi], alone[k], rtol=1e-5, atol=1e-5)


# --- tensor-parallel target: packed micro-batches of different shapes in one union forward ---------
# (A packed row of the target == its documents alone, single process: tests/unit/test_target_capture.py.)

def batch_inputs(batch):
    return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "document_ids")}


def packed_batch(seed: int, rows: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return collate([Example(torch.randint(0, 384, (sum(n),), generator=g), torch.ones(sum(n), dtype=torch.long),
                            n if len(n) > 1 else None) for n in rows], pad_id=0, packed=True)


TP_BATCHES = [packed_batch(0, [(4, 7), (3,)]), packed_batch(1, [(2, 5, 6)])]  # rank 0: [2, 11], rank 1: [1, 13]


def _tp_packed_worker(path: str):
    from torchspec.distributed import build_mesh, init_distributed
    from torchspec.train.step import target_forward

    info = init_distributed(device_type="cpu")
    tp_group = build_mesh(info.world_size, 2, "cpu")["tp"].get_group()
    target = TargetDecoder.from_pretrained(path, [1, 3, 5], tp_group=tp_group)
    return target_forward(target, TP_BATCHES[info.rank], tp_group)


def test_tp_union_forward_of_packed_batches_equals_single_process(tiny_llama_dir):
    """``target_forward`` over a tp=2 group: the ranks' packed batches (different B and T) travel
    with their position and document ids (padding: document -1) and come back as computed alone."""
    from tests.distributed.launcher import launch

    results = launch(_tp_packed_worker, world_size=2, args=(tiny_llama_dir,), timeout_s=120)
    reference = TargetDecoder.from_pretrained(tiny_llama_dir, [1, 3, 5])
    for (aux, last), batch in zip(results, TP_BATCHES):
        want = reference.capture(**batch_inputs(batch))
        real = batch["attention_mask"].bool()
        for got, ref in zip([*aux, last], [*want.aux_hidden_states, want.last_hidden_state]):
            assert got.shape == ref.shape
            torch.testing.assert_close(got[real], ref[real], rtol=1e-5, atol=1e-5)
