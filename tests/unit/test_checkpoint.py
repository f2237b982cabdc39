"""Checkpoints are atomic: a crash while writing leaves the previous one intact and loadable."""

from __future__ import annotations

import pytest
import torch

from torchspec.train.checkpoint import find_resume_checkpoint, load_checkpoint, save_checkpoint
from torchspec.train.optim import build_optimizer, build_scheduler


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)  # frozen weights are not stored
    opt = build_optimizer(model, 1e-2, 0.0, [0.9, 0.95])
    sched = build_scheduler(opt, 2, 10, 0.1)
    return model, opt, sched


def step(model, opt, sched):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_round_trip_restores_everything(tmp_path):
    model, opt, sched = make()
    step(model, opt, sched)
    save_checkpoint(tmp_path, 1, model, opt, sched, {"epoch": 0, "position": 3}, {"k": 1}, keep=2)
    after_save = torch.rand(3)  # RNG stream right after saving
    step(model, opt, sched)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2 = make()
    state = load_checkpoint(find_resume_checkpoint(tmp_path, "auto"), model2, opt2, sched2)
    assert state["step"] == 1 and state["sampler"] == {"epoch": 0, "position": 3}
    assert torch.equal(torch.rand(3), after_save)
    step(model2, opt2, sched2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_crash_during_write_keeps_previous(tmp_path, monkeypatch):
    model, opt, sched = make()
    save_checkpoint(tmp_path, 1, model, opt, sched, {}, {}, keep=2)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, opt, sched, {}, {}, keep=2)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert find_resume_checkpoint(tmp_path, "auto") == root / "step_000001"


def test_keeps_only_the_newest(tmp_path):
    model, opt, sched = make()
    for s in range(1, 5):
        save_checkpoint(tmp_path, s, model, opt, sched, {}, {}, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000003", "step_000004"]


def test_mismatched_model_is_refused(tmp_path):
    model, opt, sched = make()
    save_checkpoint(tmp_path, 1, model, opt, sched, {}, {}, keep=2)
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opt2 = build_optimizer(other, 1e-2, 0.0, [0.9, 0.95])
    with pytest.raises(ValueError, match="does not match this drafter"):
        load_checkpoint(tmp_path / "checkpoints" / "step_000001", other, opt2, build_scheduler(opt2, 1, 2, 0.1))


def test_explicit_resume_path_must_exist(tmp_path):
    with pytest.raises(ValueError, match="no state.pt there"):
        find_resume_checkpoint(tmp_path, str(tmp_path / "nope"))
    assert find_resume_checkpoint(tmp_path, "never") is None
    assert find_resume_checkpoint(tmp_path, "auto") is None
