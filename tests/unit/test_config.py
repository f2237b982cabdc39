"""Hydra composition and validation: unknown keys rejected, bad values named with their fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from torchspec.config import Config, register_configs, validate_against_target, validate_config

CONF = str(Path(__file__).resolve().parents[2] / "torchspec" / "conf")
register_configs()


def compose_cfg(*overrides: str) -> Config:
    with initialize_config_dir(config_dir=CONF, version_base=None):
        raw = compose(config_name="train", overrides=list(overrides))
    return OmegaConf.to_object(raw)


def test_default_config_composes_and_validates():
    cfg = compose_cfg()
    validate_config(cfg)
    assert cfg.target.path == "smollm2" and cfg.drafter.arch == "eagle4"
    assert cfg.train.output_dir == "outputs/default"


@pytest.mark.parametrize("override", ["train.not_a_key=1", "drafter.fc_nrom=false"])
def test_unknown_keys_are_rejected(override):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        compose_cfg(override)


def test_unknown_key_in_a_group_file_is_rejected(tmp_path):
    shutil.copytree(CONF, tmp_path / "conf")
    with open(tmp_path / "conf" / "data" / "sharegpt_cpu.yaml", "a") as f:
        f.write("max_lenght: 128\n")
    with initialize_config_dir(config_dir=str(tmp_path / "conf"), version_base=None):
        with pytest.raises(ConfigCompositionException, match="max_lenght"):
            compose(config_name="train")


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigCompositionException):
        compose_cfg("train.ttt_steps=seven")


@pytest.mark.parametrize("override, message", [
    ("train.ttt_steps=0", "train.ttt_steps=0 must be >= 1"),
    ("train.precision=fp8", "train.precision='fp8' is not one of"),
    ("drafter.arch=medusa", "drafter.arch='medusa' is unknown"),
    ("data.max_length=4", "data.max_length=4 is too short"),
    ("train.save_every=15", "must be a multiple of train.log_every"),
    ("parallel.target_tp=0", "parallel.target_tp=0 must be >= 1"),
    ("parallel.engine=ddp", "parallel.engine='ddp' is not one of"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate_config(compose_cfg(override))


def test_zero3_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="ZeRO-3 computes wrong gradients"):
        validate_config(compose_cfg("parallel=deepspeed", "parallel.zero_stage=3"))


def test_aux_ids_checked_against_target_config():
    class FakeTarget:
        num_hidden_layers, num_attention_heads, num_key_value_heads = 8, 4, 4

    cfg = compose_cfg("target.aux_layer_ids=[1,3,8]")
    with pytest.raises(ValueError, match=r"outside \[0, 7\]"):
        validate_against_target(cfg, FakeTarget())
    cfg = compose_cfg("target.aux_layer_ids=[3,1,5]")
    with pytest.raises(ValueError, match="not strictly increasing"):
        validate_against_target(cfg, FakeTarget())
    assert validate_against_target(compose_cfg(), FakeTarget()) == [1, 3, 4]


# --- drafter keys: declared once (the model configs' ARCH_FIELDS), refused where unused -------------


@pytest.mark.parametrize("preset", ["eagle3", "eagle3_1", "eagle4", "eagle4_cpu", "eagle4_moe"])
def test_every_drafter_preset_composes_and_validates(preset):
    cfg = compose_cfg(f"drafter={preset}")
    validate_config(cfg)
    assert cfg.drafter.arch == preset.split("_")[0]


@pytest.mark.parametrize("overrides, message", [
    (["drafter=eagle3", "drafter.sliding_window=128"],
     "drafter.sliding_window=128 is not used by drafter.arch=eagle3 (EAGLE-4 only); remove it or pick drafter=eagle4"),
    (["drafter=eagle3", "drafter.sliding_window=null"], "drafter.sliding_window=null is not used by drafter.arch=eagle3"),
    (["drafter=eagle3_1", "drafter.nope=true"], "drafter.nope=true is not used by drafter.arch=eagle3 (EAGLE-4 only)"),
    (["drafter=eagle3", "drafter.moe_num_experts=4"], "drafter.moe_num_experts=4 is not used by drafter.arch=eagle3"),
    (["drafter=eagle3", "drafter.lowrank_teacher=full"], "drafter.lowrank_teacher=full is not used by drafter.arch=eagle3"),
    (["drafter=eagle4", "drafter.draft_vocab_size=100"],
     "drafter.draft_vocab_size=100 is not used by drafter.arch=eagle4 (EAGLE-3 only); remove it or pick drafter=eagle3"),
])
def test_a_drafter_key_the_architecture_does_not_use_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        validate_config(compose_cfg(*overrides))
    assert "\n" not in str(err.value)


def test_drafter_keys_are_derived_from_the_model_configs():
    """Every architecture flag a user may set is a drafter.* key with the architecture's default and
    type, and no drafter.* key exists that neither an architecture nor training reads."""
    from dataclasses import MISSING, fields

    from torchspec.config import DrafterConfig, DrafterTrainingConfig
    from torchspec.models import DEFAULT_ARCH, DRAFTERS, drafter_config_from_target, drafter_keys

    schema = {f.name: f for f in fields(DrafterConfig)}
    training = {f.name for f in fields(DrafterTrainingConfig)}
    declared = set().union(*(drafter_keys(arch) for arch in DRAFTERS))
    assert set(schema) == training | declared
    for name, flag in drafter_keys(DEFAULT_ARCH).items():
        assert schema[name].default == flag.default and schema[name].default is not MISSING, name

    class Target:  # what drafter_config_from_target reads from a target config
        vocab_size, hidden_size, num_attention_heads, num_key_value_heads = 64, 16, 4, 2
        intermediate_size, num_hidden_layers, rms_norm_eps, rope_theta, max_position_embeddings = 24, 4, 1e-6, 1e4, 128

    for arch in DRAFTERS:  # every key of the architecture reaches its model config
        d = DrafterConfig(arch=arch)
        config = drafter_config_from_target(d, Target(), [0, 1, 2])
        for name in drafter_keys(arch):
            if getattr(d, name) is not None:
                assert getattr(config, name) == getattr(d, name), (arch, name)
