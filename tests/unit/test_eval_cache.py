"""Held-out evaluation reuses the frozen target's captures between evals (same values, no second
target forward), only while they fit the cache budget, and never under a tp group."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from torchspec.train import step as step_mod
from torchspec.train.step import TTTOptions, evaluate
from torchspec.train.ttt import TTTResult


class CountingTarget:
    def __init__(self):
        self.calls = 0
        self.lm_head_weight, self.lm_head_bias = torch.randn(11, 4), None

    def capture(self, input_ids, **_):
        self.calls += 1
        h = input_ids.float()[..., None].expand(*input_ids.shape, 4).clone()
        return SimpleNamespace(aux_hidden_states=[h, h + 1, h + 2], last_hidden_state=h * 2)


class EchoEngine:
    """Returns statistics computed from the captured states, so a wrong reuse would show."""

    module = nn.Module()

    def unroll(self, input_ids, loss_mask, aux, teacher, denominators, num_steps, decay, **_):
        k = torch.ones(num_steps, dtype=torch.float64)
        return TTTResult(loss=teacher.hidden.sum(), kl_sum=aux[2].sum() * k, correct=k, valid=k * 2,
                         chain_tokens=k.sum() * 3, chain_rounds=k.sum(), aux={})


def batches(n):
    return [{"input_ids": torch.full((2, 5), i + 1), "attention_mask": torch.ones(2, 5, dtype=torch.long),
             "loss_mask": torch.ones(2, 5, dtype=torch.long)} for i in range(n)]


def test_second_eval_reuses_captures_and_matches():
    target, engine, opts, data = CountingTarget(), EchoEngine(), TTTOptions(2, 0.8), batches(3)
    cache: dict = {}
    first = evaluate(target, engine, data, opts, cache=cache)
    assert target.calls == 3 and len(cache) == 3
    second = evaluate(target, engine, data, opts, cache=cache)
    assert target.calls == 3 and first == second
    assert evaluate(target, engine, data, opts) == first and target.calls == 6  # no cache: recomputed


def test_cache_respects_its_budget(monkeypatch):
    target, engine, opts, data = CountingTarget(), EchoEngine(), TTTOptions(2, 0.8), batches(3)
    one = 4 * 2 * 5 * 4 * 4  # four [2, 5, 4] fp32 tensors per batch
    monkeypatch.setattr(step_mod, "EVAL_CACHE_BYTES", 2 * one)
    cache: dict = {}
    first = evaluate(target, engine, data, opts, cache=cache)
    assert sorted(cache) == [0, 1]
    assert evaluate(target, engine, data, opts, cache=cache) == first and target.calls == 4  # batch 2 again
