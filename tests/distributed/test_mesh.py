"""The (dp, tp) mesh: validation messages, layout on 4 gloo ranks, rank helpers, and the launcher itself."""

import re
import time

import pytest
import torch

from torchspec.distributed import (
    all_reduce_sum,
    build_mesh,
    gather_tp_batch,
    init_distributed,
    is_rank0,
    scatter_for_rank,
    validate_mesh,
)

from .launcher import DistributedTestFailure, launch


def test_validate_mesh_tp_not_dividing_world():
    assert validate_mesh(4, 2) == 2
    assert validate_mesh(4, 4) == 1
    with pytest.raises(ValueError) as e:
        validate_mesh(6, 4)
    msg = str(e.value)
    assert "WORLD_SIZE=6" in msg and "target_tp=4" in msg and "dp = 6/4 = 1.5" in msg
    assert "[1, 2, 3, 6]" in msg  # the fix: the tp values that divide the world
    with pytest.raises(ValueError, match=r"target_tp=0 must be >= 1"):
        validate_mesh(4, 0)


def _mesh_worker():
    info = init_distributed(device_type="cpu")
    mesh = build_mesh(info.world_size, 2, "cpu")
    tp, dp = mesh["tp"], mesh["dp"]
    tp_group, dp_group = tp.get_group(), dp.get_group()
    world_sum = all_reduce_sum(torch.tensor([float(info.rank)]))
    tp_sum = all_reduce_sum(torch.tensor([float(info.rank)]), group=tp_group)
    try:
        build_mesh(2, 1, "cpu")
        wrong_world = None
    except ValueError as e:
        wrong_world = str(e)
    # Unequal micro-batches: tp rank r has r + 1 rows of length 3 + 2r, filled with its global rank.
    b, t = tp.get_local_rank() + 1, 3 + 2 * tp.get_local_rank()
    ids = torch.full((b, t), 100 + info.rank)
    mask = torch.ones(b, t, dtype=torch.long)
    union, layout = gather_tp_batch({"input_ids": ids, "attention_mask": mask}, tp_group, {"input_ids": -1})
    mine = scatter_for_rank(union["input_ids"], layout, tp.get_local_rank())
    return {
        "rank": info.rank,
        "mesh": mesh.mesh.tolist(),
        "dim_names": mesh.mesh_dim_names,
        "tp_ranks": torch.distributed.get_process_group_ranks(tp_group),
        "dp_ranks": torch.distributed.get_process_group_ranks(dp_group),
        "world_sum": world_sum.item(),
        "tp_sum": tp_sum.item(),
        "is_rank0": is_rank0(),
        "wrong_world": wrong_world,
        "union_ids": union["input_ids"],
        "union_mask": union["attention_mask"],
        "layout": layout,
        "mine_equals_own": torch.equal(mine, ids),
    }


def test_mesh_world4_tp2_on_gloo():
    results = launch(_mesh_worker, world_size=4)
    for rank, r in enumerate(results):
        assert r["rank"] == rank
        assert r["dim_names"] == ("dp", "tp")
        assert r["mesh"] == [[0, 1], [2, 3]]  # shape (dp=2, tp=2)
        assert r["tp_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]  # consecutive ranks share a target
        assert r["dp_ranks"] == [rank % 2, rank % 2 + 2]
        assert r["world_sum"] == 0 + 1 + 2 + 3
        assert r["tp_sum"] == (rank // 2 * 2) * 2 + 1
        assert r["is_rank0"] == (rank == 0)
        assert "build_mesh(world_size=2)" in r["wrong_world"] and "has 4 ranks" in r["wrong_world"]
        # The tp group's union batch: [2 ranks * 2 rows, 5 cols], rank-ordered, right/bottom padded.
        first = rank // 2 * 2
        expected = torch.full((4, 5), -1)
        expected[0, :3] = 100 + first
        expected[2:4, :5] = 100 + first + 1
        assert torch.equal(r["union_ids"], expected), r["union_ids"]
        assert torch.equal(r["union_mask"], (expected != -1).long())
        assert r["layout"].shapes == ((1, 3), (2, 5)) and r["layout"].rows_per_rank == 2
        assert r["mine_equals_own"]


def _raise_on_rank1():
    info = init_distributed(device_type="cpu")
    if info.rank == 1:
        raise RuntimeError("boom from rank one")
    torch.distributed.barrier()  # rank 0 would wait forever for rank 1 without the launcher
    return info.rank


def _hang_on_rank1():
    import os

    if os.environ["RANK"] == "1":
        time.sleep(600)
    return 0


def test_launcher_reports_the_failing_ranks_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as e:
        launch(_raise_on_rank1, world_size=2, timeout_s=60)
    msg = str(e.value)
    # rank 0's barrier may fail in the same instant (gloo sees the peer close), so rank 1 must be among
    # the first to fail, not necessarily alone
    assert re.search(r"first to fail: rank\(s\) \[(0, )?1\]", msg), msg
    assert "rank 1 raised" in msg and "RuntimeError: boom from rank one" in msg and "_raise_on_rank1" in msg
    assert time.monotonic() - start < 30  # did not wait for the timeout


def test_launcher_timeout_fails_with_message():
    with pytest.raises(DistributedTestFailure, match=r"timed out after 1s; ranks still running: \[(0, )?1\]"):
        launch(_hang_on_rank1, world_size=2, timeout_s=1)
