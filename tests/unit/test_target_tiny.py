"""The tiny random target: deterministic per seed, loadable, shardable over TP=4."""

import pytest
import torch
from safetensors.torch import load_file

from torchspec.targets import (
    TINY_FLAVOURS,
    TargetDecoder,
    build_tiny_target,
    load_target_config,
    load_tokenizer,
)


def _weights(path):
    return load_file(f"{path}/model.safetensors")


@pytest.mark.parametrize("flavour", sorted(TINY_FLAVOURS))
def test_deterministic_per_seed(tmp_path, flavour):
    rng_before = torch.random.get_rng_state()
    a = _weights(build_tiny_target(str(tmp_path / "a"), flavour, seed=3))
    b = _weights(build_tiny_target(str(tmp_path / "b"), flavour, seed=3))
    c = _weights(build_tiny_target(str(tmp_path / "c"), flavour, seed=4))
    assert torch.equal(torch.random.get_rng_state(), rng_before), "global RNG must be left untouched"
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "norm" not in k)


@pytest.mark.parametrize("flavour, arch", [("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
                                           ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_config_and_tp4_friendly_defaults(tmp_path, flavour, arch):
    path = build_tiny_target(str(tmp_path / "t"), flavour, vocab_size=400)
    config = load_target_config(path)
    assert config.architectures == [arch]
    assert config.num_hidden_layers == 8 and config.hidden_size == 64 and config.vocab_size == 400
    assert config.num_key_value_heads % 4 == 0 and config.num_attention_heads % 4 == 0
    assert config.tie_word_embeddings


def test_bad_shapes_refused(tmp_path):
    with pytest.raises(ValueError, match="flavour"):
        build_tiny_target(str(tmp_path / "t"), "gpt2")
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        build_tiny_target(str(tmp_path / "t"), num_heads=4, num_kv_heads=3)


def test_with_tiny_tokenizer(tmp_path):
    tiny_tokenizer = pytest.importorskip("torchspec.data.tiny_tokenizer")
    tokenizer = tiny_tokenizer.build_tiny_tokenizer(vocab_size=384)
    path = build_tiny_target(str(tmp_path / "t"), vocab_size=len(tokenizer), tokenizer=tokenizer)
    loaded = load_tokenizer(path)
    assert len(loaded) == len(tokenizer) and loaded.chat_template == tokenizer.chat_template
    ids = loaded.apply_chat_template(
        [{"role": "user", "content": "Hello there!"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = TargetDecoder.from_pretrained(path).capture(ids)
    assert out.last_hidden_state.shape == (1, ids.shape[1], 64)
    assert load_target_config(path).eos_token_id == tokenizer.eos_token_id
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_tiny_target(str(tmp_path / "u"), vocab_size=len(tokenizer) - 1, tokenizer=tokenizer)
