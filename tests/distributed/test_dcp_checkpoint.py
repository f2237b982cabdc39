"""DCP checkpoints between engines and world sizes (2 gloo ranks vs one process), fp32:
  * fsdp2 at world 2 writes one shard per rank (nothing gathered on rank 0); "none" at world 1
    loads it: weights, AdamW state and schedule bitwise equal to what fsdp2 held, and training on
    matches the fsdp2 run;
  * "none" at world 1 writes; fsdp2 at world 2 loads: bitwise equal, and training on matches;
  * an async save on 2 ranks is published only once its background write completed, and holds
    the state at save time; the ranks verify a checkpoint together and fall back together.
The tiny drafter, data and training loop are test_engines.py's."""

from __future__ import annotations

import pytest
import torch

from .launcher import launch
from .test_engines import SAVE_AT, STEPS, WORLD, G, build, train

SAMPLER = {"epoch": 0, "position": 0, "batch_size": G}


def full_state(engine) -> dict:
    """Weights, AdamW state and schedule, whole, keyed by the drafter's names (rank 0; collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if engine.masters is not None:
        model, optim = engine.masters.state_dict()
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        model, optim = get_state_dict(engine.module, engine.optimizer, options=options)
    strip = lambda k: k.removeprefix("drafter.")  # noqa: E731
    copy = lambda v: v.detach().clone() if torch.is_tensor(v) else v  # noqa: E731 (no views of live tensors)
    return {"model": {strip(k): copy(v) for k, v in model.items()},
            "optim": {strip(k): {key: copy(v) for key, v in s.items()} for k, s in optim.get("state", {}).items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in optim.get("param_groups", [])],
            "scheduler": engine.scheduler.state_dict()}


def assert_same_state(got: dict, want: dict) -> None:
    assert set(got["model"]) == set(want["model"]) and set(got["optim"]) == set(want["optim"])
    for name, value in want["model"].items():
        assert torch.equal(got["model"][name], value), name
    for name, state in want["optim"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(got["optim"][name][key]), torch.as_tensor(value)), (name, key)
    assert got["scheduler"] == want["scheduler"]
    for g, w in zip(got["groups"], want["groups"], strict=True):
        assert {k: v for k, v in g.items() if k not in ("fused", "foreach")} == \
               {k: v for k, v in w.items() if k not in ("fused", "foreach")}


def _world2_worker(none_dir: str, fsdp2_dir: str, async_dir: str) -> dict:
    from pathlib import Path

    import torch.distributed as dist

    from torchspec.distributed import init_distributed
    from torchspec.train.checkpoint import (
        find_resume_checkpoint,
        finish_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )

    info = init_distributed()
    rank0 = info.rank == 0
    out: dict = {}

    # "none" (world 1) -> fsdp2 (world 2)
    engine = build("fsdp2", 0, seed=1)
    load_checkpoint(find_resume_checkpoint(none_dir, "auto"), engine, global_batch=G)
    out["from_none"] = full_state(engine)
    out["from_none_records"] = train(engine, range(SAVE_AT, STEPS), info.rank, WORLD)

    # fsdp2 (world 2) -> "none" (world 1, in the test process)
    engine = build("fsdp2", 0)
    out["fsdp2_records"] = train(engine, range(SAVE_AT), info.rank, WORLD)
    save_checkpoint(fsdp2_dir, SAVE_AT, engine, SAMPLER, {}, keep=2)
    out["fsdp2_saved"] = full_state(engine)
    out["fsdp2_records"] += train(engine, range(SAVE_AT, STEPS), info.rank, WORLD)

    # async save on 2 ranks: published only after the background write completed
    root = Path(async_dir) / "checkpoints"
    engine = build("fsdp2", 0)
    train(engine, range(1), info.rank, WORLD)
    save_checkpoint(async_dir, 1, engine, SAMPLER, {}, keep=3)
    train(engine, range(1, SAVE_AT), info.rank, WORLD)
    at_save = full_state(engine)
    final = save_checkpoint(async_dir, SAVE_AT, engine, SAMPLER, {}, keep=3, async_save=True)
    train(engine, range(SAVE_AT, STEPS), info.rank, WORLD)  # mutates what the background write copied
    out["before_finish"] = (final.exists(), (root / "latest").read_text())
    dist.barrier()
    finish_checkpoint()
    out["after_finish"] = (final.exists(), (root / "latest").read_text())
    resumed = build("fsdp2", 0, seed=1)
    load_checkpoint(find_resume_checkpoint(async_dir, "auto"), resumed, global_batch=G)
    out["async_loaded"], out["async_at_save"] = full_state(resumed), at_save

    # rank 1's shard of the newest checkpoint damaged: both ranks skip it and take the previous one
    if rank0:
        shard = final / "engine" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier()
    out["fallback"] = str(find_resume_checkpoint(async_dir, "auto"))
    return out


@pytest.fixture(scope="module")
def none_run(tmp_path_factory):
    """A "none" engine trained SAVE_AT steps and checkpointed, then trained to STEPS."""
    out = tmp_path_factory.mktemp("none")
    from torchspec.train.checkpoint import save_checkpoint

    engine = build("none", 0)
    records = train(engine, range(SAVE_AT))
    save_checkpoint(out, SAVE_AT, engine, SAMPLER, {}, keep=2)
    saved = full_state(engine)
    records += train(engine, range(SAVE_AT, STEPS))
    return {"dir": out, "saved": saved, "records": records}


@pytest.fixture(scope="module")
def world2(tmp_path_factory, none_run):
    dirs = [tmp_path_factory.mktemp(name) for name in ("fsdp2", "async")]
    [rank0, rank1] = launch(_world2_worker, WORLD, args=(str(none_run["dir"]), *map(str, dirs)), timeout_s=300)
    return {**rank0, "rank1": rank1, "fsdp2_dir": dirs[0], "async_dir": dirs[1]}


def close_records(got, want):
    for (loss, norm, lr), (ref_loss, ref_norm, ref_lr) in zip(got, want, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6) and norm == pytest.approx(ref_norm, rel=1e-5)
        assert lr == pytest.approx(ref_lr, rel=1e-12)


def test_none_checkpoint_loads_into_fsdp2_at_world2(none_run, world2):
    assert_same_state(world2["from_none"], none_run["saved"])
    close_records(world2["from_none_records"], none_run["records"][SAVE_AT:])
    assert world2["rank1"]["from_none_records"] == world2["from_none_records"]


def test_fsdp2_checkpoint_is_sharded_and_loads_into_none_at_world1(world2):
    from torchspec.train.checkpoint import find_resume_checkpoint, load_checkpoint

    path = find_resume_checkpoint(world2["fsdp2_dir"], "auto")
    shards = {p.name: p.stat().st_size for p in (path / "engine").glob("*.distcp")}
    assert set(shards) == {"__0_0.distcp", "__1_0.distcp"}  # each rank wrote its own
    assert min(shards.values()) > 0.4 * max(shards.values())  # and about half of the tensors each
    engine = build("none", 0, seed=1)
    state = load_checkpoint(path, engine, global_batch=G)
    assert state["world_size"] == WORLD and state["engine"] == "fsdp2"
    assert_same_state(full_state(engine), world2["fsdp2_saved"])
    close_records(train(engine, range(SAVE_AT, STEPS)), world2["fsdp2_records"][SAVE_AT:])


def test_async_save_on_two_ranks_is_published_after_completion(world2):
    assert world2["before_finish"] == (False, "step_000001\n")
    assert world2["after_finish"] == (True, "step_000002\n")
    assert_same_state(world2["async_loaded"], world2["async_at_save"])


def test_ranks_verify_together_and_fall_back_together(world2):
    for rank in (world2, world2["rank1"]):
        assert rank["fallback"].endswith("step_000001")
