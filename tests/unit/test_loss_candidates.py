"""The candidate-restricted head loss (``drafter.head_loss=candidates``, torchspec/train/loss_candidates.py)
against a plain per-row reference (full logits, masked to the candidates, renormalised) in fp64; equal
to the full-vocabulary loss where the candidates are the whole vocabulary; a wrong candidate set
rejected; its config keys validated and kept out of the export; and a short training run on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.head_loss_problems import grads
from tests.head_loss_problems import make as head_loss_problem
from torchspec.train.loss import TeacherHead, fused_ttt_head_loss

REPO = Path(__file__).resolve().parents[2]
TIGHT = {"rtol": 1e-9, "atol": 1e-11}


def reference(states, weight, down, up, t_hidden, t_weight, t_bias, w, topk, target_topk, coef, union=True):
    """One row at a time: C = scorer top-k (| target top-m), KL of the renormalised distributions
    over C, plus the scorer's KL to the target over V. ``union=False``: the scorer's top-k only."""
    n, k, _ = states.shape
    v = weight.shape[0]
    loss = states.new_zeros(())
    kl, argmax = torch.zeros(n, k, dtype=states.dtype), torch.zeros(n, k, dtype=torch.long)
    overlaps = 0
    for i in range(n):
        zt = t_weight @ t_hidden[i] + t_bias
        logp = torch.log_softmax(zt, -1)
        target_set = set(zt.topk(target_topk).indices.tolist()) if union else set()
        for j in range(k):
            s = up @ (down @ states[i, j].detach())
            scorer_ids = s.topk(topk).indices
            cand = sorted(set(scorer_ids.tolist()) | target_set)
            overlaps += len(cand) < topk + len(target_set)
            outside = torch.full((v,), float("-inf"), dtype=states.dtype)
            outside[cand] = 0
            z = weight @ states[i, j]  # the full head over all of V, then restricted
            logq_c = torch.log_softmax(z + outside, -1)[cand]
            logp_c = torch.log_softmax(zt + outside, -1)[cand]
            row_kl = (logp_c.exp() * (logp_c - logq_c)).sum()
            scorer_kl = (logp.exp() * (logp - torch.log_softmax(s, -1))).sum()
            loss = loss + w[i, j] * row_kl + coef * w[i, j] * scorer_kl
            kl[i, j] = row_kl.detach()
            argmax[i, j] = scorer_ids[z[scorer_ids].argmax()]
    return loss, kl, argmax, overlaps


def make(seed):
    """This file's problem size: 9 positions over a 40-token vocabulary."""
    return head_loss_problem(seed, n=9, v=40)


def candidates_loss(states, weight, down, up, t_hidden, t_weight, t_bias, w, topk, target_topk, chunk=None):
    return fused_ttt_head_loss(states, weight, TeacherHead(t_hidden, t_weight, t_bias), w, scorer=(down, up),
                               topk=topk, scorer_coef=0.7, chunk_positions=chunk, head_loss="candidates",
                               target_topk=target_topk)


@pytest.mark.parametrize("chunk", [1, 4, None])
def test_candidates_equal_the_per_row_reference(chunk):
    inputs = make(chunk or 0)
    params = list(inputs[:4])
    out = candidates_loss(*inputs, topk=6, target_topk=5, chunk=chunk)
    (1.3 * out.loss).backward()
    got = grads(params)
    ref_loss, ref_kl, ref_argmax, overlaps = reference(*inputs, topk=6, target_topk=5, coef=0.7)
    (1.3 * ref_loss).backward()
    want = grads(params)
    assert overlaps > 3  # the union has duplicates to mask (they must count once)
    torch.testing.assert_close(out.loss, ref_loss, **TIGHT)
    scored = inputs[-1] > 0
    torch.testing.assert_close(out.kl[scored], ref_kl[scored], **TIGHT)
    assert torch.equal(out.argmax[scored], ref_argmax[scored]) and bool(out.full_in_topk[scored].all())
    for name, a, b in zip(("states", "weight", "down", "up"), got, want):
        assert a.abs().sum() > 0, name
        torch.testing.assert_close(a, b, **TIGHT, msg=name)
    with torch.no_grad():  # evaluation: same values, no gradients computed
        again = candidates_loss(*inputs, topk=6, target_topk=5, chunk=chunk)
    torch.testing.assert_close(again.loss, out.loss, rtol=0, atol=0)


def test_candidates_covering_the_vocabulary_are_the_full_loss():
    inputs = make(7)
    params, teacher = list(inputs[:4]), TeacherHead(*inputs[4:7])
    v = inputs[1].shape[0]
    full = fused_ttt_head_loss(inputs[0], inputs[1], teacher, inputs[-1], scorer=tuple(inputs[2:4]), topk=v,
                               scorer_coef=0.7, backend="torch")
    full.loss.backward()
    want = grads(params)
    cand = candidates_loss(*inputs, topk=v, target_topk=5)
    cand.loss.backward()
    got = grads(params)
    torch.testing.assert_close(cand.loss, full.loss, **TIGHT)
    for field in ("kl", "scorer_kl"):
        torch.testing.assert_close(getattr(cand, field), getattr(full, field), **TIGHT)
    for field in ("argmax", "target_argmax", "full_in_topk", "target_in_topk"):
        assert torch.equal(getattr(cand, field), getattr(full, field)), field
    for name, a, b in zip(("states", "weight", "down", "up"), got, want):
        torch.testing.assert_close(a, b, **TIGHT, msg=name)


def test_a_union_without_the_targets_top_k_is_rejected():
    """Positive control: the target's top-1 (token 0) is never among the scorer's top-k, and the full head
    rates it highest. Dropping the target's top-m from the union changes the loss, and the proposal stays
    a scorer candidate although the dense argmax is token 0."""
    states, weight, down, up, t_hidden, t_weight, t_bias, w = make(3)
    with torch.no_grad():
        t_bias[0] = 30.0  # the target's top-1 everywhere
        up[0] = 0.0  # s_0 = 0: under the top-4 of 40 random scores
        states += 2.0 * weight[1]  # a shared direction ...
        weight[0] = 4.0 * weight[1]  # ... along which the full head rates token 0 highest
    inputs = (states, weight, down, up, t_hidden, t_weight, t_bias, w)
    scored = w > 0
    out = candidates_loss(*inputs, topk=4, target_topk=3)
    scorer_only = candidates_loss(*inputs, topk=4, target_topk=0)
    wrong = reference(*inputs, topk=4, target_topk=3, coef=0.7, union=False)[0]
    right = reference(*inputs, topk=4, target_topk=3, coef=0.7)[0]
    assert not bool(out.target_in_topk[scored].any())  # the case is the one described
    dense_argmax = torch.einsum("vh,nkh->nkv", weight, states).argmax(-1)
    assert bool((dense_argmax[scored] == 0).float().mean() > 0.8)
    torch.testing.assert_close(out.loss, right, **TIGHT)
    torch.testing.assert_close(scorer_only.loss, wrong, **TIGHT)
    assert abs(float(out.loss.detach() - wrong.detach())) > 0.1 * float(wrong.detach())
    assert not bool((out.argmax[scored] == 0).any())  # served: token 0 is no candidate, never proposed


def test_candidates_need_the_scorer_and_the_target_teacher():
    states, weight, down, up, t_hidden, t_weight, t_bias, w = make(0)
    teacher = TeacherHead(t_hidden, t_weight, t_bias)
    with pytest.raises(ValueError, match="needs the efficient head's scorer"):
        fused_ttt_head_loss(states, weight, teacher, w, head_loss="candidates")
    with pytest.raises(ValueError, match="scorer_teacher='target'"):
        fused_ttt_head_loss(states, weight, teacher, w, scorer=(down, up), scorer_teacher="full", head_loss="candidates")
    with pytest.raises(ValueError, match="head_loss='sparse'"):
        fused_ttt_head_loss(states, weight, teacher, w, scorer=(down, up), head_loss="sparse")


# --- config: drafter.head_loss / head_loss_target_topk ------------------------------------------------------

CONF = str(REPO / "torchspec" / "conf")


def compose_cfg(*overrides: str):
    from torchspec.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return OmegaConf.to_object(compose(config_name="train", overrides=list(overrides)))


@pytest.mark.parametrize("overrides, message", [
    (["drafter=eagle4_cpu", "drafter.head_loss=candidates"],
     "drafter.head_loss=candidates needs the efficient LM head (drafter.lm_head_rank > 0, got 0)"),
    (["drafter=eagle3", "drafter.head_loss=candidates"], "drafter.head_loss=candidates is not used by drafter.arch=eagle3"),
    (["drafter.head_loss=sparse"], "drafter.head_loss='sparse' is not one of ['full', 'candidates']"),
    (["drafter=eagle4", "drafter.head_loss=candidates", "drafter.head_loss_target_topk=0"], "drafter.head_loss_target_topk=0 must be >= 1"),
    (["drafter=eagle4", "drafter.head_loss=candidates", "drafter.lowrank_teacher=full"],
     "drafter.head_loss=candidates needs drafter.lowrank_teacher=target"),
    (["drafter=eagle4", "drafter.head_loss=candidates", "train.loss_backend=triton"],
     "drafter.head_loss=candidates has no Triton row pass"),
])
def test_head_loss_keys_are_validated(overrides, message):
    from torchspec.config import validate_config

    with pytest.raises(ValueError) as err:
        validate_config(compose_cfg(*overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_head_loss_is_a_training_key_not_exported():
    from dataclasses import fields

    from torchspec.config import DrafterTrainingConfig, validate_config
    from torchspec.models import drafter_config_from_target

    cfg = compose_cfg("drafter=eagle4", "drafter.lm_head_rank=8", "drafter.lm_head_topk=32", "drafter.head_loss=candidates",
                      "drafter.head_loss_target_topk=16")
    validate_config(cfg)
    assert {"head_loss", "head_loss_target_topk"} <= {f.name for f in fields(DrafterTrainingConfig)}

    class Target:
        vocab_size, hidden_size, num_attention_heads, num_key_value_heads = 64, 16, 4, 2
        intermediate_size, num_hidden_layers, rms_norm_eps, rope_theta, max_position_embeddings = 24, 4, 1e-6, 1e4, 128

    exported = drafter_config_from_target(cfg.drafter, Target(), [0, 1, 2]).to_dict()
    assert exported["lm_head_rank"] == cfg.drafter.lm_head_rank  # the export does carry the architecture ...
    assert not [key for key in exported if key.startswith(("head_loss", "lowrank_"))]  # ... and no training key


# --- a short run of the training recipe on the candidate loss ------------------------------------------------


def test_the_recipe_trains_on_the_candidate_loss(tmp_path, tiny_llama_dir, tiny_chat_jsonl):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    args = [sys.executable, str(REPO / "recipes" / "train.py"), f"target.path={tiny_llama_dir}",
            "target.dtype=float32", "target.aux_layer_ids=[1,3,5]", f"data.path={tiny_chat_jsonl}",
            "data.max_length=64", "data.eval_size=4", "data.max_conversations=48", f"train.output_dir={out}",
            "train.max_steps=6", "train.micro_batch_size=4", "train.ttt_steps=3", "train.lr=3e-3",
            "train.warmup_steps=1", "train.precision=fp32", "train.log_every=1", "train.save_every=0",
            "train.report_to=none", "train.plot=false", "train.num_threads=1",
            "drafter.lm_head_rank=16", "drafter.lm_head_topk=32", "drafter.head_loss=candidates",
            "drafter.head_loss_target_topk=16"]
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert train[-1]["train/loss"] < 0.8 * train[0]["train/loss"]
    assert train[-1]["train/topk_recall_full"] == 1.0  # the proposal is a candidate by construction
    evals = [r for r in records if "eval/loss" in r]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    exported = json.loads((out / "drafter" / "config.json").read_text())
    assert "head_loss" not in json.dumps(exported)
