"""torchspec-convert's bad-input table (one line, exit 2, nothing written), and its report of the
config fields it takes from the target rather than from the EAGLE-3 drafter."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.bad_input import (
    bad_input_world,  # noqa: F401 (the world fixture)
    check_refused,
    scratch_copy,
    truncate,
)


def empty_dir(tmp, world):
    (tmp / "empty").mkdir()
    return tmp / "empty"


def e3_copy(tmp, world):
    return scratch_copy(world.e3, tmp / "e3")


def garbage_config(tmp, world):
    e3 = e3_copy(tmp, world)
    (e3 / "config.json").write_text("{ not json")
    return e3


def unknown_config_key(tmp, world):
    e3 = e3_copy(tmp, world)
    config = json.loads((e3 / "config.json").read_text())
    (e3 / "config.json").write_text(json.dumps({**config, "sliding_windw": 8}))
    return e3


def no_weights(tmp, world):
    e3 = e3_copy(tmp, world)
    (e3 / "model.safetensors").unlink()
    return e3


def truncated_weights(tmp, world):
    e3 = e3_copy(tmp, world)
    truncate(e3 / "model.safetensors")
    return e3


def truncated_sglang(tmp, world):
    e3 = scratch_copy(world.e3_sglang, tmp / "sg")
    truncate(e3 / "model.safetensors")
    return e3


def garbage_sglang_config(tmp, world):
    e3 = scratch_copy(world.e3_sglang, tmp / "sg")
    (e3 / "config.json").write_bytes(b"\xff\xfe garbage")
    return e3


def other_target(tmp, world):
    from torchspec.data import build_tiny_tokenizer
    from torchspec.targets import build_tiny_target

    return build_tiny_target(str(tmp / "other"), vocab_size=384, hidden_size=32, tokenizer=build_tiny_tokenizer(384))


def a_file(tmp, world):
    (tmp / "file").write_text("not a directory\n")
    return tmp / "file"


# (id, argv after "E3 OUT" -- E3 defaults to the world's torchspec EAGLE-3 drafter; {made} replaces it when
# the setup returns a drafter directory --, culprit, setup). Placeholders: {tmp}, {made}, {e3}, {sg}, {target}.
def late_replies(tmp_path, world):
    """Conversations whose first user turn fills --fit-length 8: each is skipped, none is left."""
    import json

    rows = [{"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}]}] * 3
    (tmp_path / "late.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


CASES = [
    ("e3_missing", "{tmp}/nope", [], "{tmp}/nope", None),
    ("e3_is_a_file", "{made}", [], "{made}", a_file),
    ("e3_empty_dir", "{made}", [], "{made}/config.json is missing", empty_dir),
    ("e3_empty_dir_sglang", "{made}", ["--layout", "sglang"], "{made}/config.json is missing", empty_dir),
    ("e3_config_garbage", "{made}", [], "{made}/config.json is not valid JSON", garbage_config),
    ("e3_config_unknown_key", "{made}", [], "sliding_windw", unknown_config_key),
    ("e3_no_weights", "{made}", [], "{made}/model.safetensors is missing", no_weights),
    ("e3_weights_truncated", "{made}", [], "{made}/model.safetensors is truncated", truncated_weights),
    ("sglang_weights_truncated", "{made}", ["--layout", "sglang"], "{made}/model.safetensors", truncated_sglang),
    ("sglang_config_garbage", "{made}", ["--layout", "sglang"], "{made}/config.json", garbage_sglang_config),
    ("sglang_dir_as_torchspec", "{sg}", [], "pass --layout sglang", None),
    ("torchspec_dir_as_vllm", "{e3}", ["--layout", "vllm"], "{e3}/config.json", None),
    ("set_unknown_key", "{e3}", ["--set", "sliding_windw=8"], "'sliding_windw'", None),
    ("set_lists_valid_keys", "{e3}", ["--set", "zzz=1"], "lm_head_rank", None),
    ("set_without_value", "{e3}", ["--set", "sliding_window"], "--set 'sliding_window'", None),
    ("set_wrong_type", "{e3}", ["--set", "nope=maybe"], "nope", None),
    ("preset_unknown", "{e3}", ["--drafter-preset", "eagle9"], "--drafter-preset='eagle9'", None),
    ("preset_not_eagle4", "{e3}", ["--drafter-preset", "eagle3"], "--drafter-preset='eagle3'", None),
    ("target_missing", "{e3}", ["--target", "{tmp}/no_model"], "{tmp}/no_model", None),
    ("target_mismatch", "{e3}", ["--target", "{made}"], "hidden_size: EAGLE-3 64, target 32", other_target),
    ("fit_samples_zero", "{e3}", ["--fit-samples", "0"], "--fit-samples=0", None),
    ("fit_length_one", "{e3}", ["--fit-length", "1"], "--fit-length=1", None),
    ("fit_data_missing", "{e3}", ["--fit-data", "{tmp}/nope.jsonl", "--set", "lm_head_rank=0"], "{tmp}/nope.jsonl",
     None),
    ("fit_data_directory", "{e3}", ["--fit-data", "{tmp}", "--set", "lm_head_rank=0"], "is a directory", None),
    ("fit_data_replies_too_late", "{e3}", ["--fit-data", "{tmp}/late.jsonl", "--fit-length", "8", "--set",
                                           "lm_head_rank=0"], "no conversation with an assistant token", late_replies),
    ("head_rank_too_big", "{e3}", [], "lm_head_rank=128", None),  # the eagle4 preset's rank on a hidden-64 target
    ("layout_unknown", "{e3}", ["--layout", "eagle"], "--layout", None),
]


@pytest.mark.parametrize("name, e3, extra, culprit, setup", CASES, ids=[c[0] for c in CASES])
def test_convert_refuses_in_one_line(name, e3, extra, culprit, setup, world, tmp_path, capfd):
    made = setup(tmp_path, world) if setup else None
    values = {"tmp": tmp_path, "made": made, "e3": world.e3, "sg": world.e3_sglang, "target": world.target}
    argv = [e3.format(**values), str(tmp_path / "out"), "--target", world.target, *(a.format(**values) for a in extra)]
    check_refused("convert", argv, culprit.format(**values), [world.root, tmp_path], capfd,
                  absent=(tmp_path / "out",))


@pytest.mark.parametrize("out", ["e3", "sg", "file"])
def test_convert_never_replaces_what_is_not_its_output(out, world, tmp_path, capfd):
    """OUT_DIR is replaced as a whole: the EAGLE-3 drafter itself, another checkpoint or a file are refused."""
    target = {"e3": world.e3, "sg": world.e3_sglang, "file": a_file(tmp_path, world)}[out]
    check_refused("convert", [str(world.e3), str(target), "--target", world.target], str(target),
                  [world.root, tmp_path], capfd)


def test_subprocess_convert_refuses(world, tmp_path):
    (tmp_path / "empty").mkdir()
    check_refused("convert", [str(tmp_path / "empty"), str(tmp_path / "out"), "--target", world.target],
                  f"{tmp_path / 'empty'}/config.json is missing", [world.root, tmp_path], absent=(tmp_path / "out",))


def test_report_lists_the_fields_taken_from_the_target():
    """Item 5 of issue 17: RoPE base, max positions and norm eps come from the target, with both values."""
    from torchspec.export.warm_start import eagle3_to_eagle4, format_report
    from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter
    from torchspec.models.eagle4 import Eagle4Config

    sizes = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                 intermediate_size=32, aux_layer_ids=[0, 1, 2], target_num_layers=4)
    torch.manual_seed(0)
    e3 = Eagle3Drafter(Eagle3Config(**sizes, draft_vocab_size=64, rope_theta=10000.0, max_position_embeddings=2048,
                                    rms_norm_eps=1e-6))
    e3.set_vocab_mapping(torch.zeros(64, dtype=torch.long), torch.ones(64, dtype=torch.bool))
    c4 = Eagle4Config(**sizes, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)
    _, report = eagle3_to_eagle4(e3, c4, target_lm_head=torch.randn(64, 16), fit_tokens=None)
    assert report.config == [("rms_norm_eps", 1e-6, 1e-5), ("rope_theta", 10000.0, 500000.0),
                             ("max_position_embeddings", 2048, 8192)]
    text = format_report(report)
    assert "config: rope_theta = 500000.0 from the EAGLE-4 config (the target's), EAGLE-3 had 10000.0 (CHANGED)" in text
    assert "config: max_position_embeddings = 8192" in text and "config: rms_norm_eps = 1e-05" in text
    assert any("RoPE base 500000 replaces EAGLE-3's 10000" in note for note in report.notes)
