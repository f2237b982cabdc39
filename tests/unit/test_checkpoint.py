"""Checkpoints are atomic: a crash while writing leaves the previous one intact and loadable;
a restored engine continues exactly like the uninterrupted one. (Damaged checkpoints and async
saves: test_checkpoint_verify.py; resharding between engines and world sizes: tests/distributed.)"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchspec.train.checkpoint as checkpoint
from torchspec.train.checkpoint import find_resume_checkpoint, load_checkpoint, save_checkpoint
from torchspec.train.engine import OptimConfig, build_engine
from torchspec.train.optim import warmup_cosine

SAMPLER = {"epoch": 0, "position": 3, "batch_size": 4}


def make(seed: int = 0, precision: str = "fp32"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)  # frozen weights are not stored
    sched = functools.partial(warmup_cosine, warmup_steps=2, max_steps=10, min_lr_ratio=0.1)
    return build_engine("none", model, OptimConfig(lr=1e-2, weight_decay=0.1), sched, precision=precision)


def step(engine):
    x = torch.randn(3, 4)
    engine.backward(engine.drafter(x.to(engine.drafter[0].weight.dtype)).float().sum())
    engine.step()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_round_trip_restores_everything(tmp_path, precision):
    engine = make(precision=precision)
    step(engine)
    save_checkpoint(tmp_path, 1, engine, SAMPLER, {"k": 1}, keep=2)
    after_save = torch.rand(3)  # RNG stream right after saving
    step(engine)
    expected = {k: v.clone() for k, v in engine.drafter_state_dict().items()}

    engine2 = make(seed=1, precision=precision)
    engine2.drafter[0].weight.data.copy_(engine.drafter[0].weight)  # frozen: comes back from the target
    state = load_checkpoint(find_resume_checkpoint(tmp_path, "auto"), engine2, global_batch=4)
    assert state["step"] == 1 and state["sampler"] == SAMPLER and state["extra"] == {"k": 1}
    assert torch.equal(torch.rand(3), after_save)
    step(engine2)
    assert engine2.lr == engine.lr
    for k, v in engine2.drafter_state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_layout_and_manifest(tmp_path):
    engine = make()
    step(engine)
    path = save_checkpoint(tmp_path, 7, engine, SAMPLER, {}, keep=2)
    root = tmp_path / "checkpoints"
    assert path == root / "step_000007" and (root / "latest").read_text() == "step_000007\n"
    files = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file())
    assert files == ["engine/.metadata", "engine/__0_0.distcp", "manifest.json", "state.pt"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["engine/.metadata", "engine/__0_0.distcp", "state.pt"]
    for name, entry in manifest["files"].items():
        assert entry["size"] == (path / name).stat().st_size
        assert len(entry["sha256"]) == 64
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000007"]  # no temporary left behind


def _boom(*args, **kwargs):
    raise KeyboardInterrupt("killed mid-write")


def _replace_killed_at(suffix: str):
    real = os.replace

    def replace(src, dst):
        if str(dst).endswith(suffix):
            raise KeyboardInterrupt(f"killed renaming {src} -> {dst}")
        return real(src, dst)
    return replace


@pytest.mark.parametrize("where", ["engine shards", "state.pt", "manifest", "rename", "latest"])
def test_crash_during_write_keeps_previous(tmp_path, monkeypatch, where):
    engine = make()
    save_checkpoint(tmp_path, 1, engine, SAMPLER, {}, keep=2)
    target, kill = {"engine shards": (dcp, "save"), "state.pt": (checkpoint, "fsync_save"),
                    "manifest": (checkpoint, "write_manifest")}.get(where, (os, "replace")), _boom
    if where in ("rename", "latest"):
        kill = _replace_killed_at("step_000002" if where == "rename" else "latest")
    with monkeypatch.context() as m:
        m.setattr(*target, kill)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(tmp_path, 2, engine, SAMPLER, {}, keep=2)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000001"
    assert find_resume_checkpoint(tmp_path, "auto") == root / "step_000001"  # `latest` is the commit point
    assert (root / "step_000002").exists() == (where == "latest")  # killed after the rename: complete, unused
    save_checkpoint(tmp_path, 2, engine, SAMPLER, {}, keep=2)  # the next save replaces the leftovers
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]


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


def test_checkpoint_of_an_older_torchspec_is_refused_with_a_message(tmp_path):
    """The layout before DCP: state.pt + one unsharded engine.pt, no manifest."""
    old = tmp_path / "checkpoints" / "step_000003"
    old.mkdir(parents=True)
    torch.save({"step": 3}, old / "state.pt")
    torch.save({"kind": "none", "model": {}}, old / "engine.pt")
    (tmp_path / "checkpoints" / "latest").write_text("step_000003\n")
    with pytest.raises(ValueError, match=r"step_000003 \(no manifest.json: written by an older torchspec.*"
                                         r"Delete .*checkpoints to start the run over"):
        find_resume_checkpoint(tmp_path, "auto")
    with pytest.raises(ValueError, match="older torchspec"):
        make().load(old)


class WithBuffer(torch.nn.Module):
    """A trainable layer and a persistent integer buffer (as EAGLE-3's d2t vocab mapping)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.register_buffer("mapping", torch.zeros(5, dtype=torch.long))

    def forward(self, x):
        return self.linear(x)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_persistent_buffers_round_trip(tmp_path, precision):
    engine = build_engine("none", WithBuffer(), OptimConfig(lr=1e-2), lambda s: 1.0, precision=precision)
    engine.drafter.mapping.copy_(torch.arange(5) * 3)
    save_checkpoint(tmp_path, 1, engine, SAMPLER, {}, keep=2)
    again = build_engine("none", WithBuffer(), OptimConfig(lr=1e-2), lambda s: 1.0, precision=precision)
    load_checkpoint(find_resume_checkpoint(tmp_path, "auto"), again, global_batch=4)
    assert torch.equal(again.drafter.mapping, torch.arange(5) * 3)
