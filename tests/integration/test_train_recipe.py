"""The training recipe end to end on a tiny target: loss falls, the run writes what it promises,
and a run killed after a checkpoint resumes to exactly the uninterrupted trajectory (CPU, fp32).

Each run is ``python recipes/train.py ...`` with its own exit status, stdout and stderr, forked by
``tests.distributed.launcher.run_script`` from a server that has torch + torchspec imported (~5 s of
CPU per run saved); one test runs it as a fresh interpreter (``fresh_interpreter=True``), so a
recipe that only works with those modules preloaded still fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.launcher import run_script

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_recipe(out_dir: Path, target_dir: str, data_path: str, *extra: str, env_extra=None, fresh_interpreter=False):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    script = REPO / "recipes" / "train.py"
    args = [
        f"target.path={target_dir}", "target.dtype=float32", "target.aux_layer_ids=[1,3,5]",
        f"data.path={data_path}", "data.max_length=64", "data.eval_size=8", "data.max_conversations=null",
        f"train.output_dir={out_dir}", "train.max_steps=8", "train.micro_batch_size=4", "train.grad_accum=2",
        "train.ttt_steps=3", "train.lr=3e-3", "train.warmup_steps=2", "train.precision=fp32",
        "train.log_every=1", "train.save_every=4", "train.report_to=none", "train.plot=true",
        "train.num_threads=1", *extra,
    ]
    if fresh_interpreter:
        return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300)
    return run_script(script, args, env=env, timeout_s=300)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_loss_falls_and_resume_is_exact(tmp_path, tiny_llama_dir, tiny_chat_jsonl):
    head = ("drafter.lm_head_rank=16", "drafter.lm_head_topk=32")  # the efficient head, on a hidden-64 target
    full = run_recipe(tmp_path / "full", tiny_llama_dir, tiny_chat_jsonl, *head)
    assert full.returncode == 0, full.stderr[-3000:]
    records = read(tmp_path / "full" / "metrics.jsonl")
    train = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert train[-1]["train/loss"] < train[0]["train/loss"]
    assert [r["step"] for r in evals] == [0, 8]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    assert 0 <= evals[-1]["eval/topk_recall_full"] <= 1 and "train/topk_recall_target_0" in train[-1]
    for name in ("config.yaml", "training.png", "drafter/config.json", "drafter/model.safetensors", "DONE"):
        assert (tmp_path / "full" / name).exists(), name

    # Kill after step 6: the checkpoint of step 4 is the last complete one.
    crashed = run_recipe(tmp_path / "resumed", tiny_llama_dir, tiny_chat_jsonl, *head,
                         env_extra={"TORCHSPEC_CRASH_AFTER_STEP": "6"})
    assert crashed.returncode == 17, crashed.stderr[-3000:]
    ckpts = tmp_path / "resumed" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000004"
    assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name]
    resumed = run_recipe(tmp_path / "resumed", tiny_llama_dir, tiny_chat_jsonl, *head)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    again = read(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in again] == [r["step"] for r in records]  # steps 5-6 of the crash were dropped
    for a, b in zip(records, again):
        assert a.keys() == b.keys()
        for key in a:
            if key not in ("train/tokens_per_s",):
                assert a[key] == b[key], (a["step"], key, a[key], b[key])


def test_wall_clock_limit_stops_at_a_log_step_with_a_checkpoint_and_resumes_exactly(tmp_path, tiny_llama_dir,
                                                                                     tiny_chat_jsonl):
    """train.max_wall_s shorter than the setup (~0.1 s here): the run trains to its first log step (log_every=2), writes that
    step's checkpoint synchronously (save_every=4 has none there) and exits 0 without DONE or export; the
    rerun resumes and logs exactly what an uninterrupted run logs."""
    args = ("train.log_every=2", "train.async_checkpoint=true")
    full = run_recipe(tmp_path / "full", tiny_llama_dir, tiny_chat_jsonl, *args)
    assert full.returncode == 0, full.stderr[-3000:]
    stopped = run_recipe(tmp_path / "run", tiny_llama_dir, tiny_chat_jsonl, *args, "train.max_wall_s=0.01",
                         "train.stall_dump_s=120")  # operational too; steps of ms never stall
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "train.max_wall_s=0.01: stopped at step 2" in stopped.stdout + stopped.stderr
    run = tmp_path / "run"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert not (run / "DONE").exists() and not (run / "drafter").exists()
    assert (run / "stalls.txt").read_text() == ""
    resumed = run_recipe(run, tiny_llama_dir, tiny_chat_jsonl, *args)  # the limit is operational: dropped here
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr and (run / "DONE").exists()
    records, again = read(tmp_path / "full" / "metrics.jsonl"), read(run / "metrics.jsonl")
    assert [r["step"] for r in again] == [r["step"] for r in records]
    for a, b in zip(records, again):
        assert {k: v for k, v in a.items() if k != "train/tokens_per_s"} == \
            {k: v for k, v in b.items() if k != "train/tokens_per_s"}, a["step"]


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_end_of_run_serving_export_done_marker_and_rerun(tmp_path, tiny_llama_dir, tiny_chat_jsonl):
    """The run ends with the serving export in <output_dir>/drafter and DONE; rerunning it touches no
    file and says so in one line; a larger train.max_steps continues it without repeating a line."""
    from torchspec.export.checkpoint_export import export_from_checkpoint
    from torchspec.export.serving import export_training, is_export, load_exported_drafter
    from torchspec.targets import TargetDecoder

    out, base = tmp_path / "run", ("train.max_steps=3", "train.save_every=2", "train.log_every=1", "train.plot=false")
    first = run_recipe(out, tiny_llama_dir, tiny_chat_jsonl, *base)
    assert first.returncode == 0, first.stderr[-3000:]
    done = json.loads((out / "DONE").read_text())
    final_eval = read(out / "metrics.jsonl")[-1]
    assert done == {"step": 3, "export": "drafter", "eval": {k: v for k, v in final_eval.items() if k != "step"}}
    assert is_export(out / "drafter")  # strict config + safetensors + target fingerprint: served as is
    drafter = load_exported_drafter(out / "drafter", target=TargetDecoder.from_pretrained(tiny_llama_dir, [1, 3, 5]))
    assert next(drafter.parameters()).dtype == torch.float32  # a fp32 run exports fp32 (bf16 runs: bf16)
    tokens = [r["train/tokens"] for r in read(out / "metrics.jsonl") if "train/tokens" in r]
    assert tokens == sorted(set(tokens)) and tokens[0] > 0  # cumulative real tokens, growing every step
    assert export_training(out / "drafter") == {"step": 3, "train_tokens": tokens[-1]}

    before = snapshot(out)
    again = run_recipe(out, tiny_llama_dir, tiny_chat_jsonl, *base)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines() == [
        f"run in {out} already finished at step 3 (held-out acceptance {done['eval']['eval/acceptance_length']:.3f}); "
        f"nothing to do — raise train.max_steps to continue or pick a new train.output_dir"]
    assert snapshot(out) == before  # byte-identical files, same mtimes, nothing added

    more = run_recipe(out, tiny_llama_dir, tiny_chat_jsonl, *base[1:], "train.max_steps=5")
    assert more.returncode == 0, more.stderr[-3000:]
    records = read(out / "metrics.jsonl")
    assert [(r["step"], "eval/loss" in r) for r in records] == [
        (0, True), (1, False), (2, False), (3, False), (3, True), (4, False), (5, False), (5, True)]
    assert json.loads((out / "DONE").read_text())["step"] == 5
    tokens_5 = [r["train/tokens"] for r in records if "train/tokens" in r]
    assert tokens_5[:3] == tokens and tokens_5[-1] > tokens[-1]  # the count survives the resume
    assert export_training(out / "drafter") == {"step": 5, "train_tokens": tokens_5[-1]}
    # torchspec-export of an earlier checkpoint records that checkpoint's own count
    export_from_checkpoint(out, tmp_path / "step4", step=4, dtype="float32")
    assert export_training(tmp_path / "step4") == {"step": 4, "train_tokens": tokens_5[3]}
    # a run with target.dtype=auto (bf16 on CUDA) exports too: its embeddings are read in fp32
    config = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(config.replace("dtype: float32", "dtype: auto", 1))
    export_from_checkpoint(out, tmp_path / "step4_auto", step=4, dtype="float32")
    assert (tmp_path / "step4_auto" / "model.safetensors").read_bytes() == \
        (tmp_path / "step4" / "model.safetensors").read_bytes()


# Bad input (target, aux ids, config values, data files): the table in test_bad_input_train.py.


@pytest.mark.parametrize("preset, extra", [
    ("eagle3", ["drafter.draft_vocab_size=128"]),
    ("eagle3_1", ["drafter.draft_vocab_size=128"]),
    ("eagle4_moe", ["drafter.moe_num_experts=4", "drafter.lm_head_rank=0"]),
    ("eagle4", ["drafter.sliding_window=8", "drafter.nope=true", "drafter.attn_backend=eager",
                "drafter.lm_head_rank=8", "drafter.lowrank_teacher=full"]),
])
def test_every_preset_trains_through_the_recipe(tmp_path, tiny_llama_dir, tiny_chat_jsonl, preset, extra):
    out = tmp_path / preset
    result = run_recipe(out, tiny_llama_dir, tiny_chat_jsonl, f"drafter={preset}", "train.max_steps=3",
                        "train.save_every=0", "train.plot=false", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read(out / "metrics.jsonl")
    assert records[-1]["step"] == 3 and "eval/acceptance_length" in records[-1]
    written = json.loads((out / "drafter" / "config.json").read_text())
    if preset.startswith("eagle3"):
        assert written["draft_vocab_size"] == 128 and "draft vocabulary 128" in result.stdout + result.stderr
        assert written["fc_norm"] == (preset == "eagle3_1") and written["norm_output"] == (preset == "eagle3_1")
    if preset == "eagle4_moe":
        assert written["moe"] is True and written["moe_num_experts"] == 4
        assert any("train/moe_load_imbalance" in r for r in records)
        # the preset's loss-free balancing: 3 sign steps of 0.01, exported with the weights
        bias = next(v for k, v in load_file(out / "drafter" / "model.safetensors").items() if k.endswith("route_bias"))
        steps = bias.double() / 0.01
        assert bias.dtype == torch.float32 and bias.abs().max() > 0 and bias.abs().max() <= 0.03 + 1e-6
        assert torch.allclose(steps, steps.round(), atol=1e-4)
    if preset == "eagle4" and extra:
        assert written["sliding_window"] == 8 and written["nope"] is True


def test_init_from_is_weights_only_and_checks_the_architecture(tmp_path, tiny_llama_dir, tiny_chat_jsonl):
    base = ("drafter.lm_head_rank=0", "train.save_every=0", "train.plot=false")
    first = run_recipe(tmp_path / "a", tiny_llama_dir, tiny_chat_jsonl, *base, "train.max_steps=3")
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_recipe(tmp_path / "b", tiny_llama_dir, tiny_chat_jsonl, *base, "train.max_steps=2",
                        f"train.init_from={tmp_path / 'a' / 'drafter'}")
    assert second.returncode == 0, second.stderr[-3000:]
    end_of_a = [r for r in read(tmp_path / "a" / "metrics.jsonl") if "eval/loss" in r][-1]
    start_of_b = [r for r in read(tmp_path / "b" / "metrics.jsonl") if "eval/loss" in r][0]
    assert start_of_b["step"] == 0
    assert start_of_b["eval/loss"] == end_of_a["eval/loss"]  # same weights, same held-out set
    assert [r["train/lr"] for r in read(tmp_path / "b" / "metrics.jsonl") if "train/lr" in r]  # fresh schedule
    wrong = run_recipe(tmp_path / "c", tiny_llama_dir, tiny_chat_jsonl, *base, "train.max_steps=2",
                       "drafter.norm_output=false", f"train.init_from={tmp_path / 'a' / 'drafter'}")
    assert wrong.returncode == 2 and "differs from the configured Eagle4Config in ['norm_output']" in wrong.stderr


def test_held_out_from_its_own_file_walks_servings_rounds(tmp_path, tiny_llama_dir, tiny_chat_jsonl):
    """data.eval_path: every usable conversation trains (none split off), the held-out set is the eval file's first data.eval_size;
    every eval logs eval/chain_acceptance (serving's rounds walked: >= 1, at most K + 1), training steps none."""
    from tests.conftest import make_conversations

    held_out = tmp_path / "heldout.jsonl"
    held_out.write_text("".join(json.dumps(c) + "\n" for c in make_conversations(5, seed=7)))
    run = run_recipe(tmp_path / "run", tiny_llama_dir, tiny_chat_jsonl, "train.max_steps=2", "train.plot=false",
                     f"data.eval_path={held_out}", "data.eval_size=3", fresh_interpreter=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "data: 57 train / 3 held-out sequences; kept 57," in run.stdout + run.stderr  # 57 of 80 fit 64 tokens
    records = read(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(1.0 <= r["eval/chain_acceptance"] <= 4.0 for r in evals)
    assert not any("train/chain_acceptance" in r for r in records)
