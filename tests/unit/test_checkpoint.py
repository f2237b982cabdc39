"""Checkpoints are atomic: a crash while writing leaves the previous one intact and loadable;
a restored engine continues exactly like the uninterrupted one."""

from __future__ import annotations

import functools

import pytest
import torch

from torchspec.train.checkpoint import find_resume_checkpoint, load_checkpoint, save_checkpoint
from torchspec.train.engine import OptimConfig, build_engine
from torchspec.train.optim import warmup_cosine

SAMPLER = {"epoch": 0, "position": 3, "batch_size": 4}


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)  # frozen weights are not stored
    sched = functools.partial(warmup_cosine, warmup_steps=2, max_steps=10, min_lr_ratio=0.1)
    return build_engine("none", model, OptimConfig(lr=1e-2), sched)


def step(engine):
    x = torch.randn(3, 4)
    engine.backward(engine.drafter(x).sum())
    engine.step()


def test_round_trip_restores_everything(tmp_path):
    engine = make()
    step(engine)
    save_checkpoint(tmp_path, 1, engine, SAMPLER, {"k": 1}, keep=2)
    after_save = torch.rand(3)  # RNG stream right after saving
    step(engine)
    expected = {k: v.clone() for k, v in engine.drafter.state_dict().items()}

    engine2 = make(seed=1)
    engine2.drafter[0].weight.data.copy_(engine.drafter[0].weight)  # frozen: comes back from the target
    state = load_checkpoint(find_resume_checkpoint(tmp_path, "auto"), engine2, global_batch=4)
    assert state["step"] == 1 and state["sampler"] == SAMPLER and state["extra"] == {"k": 1}
    assert torch.equal(torch.rand(3), after_save)
    step(engine2)
    for k, v in engine2.drafter.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_crash_during_write_keeps_previous(tmp_path, monkeypatch):
    engine = make()
    save_checkpoint(tmp_path, 1, engine, SAMPLER, {}, keep=2)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, engine, SAMPLER, {}, keep=2)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000001"
    assert find_resume_checkpoint(tmp_path, "auto") == root / "step_000001"
    assert not (root / "step_000002").exists()


def test_keeps_only_the_newest(tmp_path):
    engine = make()
    for s in range(1, 5):
        save_checkpoint(tmp_path, s, engine, SAMPLER, {}, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000003", "step_000004"]


def test_mismatched_model_or_batch_is_refused(tmp_path):
    engine = make()
    save_checkpoint(tmp_path, 1, engine, SAMPLER, {}, keep=2)
    path = tmp_path / "checkpoints" / "step_000001"
    with pytest.raises(ValueError, match="global batch of 4"):
        load_checkpoint(path, make(), global_batch=8)
    other = build_engine("none", torch.nn.Sequential(torch.nn.Linear(4, 4)), OptimConfig(lr=1e-2), lambda s: 1.0)
    with pytest.raises(ValueError, match="does not match"):
        load_checkpoint(path, other, global_batch=4)


def test_explicit_resume_path_must_exist(tmp_path):
    with pytest.raises(ValueError, match="no state.pt there"):
        find_resume_checkpoint(tmp_path, str(tmp_path / "nope"))
    assert find_resume_checkpoint(tmp_path, "never") is None
    assert find_resume_checkpoint(tmp_path, "auto") is None
