"""The training recipe under torchrun on CPU/gloo: world 4 = dp 2 x tp 2 reproduces the single-process
run on the same global batch (FSDP2 and DeepSpeed ZeRO-2), and a 2-process run killed after a
checkpoint resumes to exactly the uninterrupted trajectory.

Runs go through ``tests.distributed.launcher.run_script`` (torchrun's worker environment, forked from a
server with torch + torchspec imported: ~5 s of CPU saved per rank on the 2-core CI machine); the refusal
of a tp that does not divide the world runs under the real ``torchrun``, which the other tests mimic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .launcher import free_port, run_script

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS = 4


def run(out: Path, target: str, data: str, nproc: int, *extra: str, env_extra=None, real_torchrun=False):
    """The recipe on ``nproc`` ranks: forked by ``run_script``, or (``real_torchrun``) a ``torchrun`` subprocess."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu", **(env_extra or {})}
    script = REPO / "recipes" / "train.py"
    args = [f"target.path={target}", "target.dtype=float32", "target.aux_layer_ids=[1,3,5]",
            f"data.path={data}", "data.max_length=64", "data.eval_size=8", "data.max_conversations=null",
            f"train.output_dir={out}", f"train.max_steps={STEPS}", "train.ttt_steps=2", "train.lr=3e-3",
            "train.warmup_steps=1", "train.precision=fp32", "train.log_every=1", "train.save_every=2",
            "train.report_to=none", "train.plot=false", "train.num_threads=1", "drafter.lm_head_rank=0",
            *extra]
    if not real_torchrun:
        return run_script(script, args, nproc, env=env, timeout_s=600)
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    return subprocess.run([*launcher, str(script), *args], env=env, capture_output=True, text=True, timeout=600)


def losses(out: Path) -> list[tuple[int, str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], k, r[k]) for r in rows for k in ("train/loss", "eval/loss", "train/grad_norm") if k in r]


def close(a, b, tol=2e-5):
    assert [x[:2] for x in a] == [x[:2] for x in b]
    for (step, key, x), (_, _, y) in zip(a, b):
        assert abs(x - y) <= tol * max(1.0, abs(x)), (step, key, x, y)


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory, tiny_llama_dir, tiny_chat_jsonl) -> Path:
    """The one-process run on the global batch of 8: the reference of both engines' dp 2 x tp 2 runs
    (the same command each time: run once, read by each)."""
    out = tmp_path_factory.mktemp("recipe_parallel") / "single"
    single = run(out, tiny_llama_dir, tiny_chat_jsonl, 1, "train.micro_batch_size=8")
    assert single.returncode == 0, single.stderr[-3000:]
    return out


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_dp2_tp2_matches_single_process(tmp_path, tiny_llama_dir, tiny_chat_jsonl, single_process_run, engine):
    par = run(tmp_path / engine, tiny_llama_dir, tiny_chat_jsonl, 4, "train.micro_batch_size=2",
              f"parallel={engine}", "parallel.target_tp=2")
    assert par.returncode == 0, par.stderr[-5000:]
    close(losses(single_process_run), losses(tmp_path / engine))
    assert (tmp_path / engine / "drafter" / "model.safetensors").exists()


def test_two_process_kill_and_resume(tmp_path, tiny_llama_dir, tiny_chat_jsonl):
    args = ("train.micro_batch_size=2", "parallel=fsdp2")
    full = run(tmp_path / "full", tiny_llama_dir, tiny_chat_jsonl, 2, *args)
    assert full.returncode == 0, full.stderr[-3000:]
    crashed = run(tmp_path / "resumed", tiny_llama_dir, tiny_chat_jsonl, 2, *args,
                  env_extra={"TORCHSPEC_CRASH_AFTER_STEP": "3"})
    assert crashed.returncode != 0
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text().strip() == "step_000002"
    resumed = run(tmp_path / "resumed", tiny_llama_dir, tiny_chat_jsonl, 2, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path / "full") == losses(tmp_path / "resumed")
    # train.max_wall_s below the setup time: both ranks agree to stop at step 1 (the first log step) with a
    # synchronous FSDP2 checkpoint there (save_every=2 has none), exit 0; the rerun resumes exactly.
    stopped = run(tmp_path / "timed", tiny_llama_dir, tiny_chat_jsonl, 2, *args, "train.max_wall_s=0.01")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert (tmp_path / "timed" / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert not (tmp_path / "timed" / "DONE").exists()
    again = run(tmp_path / "timed", tiny_llama_dir, tiny_chat_jsonl, 2, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert losses(tmp_path / "full") == losses(tmp_path / "timed")


def test_tp_not_dividing_world_is_refused(tmp_path, tiny_llama_dir, tiny_chat_jsonl):
    result = run(tmp_path / "bad", tiny_llama_dir, tiny_chat_jsonl, 2, "parallel=fsdp2", "parallel.target_tp=4",
                 real_torchrun=True)  # the suite's one real torchrun launch of the recipe
    assert result.returncode != 0
    assert "torchspec-train: error:" in result.stderr and "parallel.target_tp=4" in result.stderr


def test_moe_balancing_matches_single_process(tmp_path, tiny_llama_dir, tiny_chat_jsonl):
    """drafter=eagle4_moe under FSDP2 on 2 ranks: each step's routing-bias update uses the global expert
    loads (all-reduced), and the auxiliary loss is the aux of the micro-batch of both ranks
    (``ttt.load_balancing_terms``), so the exported bias, the losses and the logged aux equal the single
    process's on the same global batch. The aux weight is 10x the default so that it moves the router."""
    from safetensors.torch import load_file

    moe = ("drafter=eagle4_moe", "drafter.moe_num_experts=4", "drafter.moe_bias_rate=0.05", "drafter.moe_aux_loss_coef=0.1")
    single = run(tmp_path / "single", tiny_llama_dir, tiny_chat_jsonl, 1, "train.micro_batch_size=8", *moe)
    assert single.returncode == 0, single.stderr[-3000:]
    par = run(tmp_path / "dp2", tiny_llama_dir, tiny_chat_jsonl, 2, "train.micro_batch_size=4", "parallel=fsdp2", *moe)
    assert par.returncode == 0, par.stderr[-5000:]
    close(losses(tmp_path / "single"), losses(tmp_path / "dp2"))

    def aux(out: Path) -> list[float]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["train/moe_aux_loss"] for r in rows if "train/moe_aux_loss" in r]

    single_aux = aux(tmp_path / "single")
    assert len(single_aux) == STEPS and all(1.0 <= a <= 4.0 for a in single_aux)  # 1 = balanced, E = collapsed
    assert aux(tmp_path / "dp2") == pytest.approx(single_aux, rel=1e-5)

    def bias(out: Path):
        return next(v for k, v in load_file(out / "drafter" / "model.safetensors").items() if k.endswith("route_bias"))

    assert bias(tmp_path / "single").abs().max() > 0
    assert bias(tmp_path / "single").tolist() == bias(tmp_path / "dp2").tolist()
