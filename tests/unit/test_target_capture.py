"""Contracts 1 and 2 on tiny random targets: aux ids are post-layer, last hidden is post-norm."""

import pytest
import torch

from torchspec.target import TargetModel, build_tiny_target, load_target_config

NUM_LAYERS = 8
VOCAB = 384


@pytest.fixture(
    scope="module",
    params=[("llama", True), ("llama", False), ("qwen3", True), ("qwen3", False)],
    ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}",
)
def tiny_dir(request, tmp_path_factory):
    flavour, tied = request.param
    out = tmp_path_factory.mktemp(f"{flavour}_{tied}")
    return build_tiny_target(
        str(out), flavour, vocab_size=VOCAB, num_layers=NUM_LAYERS, tie_word_embeddings=tied
    )


def _inputs(seed=0, batch=2, seq=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def test_golden_aux_ids_are_post_layer(tiny_dir):
    ids = [0, 3, 5]
    target = TargetModel.from_pretrained(tiny_dir, aux_layer_ids=ids)
    x = _inputs()
    out = target(x)
    ref = target.hf_model(x, output_hidden_states=True).hidden_states  # L + 1 entries
    assert len(ref) == NUM_LAYERS + 1
    assert len(out.aux_hidden_states) == 3
    for j, i in enumerate(ids):
        assert out.aux_hidden_states[j].shape == (2, 9, target.hidden_size)
        # HF's hidden_states[i + 1] is the output of decoder layer i (entry 0 is the embedding).
        torch.testing.assert_close(out.aux_hidden_states[j], ref[i + 1], rtol=0, atol=0)
        # The off-by-one this test exists to catch.
        assert not torch.allclose(out.aux_hidden_states[j], ref[i], atol=1e-4)


def test_last_layer_id_is_pre_norm_residual(tiny_dir):
    # HF's hidden_states[L] is the FINAL-NORM output, not layer L-1's residual. Id L-1 still means
    # "after decoder layer L-1": the pre-norm residual, which the final norm maps onto hidden_states[L].
    target = TargetModel.from_pretrained(tiny_dir, aux_layer_ids=[0, 3, NUM_LAYERS - 1])
    x = _inputs(1)
    out = target(x)
    ref = target.hf_model(x, output_hidden_states=True).hidden_states
    high = out.aux_hidden_states[2]
    assert not torch.allclose(high, ref[NUM_LAYERS], atol=1e-3)
    torch.testing.assert_close(target.decoder.norm(high), ref[NUM_LAYERS], rtol=0, atol=0)


def test_last_hidden_is_post_norm_and_logits_match_hf(tiny_dir):
    target = TargetModel.from_pretrained(tiny_dir)  # default ids [1, 3, 4]
    assert target.aux_layer_ids == [1, 3, 4]
    x = _inputs(2)
    out = target(x)
    hf = target.hf_model(x, output_hidden_states=True)
    torch.testing.assert_close(out.last_hidden_state, hf.hidden_states[-1], rtol=0, atol=0)
    logits = target.target_logits(out.last_hidden_state)
    assert logits.dtype == torch.float32 and logits.shape == (2, 9, VOCAB)
    torch.testing.assert_close(logits, hf.logits.float(), rtol=1e-5, atol=1e-5)
    # The pre-norm residual of the last layer through the head is NOT the target distribution:
    # shipping it as "last hidden" would break contract 2, and this comparison would catch it.
    pre_norm = TargetModel(target.hf_model, [0, 3, NUM_LAYERS - 1])(x).aux_hidden_states[2]
    assert not torch.allclose(target.target_logits(pre_norm), hf.logits, atol=1e-3)


def test_tied_and_untied_heads(tiny_dir):
    target = TargetModel.from_pretrained(tiny_dir)
    tied = load_target_config(tiny_dir).tie_word_embeddings
    assert target.config.tie_word_embeddings == tied
    assert (target.lm_head_weight is target.embed_tokens_weight) == tied
    assert (target.lm_head_weight.data_ptr() == target.embed_tokens_weight.data_ptr()) == tied
    if not tied:
        assert not torch.equal(target.lm_head_weight, target.embed_tokens_weight)
    assert target.vocab_size == VOCAB and target.num_layers == NUM_LAYERS and target.hidden_size == 64


def test_target_logits_uses_bias_when_present(tiny_dir):
    target = TargetModel.from_pretrained(tiny_dir)
    if target.config.tie_word_embeddings:
        pytest.skip("a bias on a tied head would change the embedding module too")
    head = target.hf_model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.randn(VOCAB), requires_grad=False)
    out = target(_inputs(3))
    torch.testing.assert_close(target.target_logits(out.last_hidden_state), head(out.last_hidden_state))


def test_padding_mask_is_passed_through(tiny_dir):
    target = TargetModel.from_pretrained(tiny_dir, aux_layer_ids=[0, 3, 5])
    x = _inputs(4)
    mask = torch.ones_like(x)
    mask[0, -3:] = 0  # right padding on row 0
    out = target(x, attention_mask=mask)
    ref = target.hf_model(x, attention_mask=mask, output_hidden_states=True)
    for j, i in enumerate([0, 3, 5]):
        torch.testing.assert_close(out.aux_hidden_states[j], ref.hidden_states[i + 1], rtol=0, atol=0)
    torch.testing.assert_close(out.last_hidden_state, ref.hidden_states[-1], rtol=0, atol=0)


def test_frozen_no_grad_and_no_leak_between_calls(tiny_dir):
    target = TargetModel.from_pretrained(tiny_dir, aux_layer_ids=[0, 3, 5])
    assert not target.training and not target.hf_model.training
    target.train()
    assert not target.training and not target.hf_model.training
    assert all(not p.requires_grad for p in target.parameters())
    first = target(_inputs(5))
    assert target._captured is None
    assert all(not t.requires_grad and t.grad_fn is None for t in first.aux_hidden_states)
    # A direct HF call (e.g. by the runtime) must not record anything.
    target.hf_model(_inputs(6))
    assert target._captured is None
    second = target(_inputs(6, batch=1, seq=4))
    assert [t.shape for t in second.aux_hidden_states] == [(1, 4, 64)] * 3
    ref = target.hf_model(_inputs(6, batch=1, seq=4), output_hidden_states=True).hidden_states
    for j, i in enumerate([0, 3, 5]):
        torch.testing.assert_close(second.aux_hidden_states[j], ref[i + 1], rtol=0, atol=0)
    # A failing forward still clears the capture buffer.
    with pytest.raises(IndexError):
        target(torch.full((1, 3), VOCAB + 10))
    assert target._captured is None


def test_state_dict_has_no_duplicate_submodule(tiny_dir):
    target = TargetModel.from_pretrained(tiny_dir)
    assert all(k.startswith("hf_model.") for k in target.state_dict())
