"""Checkpoints are verified before use: a damaged latest checkpoint (truncated, corrupted or missing
file, no manifest, unreadable ``latest``) is skipped with ONE warning line naming it, the previous
intact one is used and the resumed run equals the uninterrupted one; when none is intact, a
ValueError names the directory. Async saves are published only once their write completed."""

from __future__ import annotations

import functools
import logging
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchspec.train.checkpoint import (
    find_resume_checkpoint,
    finish_checkpoint,
    load_checkpoint,
    publish_if_written,
    save_checkpoint,
    verify_checkpoint,
    write_manifest,
)
from torchspec.train.engine import OptimConfig, build_engine
from torchspec.train.optim import warmup_cosine

SAMPLER = {"epoch": 0, "position": 0, "batch_size": 4}


def checkpoint_warnings(caplog) -> list[logging.LogRecord]:
    """The records of torchspec's checkpoint logger (caplog also sees other libraries' records, e.g.
    DCP's debug events under pytest >= 9.2)."""
    return [r for r in caplog.records if r.name == "torchspec.train.checkpoint" and r.levelno >= logging.WARNING]
FINAL = 6


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)  # frozen, "the target's": the same for every seed, not stored
    model[0].weight.data = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    sched = functools.partial(warmup_cosine, warmup_steps=2, max_steps=FINAL, min_lr_ratio=0.1)
    return build_engine("none", model, OptimConfig(lr=1e-2, weight_decay=0.1), sched)


def train(engine, steps: range) -> None:
    for _ in steps:
        engine.backward(engine.drafter(torch.randn(3, 4)).sum())  # data from the (restored) RNG stream
        engine.step()


def run(out: Path) -> dict[str, torch.Tensor]:
    """Checkpoints at steps 2 and 4, trained on to FINAL; returns the uninterrupted final weights."""
    torch.manual_seed(123)
    engine = make()
    for step in (2, 4):
        train(engine, range(step - 2, step))
        save_checkpoint(out, step, engine, SAMPLER, {"step": step}, keep=3)
    train(engine, range(4, FINAL))
    return engine.drafter_state_dict()


def resume(out: Path) -> tuple[int, dict[str, torch.Tensor]]:
    engine = make(seed=1)  # other initial weights: everything trainable must come from the checkpoint
    state = load_checkpoint(find_resume_checkpoint(out, "auto"), engine, global_batch=4)
    train(engine, range(state["step"], FINAL))
    return state["step"], engine.drafter_state_dict()


def truncate(path: Path) -> None:
    file = path / "engine" / "__0_0.distcp"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def flip(path: Path) -> None:
    data = bytearray((path / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    (path / "state.pt").write_bytes(bytes(data))


DAMAGE = {  # how to damage a checkpoint -> what the warning must say about it
    "truncated": (truncate, r"engine/__0_0\.distcp is truncated \(\d+ bytes, the manifest says \d+\)"),
    "flipped bytes": (flip, r"state\.pt is corrupted \(its SHA-256 differs"),
    "missing file": (lambda p: (p / "engine" / ".metadata").unlink(), r"engine/\.metadata is missing"),
    "missing manifest": (lambda p: (p / "manifest.json").unlink(), r"no manifest\.json"),
    "garbage manifest": (lambda p: (p / "manifest.json").write_bytes(b"\x00{"), r"manifest\.json is unreadable"),
    "missing directory": (shutil.rmtree, r"step_000004 \(the directory is missing\)"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_latest_falls_back_to_the_previous_one(tmp_path, caplog, damage):
    final = run(tmp_path)
    hurt, said = DAMAGE[damage]
    hurt(tmp_path / "checkpoints" / "step_000004")
    with caplog.at_level(logging.WARNING, logger="torchspec.train.checkpoint"):
        step, resumed = resume(tmp_path)
    assert step == 2
    [record] = checkpoint_warnings(caplog)  # ONE warning line, naming the damaged checkpoint, the file and the one used
    message = record.getMessage()
    assert "\n" not in message and "step_000004" in message and message.endswith("using step_000002")
    assert re.search(said, message), message
    for name, value in final.items():
        assert torch.equal(resumed[name], value), name  # bitwise: the resumed run equals the uninterrupted one


@pytest.mark.parametrize("latest", [b"\x00\xff\xfe garbage", b"", b"../../etc\n", b"step_000009\n"])
def test_unreadable_latest_falls_back_to_the_newest_intact(tmp_path, caplog, latest):
    final = run(tmp_path)
    (tmp_path / "checkpoints" / "latest").write_bytes(latest)
    with caplog.at_level(logging.WARNING, logger="torchspec.train.checkpoint"):
        step, resumed = resume(tmp_path)
    assert step == 4
    [record] = checkpoint_warnings(caplog)
    assert "latest" in record.getMessage() or "step_000009" in record.getMessage()
    assert "\n" not in record.getMessage() and record.getMessage().endswith("using step_000004")
    for name, value in final.items():
        assert torch.equal(resumed[name], value), name


def test_all_damaged_is_a_value_error_naming_the_directory(tmp_path):
    run(tmp_path)
    root = tmp_path / "checkpoints"
    truncate(root / "step_000004")
    flip(root / "step_000002")
    with pytest.raises(ValueError) as error:
        find_resume_checkpoint(tmp_path, "auto")
    message = str(error.value)
    assert f"no intact checkpoint in {root}" in message and "Delete" in message and "train.resume=never" in message
    assert "step_000004 (engine/__0_0.distcp is truncated" in message and "step_000002 (state.pt is corrupted" in message


def test_a_named_damaged_checkpoint_is_refused_not_replaced(tmp_path):
    run(tmp_path)
    path = tmp_path / "checkpoints" / "step_000004"
    flip(path)
    with pytest.raises(ValueError, match=r"train.resume=.*step_000004.* is damaged: state.pt is corrupted"):
        find_resume_checkpoint(tmp_path, str(path))
    with pytest.raises(ValueError, match=r"checkpoint .*step_000004 is damaged: state.pt is corrupted"):
        load_checkpoint(path, make(), global_batch=4)


def test_export_reads_checkpoints_the_same_way(tmp_path, caplog):
    from torchspec.export.checkpoint_export import _checkpoint_dir

    run(tmp_path)
    root = tmp_path / "checkpoints"
    (root / "step_000004" / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="torchspec.train.checkpoint"):
        assert _checkpoint_dir(tmp_path, None) == root / "step_000002"
    [record] = checkpoint_warnings(caplog)
    assert "step_000004 (no manifest.json" in record.getMessage()
    with pytest.raises(ValueError, match=r"step_000004 cannot be exported \(no manifest.json.*\['step_000002'\]"):
        _checkpoint_dir(tmp_path, 4)
    flip(root / "step_000002")
    with pytest.raises(ValueError, match=f"no intact checkpoint in {root}.*Export the run's final drafter"):
        _checkpoint_dir(tmp_path, None)


def test_verify_accepts_intact_and_names_every_damage(tmp_path):
    run(tmp_path)
    path = tmp_path / "checkpoints" / "step_000004"
    assert verify_checkpoint(path) is None
    (path / "engine" / ".metadata").unlink()
    flip(path)
    assert verify_checkpoint(path) == "engine/.metadata is missing; state.pt is corrupted (its SHA-256 differs " \
                                      "from the manifest's)"



def test_write_manifest_reseals_a_checkpoint_edited_on_purpose(tmp_path):
    run(tmp_path)
    path = tmp_path / "checkpoints" / "step_000004"
    state = torch.load(path / "state.pt", weights_only=False)
    torch.save({**state, "extra": {"edited": True}}, path / "state.pt")
    assert "state.pt is" in verify_checkpoint(path)
    write_manifest(path)
    assert verify_checkpoint(path) is None


# --- async saves -------------------------------------------------------------------------------------

@pytest.fixture
def gated_writes(monkeypatch):
    """DCP's file writes wait until the returned event is set (a background write in progress)."""
    gate = threading.Event()
    write_data = dcp.FileSystemWriter.write_data

    def gated(self, *args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        return write_data(self, *args, **kwargs)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", gated)
    yield gate
    gate.set()
    finish_checkpoint()


def test_async_save_is_published_only_after_its_write_completed(tmp_path, gated_writes):
    root = tmp_path / "checkpoints"
    engine = make()
    train(engine, range(2))
    gated_writes.set()
    save_checkpoint(tmp_path, 2, engine, SAMPLER, {}, keep=3, async_save=True)
    assert finish_checkpoint() == root / "step_000002"
    gated_writes.clear()

    train(engine, range(2, 4))
    at_save = engine.drafter_state_dict()
    final = save_checkpoint(tmp_path, 4, engine, SAMPLER, {}, keep=3, async_save=True)
    train(engine, range(4, 6))  # training goes on while the (blocked) write holds its in-memory copy
    # A kill now would leave step 2: step 4 is neither in place nor named by `latest`.
    assert final == root / "step_000004" and not final.exists() and (root / ".step_000004.tmp").is_dir()
    assert (root / "latest").read_text() == "step_000002\n"
    assert find_resume_checkpoint(tmp_path, "auto") == root / "step_000002"
    gated_writes.set()
    assert finish_checkpoint() == final and finish_checkpoint() is None
    assert (root / "latest").read_text() == "step_000004\n" and verify_checkpoint(final) is None

    resumed = make(seed=1)
    load_checkpoint(find_resume_checkpoint(tmp_path, "auto"), resumed, global_batch=4)
    for name, value in resumed.drafter_state_dict().items():
        assert torch.equal(value, at_save[name]), name  # the state at save time, not the later one


def test_the_next_save_publishes_the_pending_async_one(tmp_path):
    engine = make()
    train(engine, range(1))
    save_checkpoint(tmp_path, 1, engine, SAMPLER, {}, keep=3, async_save=True)
    train(engine, range(1, 2))
    save_checkpoint(tmp_path, 2, engine, SAMPLER, {}, keep=3)  # synchronous; publishes step 1 first
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]
    assert verify_checkpoint(root / "step_000001") is None and (root / "latest").read_text() == "step_000002\n"


def test_publish_if_written_waits_for_nothing_and_publishes_a_finished_write(tmp_path, gated_writes):
    """The recipe calls it on log steps: a pending write is left alone, a finished one is published."""
    root = tmp_path / "checkpoints"
    engine = make()
    train(engine, range(1))
    assert publish_if_written() is None  # nothing in flight
    gated_writes.clear()
    final = save_checkpoint(tmp_path, 1, engine, SAMPLER, {}, keep=3, async_save=True)
    assert publish_if_written() is None and not final.exists()  # the write is blocked: no waiting
    gated_writes.set()
    for _ in range(600):  # the background write finishes on its own
        if (published := publish_if_written()) is not None:
            break
        threading.Event().wait(0.05)
    assert published == final and (root / "latest").read_text() == "step_000001\n"
    assert verify_checkpoint(final) is None and finish_checkpoint() is None
