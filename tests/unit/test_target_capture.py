"""Training capture of the target decoder == transformers (the oracle), for every tiny family, in fp32.

Contract 1 (aux id i = residual stream after decoder layer i; HF's hidden_states[i + 1]) and
contract 2 (last hidden = post-final-norm, what the lm_head consumes), on unpacked rows with right
padding and on packed rows (each document equals that document run alone, through HF and through
our own capture). Norm weights and biases are perturbed (HF starts them at 1 and 0), and KV heads
are grouped (GQA), so a missing bias, norm or head mapping shows.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from torchspec.data import collate
from torchspec.data.dataset import Example
from torchspec.targets import TINY_FLAVOURS, TargetDecoder, build_tiny_target

NUM_LAYERS = 8
VOCAB = 384
ATOL = 1e-5


def build_perturbed(out: str, flavour: str, tied: bool = True) -> str:
    """A tiny target whose 1-D weights (norms, biases) are random, not HF's 1 / 0."""
    path = build_tiny_target(out, flavour, vocab_size=VOCAB, num_layers=NUM_LAYERS, num_kv_heads=2,
                             tie_word_embeddings=tied)
    weights = load_file(f"{path}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    weights = {k: v + 0.2 * torch.randn(v.shape, generator=g) if v.ndim == 1 else v for k, v in weights.items()}
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=[*((f, True) for f in TINY_FLAVOURS), ("llama", False)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def case(request, tmp_path_factory):
    flavour, tied = request.param
    path = build_perturbed(str(tmp_path_factory.mktemp(f"{flavour}_{tied}")), flavour, tied)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _ids(seed=0, batch=2, seq=9):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _oracle(hf, ids, attention_mask=None):
    return hf(ids, attention_mask=attention_mask, output_hidden_states=True)


def _diff(a, b) -> float:
    return (a - b).abs().max().item()


def test_golden_aux_ids_are_post_layer(case):
    path, hf = case
    ids = [0, 3, 5]
    target = TargetDecoder.from_pretrained(path, aux_layer_ids=ids)
    x = _ids()
    out = target.capture(x)
    ref = _oracle(hf, x).hidden_states  # L + 1 entries
    assert len(ref) == NUM_LAYERS + 1 and len(out.aux_hidden_states) == 3
    for j, i in enumerate(ids):
        assert out.aux_hidden_states[j].shape == (2, 9, target.hidden_size)
        # HF's hidden_states[i + 1] is the output of decoder layer i (entry 0 is the embedding).
        assert _diff(out.aux_hidden_states[j], ref[i + 1]) <= ATOL
        # The off-by-one this test exists to catch.
        assert not torch.allclose(out.aux_hidden_states[j], ref[i], atol=1e-4)


def test_last_layer_id_is_pre_norm_residual(case):
    # HF's hidden_states[L] is the FINAL-NORM output, not layer L-1's residual. Id L-1 still means
    # "after decoder layer L-1": the pre-norm residual, which the final norm maps onto hidden_states[L].
    path, hf = case
    target = TargetDecoder.from_pretrained(path, aux_layer_ids=[0, 3, NUM_LAYERS - 1])
    x = _ids(1)
    high = target.capture(x).aux_hidden_states[2]
    ref = _oracle(hf, x).hidden_states
    assert not torch.allclose(high, ref[NUM_LAYERS], atol=1e-3)
    assert _diff(target.norm(high), ref[NUM_LAYERS]) <= ATOL


def test_last_hidden_is_post_norm_and_logits_match_hf(case):
    path, hf = case
    target = TargetDecoder.from_pretrained(path)  # default ids [1, 3, 4]
    assert target.aux_layer_ids == [1, 3, 4]
    x = _ids(2)
    out = target.capture(x)
    ref = _oracle(hf, x)
    assert _diff(out.last_hidden_state, ref.hidden_states[-1]) <= ATOL
    logits = target.target_logits(out.last_hidden_state)
    assert logits.dtype == torch.float32 and logits.shape == (2, 9, VOCAB)
    assert _diff(logits, ref.logits.float()) <= ATOL
    assert _diff(target.logits(out.last_hidden_state), ref.logits.float()) <= ATOL  # the serving head agrees
    # The pre-norm residual of the last layer through the head is NOT the target distribution:
    # shipping it as "last hidden" would break contract 2, and this comparison would catch it.
    target.aux_layer_ids = [0, 3, NUM_LAYERS - 1]
    pre_norm = target.capture(x).aux_hidden_states[2]
    assert not torch.allclose(target.target_logits(pre_norm), ref.logits, atol=1e-3)


def test_right_padding_needs_no_mask(case):
    path, hf = case
    aux_ids = [0, 3, 5]
    target = TargetDecoder.from_pretrained(path, aux_layer_ids=aux_ids)
    x = _ids(4, batch=3, seq=11)
    mask = torch.ones_like(x)
    mask[0, -3:] = 0
    mask[2, 4:] = 0
    out = target.capture(x, attention_mask=mask)
    ref = _oracle(hf, x, attention_mask=mask)
    real = mask.bool()
    for j, i in enumerate(aux_ids):
        assert _diff(out.aux_hidden_states[j][real], ref.hidden_states[i + 1][real]) <= ATOL
    assert _diff(out.last_hidden_state[real], ref.hidden_states[-1][real]) <= ATOL
    assert torch.isfinite(out.last_hidden_state).all()


def spans(lengths):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n


def test_packed_rows_equal_each_document_alone(case):
    path, hf = case
    target = TargetDecoder.from_pretrained(path, aux_layer_ids=[0, 3, 5])
    g = torch.Generator().manual_seed(2)
    lengths = [(6, 1, 9, 4), (11, 3)]  # row 1 is padded by 6
    docs = [[torch.randint(0, VOCAB, (n,), generator=g) for n in row] for row in lengths]
    batch = collate([Example(torch.cat(row), torch.ones(sum(n), dtype=torch.long), n)
                     for row, n in zip(docs, lengths)], pad_id=0, packed=True)
    out = target.capture(batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"], document_ids=batch["document_ids"])
    derived = target.capture(batch["input_ids"], document_ids=batch["document_ids"])  # positions from doc ids
    for row, n in enumerate(lengths):
        for doc, (lo, hi) in zip(docs[row], spans(n)):
            alone = target.capture(doc[None])
            ref = _oracle(hf, doc[None]).hidden_states
            for j, i in enumerate([0, 3, 5]):
                assert _diff(out.aux_hidden_states[j][row : row + 1, lo:hi], ref[i + 1]) <= ATOL
            assert _diff(out.last_hidden_state[row : row + 1, lo:hi], ref[-1]) <= ATOL
            for got, want in zip([*out.aux_hidden_states, out.last_hidden_state],
                                 [*alone.aux_hidden_states, alone.last_hidden_state]):
                assert _diff(got[row : row + 1, lo:hi], want) <= ATOL
    real = batch["attention_mask"].bool()
    for got, want in zip([*derived.aux_hidden_states, derived.last_hidden_state],
                         [*out.aux_hidden_states, out.last_hidden_state]):
        assert _diff(got[real], want[real]) <= 1e-6
    assert torch.isfinite(out.last_hidden_state).all()  # padding is its own "document": no empty softmax row
    leaky = target.capture(batch["input_ids"])  # positive control: plain causal attention leaks across documents
    assert not torch.allclose(leaky.last_hidden_state[0, 6:20], out.last_hidden_state[0, 6:20], atol=1e-3)


def test_unpacked_document_ids_equal_the_causal_path(tmp_path):
    """collate's document ids of unpacked rows (0 on real tokens, -1 on padding) change nothing."""
    target = TargetDecoder.from_pretrained(build_tiny_target(str(tmp_path / "t"), num_layers=NUM_LAYERS))
    batch = collate([Example(torch.arange(3, 12), torch.ones(9, dtype=torch.long)),
                     Example(torch.arange(20, 25), torch.ones(5, dtype=torch.long))], pad_id=0, packed=True)
    new = target.capture(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "document_ids")})
    old = target.capture(batch["input_ids"], attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    for got, want in zip([*new.aux_hidden_states, new.last_hidden_state],
                         [*old.aux_hidden_states, old.last_hidden_state]):
        assert _diff(got[real], want[real]) <= 1e-6


def test_tied_and_untied_heads(case):
    path, hf = case
    target = TargetDecoder.from_pretrained(path)
    tied = hf.config.tie_word_embeddings
    assert target.config.tie_word_embeddings == tied
    assert (target.lm_head_weight is target.embed_tokens_weight) == tied
    assert torch.equal(target.lm_head_weight, hf.get_output_embeddings().weight)
    assert torch.equal(target.embed_tokens_weight, hf.get_input_embeddings().weight)
    assert target.lm_head_bias is None
    assert target.vocab_size == VOCAB and target.num_layers == NUM_LAYERS and target.hidden_size == 64


def test_frozen_and_no_grad(case):
    path, _ = case
    target = TargetDecoder.from_pretrained(path, aux_layer_ids=[0, 3, 5])
    assert not target.training
    target.train()
    assert not target.training and not any(m.training for m in target.modules())
    assert all(not p.requires_grad for p in target.parameters())
    out = target.capture(_ids(5))
    assert all(not t.requires_grad and t.grad_fn is None for t in [*out.aux_hidden_states, out.last_hidden_state])
    assert [t.shape for t in target.capture(_ids(6, batch=1, seq=4)).aux_hidden_states] == [(1, 4, 64)] * 3


def test_serving_decoder_has_no_capture_ids(tiny_llama_dir):
    target = TargetDecoder.from_pretrained(tiny_llama_dir, aux_layer_ids=())
    assert target.aux_layer_ids == []
    with pytest.raises(ValueError, match="built without aux_layer_ids"):
        target.capture(_ids())
    with pytest.raises(ValueError, match=r"\[9\] outside \[0, 7\]"):
        target.aux_layer_ids = [1, 2, 9]
    target.aux_layer_ids = [1, 2, 3]
    assert len(target.capture(_ids()).aux_hidden_states) == 3
