"""torchspec-train's bad-input table: every user error is one line, exit 2, and nothing is written.

Each case runs against the shared world (tests/integration/bad_input.py): a finished run directory
must stay byte-identical, and a run pointed at a new directory must not create it. A case that
points at the finished run (a typo while resuming, another config) is the scenario of issue 17:
the run's config.yaml must survive, and torchspec-export of the run must still work.
"""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from tests.integration.bad_input import (
    bad_input_world,  # noqa: F401 (the world fixture)
    check_refused,
    engine_shard,
    scratch_copy,
    truncate,
)


def corrupt_target(tmp, world):
    bad = scratch_copy(world.root / "target", tmp / "target")
    (bad / "config.json").write_text("{ this is not json")
    return bad


def target_without_config(tmp, world):
    bad = scratch_copy(world.root / "target", tmp / "target")
    (bad / "config.json").unlink()
    return bad


def target_without_tokenizer(tmp, world):
    bad = scratch_copy(world.root / "target", tmp / "target")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (bad / name).unlink()
    return bad


def garbage_data(tmp, world):
    (tmp / "garbage.jsonl").write_bytes(b"\x00\x01 not json at all\n{{{\n")
    return tmp / "garbage.jsonl"


def empty_data(tmp, world):
    (tmp / "empty.jsonl").write_text("")
    return tmp / "empty.jsonl"


def run_with_garbage_config(tmp, world):
    run = scratch_copy(world.run, tmp / "run")
    (run / "config.yaml").write_text("train: [unclosed\n  - : :\n")
    return run


def a_file(tmp, world):
    (tmp / "file").write_text("not a directory\n")
    return tmp / "file"


# (id, overrides (may use {tmp}, {run}, {made}), culprit (may use the same), setup making {made})
CASES = [
    ("data_missing", ["data.path={tmp}/nope.jsonl"], "{tmp}/nope.jsonl", None),
    ("data_is_directory", ["data.path={tmp}"], "is a directory", None),
    ("data_garbage", ["data.path={made}"], "{made}", garbage_data),
    ("data_empty", ["data.path={made}"], "{made}", empty_data),
    ("target_missing", ["target.path={tmp}/no_model"], "{tmp}/no_model", None),
    ("target_without_config", ["target.path={made}"], "{made}", target_without_config),
    ("target_without_tokenizer", ["target.path={made}"], "{made}", target_without_tokenizer),
    ("aux_layer_out_of_range", ["target.aux_layer_ids=[1,3,9]"], "[1, 3, 9]", None),
    ("lm_head_rank_too_big", ["drafter.lm_head_rank=128"], "drafter.lm_head_rank=128", None),
    ("ttt_steps_zero", ["train.ttt_steps=0"], "train.ttt_steps=0", None),
    ("unknown_group_option", ["drafter=eagle5"], "drafter=eagle5", None),
    ("unknown_group", ["nosuchgroup=x"], "nosuchgroup", None),
    ("unknown_key", ["train.foo=1"], "train.foo", None),
    ("added_key", ["+train.foo=1"], "train.foo: no such key in TrainConfig", None),
    ("added_top_level_key", ["+nme=x"], "did you mean 'name'", None),
    ("misspelt_key", ["train.max_stesp=5"], "did you mean 'max_steps'", None),
    ("wrong_type", ["train.max_steps=abc"], "train.max_steps", None),
    ("override_without_value", ["train.max_steps"], "'train.max_steps'", None),
    ("override_bad_syntax", ["train.betas=[0.9"], "'train.betas=[0.9'", None),
    ("missing_mandatory", ["target=hf", "target.path=???"], "target.path", None),
    ("an_option", ["--max-steps=5"], "--max-steps=5", None),
    ("output_dir_is_a_file", ["train.output_dir={made}"], "is a file", a_file),
    ("resume_from_nowhere", ["train.resume={tmp}/nowhere"], "train.resume", None),
    ("init_from_nowhere", ["train.init_from={tmp}/nowhere"], "train.init_from", None),
    ("batch_larger_than_data", ["train.micro_batch_size=500"], "batch_size=500", None),
    # The finished run's directory: a typo while resuming, and another run's config.
    ("resume_with_data_typo", ["train.output_dir={run}", "data.path={tmp}/typo.jsonl"], "{tmp}/typo.jsonl", None),
    ("resume_with_other_config", ["train.output_dir={run}", "train.lr=0.5"], "train.lr", None),
    ("resume_with_other_drafter", ["train.output_dir={run}", "drafter.sliding_window=8"], "{run}/config.yaml", None),
    ("run_with_garbage_config", ["train.output_dir={made}"], "{made}/config.yaml", run_with_garbage_config),
]
CASES.append(("target_corrupt_config", ["target.path={made}"], "{made}/config.json", corrupt_target))


@pytest.mark.parametrize("name, overrides, culprit, setup", CASES, ids=[c[0] for c in CASES])
def test_train_refuses_in_one_line(name, overrides, culprit, setup, world, tmp_path, capfd, request):
    made = setup(tmp_path, world) if setup else None
    values = {"tmp": tmp_path, "run": world.run, "made": made}
    new_run = tmp_path / "new_run"
    argv = world.train_args(new_run, *(o.format(**values) for o in overrides))
    check_refused("train", argv, culprit.format(**values), [world.root, tmp_path], capfd, absent=(new_run,))


@pytest.mark.parametrize("damaged", ["state", "engine"])
def test_resume_refuses_a_damaged_checkpoint(damaged, world, tmp_path, capfd):
    """The world's run as if killed after its checkpoint (no DONE), with one checkpoint file cut short."""
    run = scratch_copy(world.run, tmp_path / "run")
    (run / "DONE").unlink()
    checkpoint = run / "checkpoints" / "step_000001"
    truncate(checkpoint / "state.pt" if damaged == "state" else engine_shard(checkpoint))
    check_refused("train", world.train_args(run), "is truncated", [world.root, tmp_path], capfd)


def test_the_run_still_exports_after_the_refusals(world, tmp_path, capfd):
    """Issue 17's scenario end to end: after the refused resumes above, the run exports."""
    from recipes.export import main

    main([str(world.run), str(tmp_path / "export")])
    assert "exported step 1" in capfd.readouterr().out


def test_subprocess_data_typo_in_existing_run(world, tmp_path):
    """Through the console script: exit 2, one line, no Hydra output directory, the run untouched."""
    check_refused("train", world.train_args(world.run, f"data.path={tmp_path}/typo.jsonl"), f"{tmp_path}/typo.jsonl",
                  [world.root, tmp_path])


def test_subprocess_hydra_errors(world, tmp_path):
    check_refused("train", world.train_args(tmp_path / "new", "drafter=eagle5"), "drafter=eagle5",
                  [world.root, tmp_path], absent=(tmp_path / "new",))


def test_help_lists_the_groups(capfd):
    from recipes.train import main

    main(["--help"])
    out = capfd.readouterr().out
    for group in ("data:", "drafter: eagle3, eagle3_1, eagle4", "parallel:", "target: hf, smollm2", "train: cpu, gpu"):
        assert group in out, group
    assert "TORCHSPEC_DEBUG=1" in out


def test_debug_shows_the_traceback(world, tmp_path, monkeypatch):
    from recipes.train import main

    monkeypatch.setenv("TORCHSPEC_DEBUG", "1")
    with pytest.raises(ValueError, match="does not exist"):
        main(world.train_args(tmp_path / "new", f"data.path={tmp_path}/nope.jsonl"))
    assert not (tmp_path / "new").exists()


def test_operational_keys_may_change_on_resume(world, tmp_path, caplog):
    """A moved run continues with more steps (and other operational keys); config.yaml records them."""
    from recipes.train import main

    run = scratch_copy(world.run, tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="torchspec.train"):
        main(world.train_args(run, "train.max_steps=2", "train.keep_checkpoints=1"))
    assert any(r.getMessage().startswith("resumed from") for r in caplog.records)
    saved = OmegaConf.load(run / "config.yaml")
    assert saved.train.max_steps == 2 and saved.train.keep_checkpoints == 1


def test_warmup_longer_than_the_run_is_clamped_with_a_note(caplog):
    from torchspec.config import Config, validate_config

    cfg = Config()
    cfg.train.max_steps, cfg.train.warmup_steps = 3, 10
    with caplog.at_level(logging.INFO, logger="torchspec.config"):
        validate_config(cfg)
    assert cfg.train.warmup_steps == 3
    assert [r.getMessage() for r in caplog.records] == [
        "train.warmup_steps=10 is more than train.max_steps=3: warming up over all 3 steps"]
