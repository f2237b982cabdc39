"""torchspec-export's bad-input table: one line, exit 2, the run and every other file untouched."""

from __future__ import annotations

import pytest

from tests.integration.bad_input import (
    bad_input_world,  # noqa: F401 (the world fixture)
    check_refused,
    engine_shard,
    scratch_copy,
    truncate,
)


def run_copy(tmp, world):
    return scratch_copy(world.run, tmp / "run")


def garbage_config(tmp, world):
    run = run_copy(tmp, world)
    (run / "config.yaml").write_text("train: [unclosed\n  - : :\n")
    return run


def unknown_key(tmp, world):
    run = run_copy(tmp, world)
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("train:\n", "train:\n  max_stesp: 3\n"))
    return run


def bad_value(tmp, world):
    run = run_copy(tmp, world)
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("ttt_steps: 2", "ttt_steps: 0"))
    return run


def target_moved(tmp, world):
    run = run_copy(tmp, world)
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace(world.target, str(tmp / "moved")))
    return run


def a_file(tmp, world):
    (tmp / "file").write_text("not a directory\n")
    return tmp / "file"


def non_export_dir(tmp, world):
    (tmp / "precious").mkdir()
    (tmp / "precious" / "notes.txt").write_text("keep me\n")
    return tmp / "precious"


def truncated_state(tmp, world):
    run = run_copy(tmp, world)
    truncate(run / "checkpoints" / "step_000001" / "state.pt")
    return run


def truncated_engine(tmp, world):
    run = run_copy(tmp, world)
    truncate(engine_shard(run / "checkpoints" / "step_000001"))
    return run


# (id, argv (may use {tmp}, {run}, {made}, {export}, {e3}), culprit, setup making {made})
CASES = [
    ("run_missing", ["{tmp}/nope", "{tmp}/out"], "{tmp}/nope", None),
    ("run_is_a_file", ["{made}", "{tmp}/out"], "{made}", a_file),
    ("run_without_config", ["{e3}", "{tmp}/out"], "{e3}/config.yaml", None),
    ("config_garbage", ["{made}", "{tmp}/out"], "{made}/config.yaml", garbage_config),
    ("config_unknown_key", ["{made}", "{tmp}/out"], "max_stesp", unknown_key),
    ("config_bad_value", ["{made}", "{tmp}/out"], "train.ttt_steps=0", bad_value),
    ("config_target_moved", ["{made}", "{tmp}/out"], "{tmp}/moved", target_moved),
    ("step_missing", ["{run}", "{tmp}/out", "--step", "7"], "step_000007", None),
    ("step_negative", ["{run}", "{tmp}/out", "--step", "-1"], "--step=-1", None),
    ("step_not_a_number", ["{run}", "{tmp}/out", "--step", "last"], "--step", None),
    ("dtype_unknown", ["{run}", "{tmp}/out", "--dtype", "int8"], "--dtype", None),
    ("out_is_a_file", ["{run}", "{made}"], "{made}", a_file),
    ("out_not_an_export", ["{run}", "{made}"], "{made}", non_export_dir),
    ("out_is_the_eagle3_drafter", ["{run}", "{e3}", "--layout", "sglang"], "{e3}", None),
    ("out_inside_the_run", ["{run}", "{run}/export"], "{run}/export", None),
    ("layout_for_eagle3_only", ["{run}", "{tmp}/out", "--layout", "sglang"], "--layout sglang", None),
    ("unknown_option", ["{run}", "{tmp}/out", "--fp8"], "--fp8", None),
]
# Damaged checkpoints: refused by their manifest (checksum-verified checkpoints, torchspec/train/checkpoint.py).
DAMAGED = [
    ("state_truncated", ["{made}", "{tmp}/out"], "state.pt", truncated_state),
    ("engine_truncated", ["{made}", "{tmp}/out"], "is truncated", truncated_engine),
]


def _run_case(argv, culprit, setup, world, tmp_path, capfd):
    made = setup(tmp_path, world) if setup else None
    values = {"tmp": tmp_path, "run": world.run, "made": made, "export": world.export, "e3": world.e3}
    check_refused("export", [a.format(**values) for a in argv], culprit.format(**values), [world.root, tmp_path],
                  capfd, absent=(tmp_path / "out", world.run / "export"))


@pytest.mark.parametrize("name, argv, culprit, setup", CASES, ids=[c[0] for c in CASES])
def test_export_refuses_in_one_line(name, argv, culprit, setup, world, tmp_path, capfd):
    _run_case(argv, culprit, setup, world, tmp_path, capfd)


@pytest.mark.parametrize("name, argv, culprit, setup", DAMAGED, ids=[c[0] for c in DAMAGED])
def test_export_refuses_a_damaged_checkpoint(name, argv, culprit, setup, world, tmp_path, capfd):
    _run_case(argv, culprit, setup, world, tmp_path, capfd)


def test_subprocess_export_refuses(world, tmp_path):
    check_refused("export", [str(world.run), str(world.e3)], str(world.e3), [world.root, tmp_path])
