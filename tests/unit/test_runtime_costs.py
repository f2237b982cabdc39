"""torchspec.runtime.costs: the bytes a plain decode step must read (weights once, KV of every committed
position), the cost keys of a bench row, and no copy rate off CUDA."""

from __future__ import annotations

import types

import pytest
import torch

from torchspec.runtime.costs import bytes_per_plain_step, copy_rate_bytes_per_s, step_costs


def fake_engine(tied: bool):
    decoder = torch.nn.Module()
    decoder.embed_tokens = torch.nn.Embedding(100, 8)  # read per row only: not counted
    decoder.layer = torch.nn.Linear(8, 8, bias=False)  # 64 fp32 = 256 bytes
    decoder.lm_head = None if tied else torch.nn.Linear(8, 100, bias=False)  # 800 fp32 = 3200 bytes
    decoder.embed_tokens_weight = decoder.embed_tokens.weight
    kv = torch.zeros(3, 10, 16, 2, 4, dtype=torch.bfloat16)  # 3 layers, [slots..., kv_heads 2, head_dim 4]
    return types.SimpleNamespace(decoder=decoder, caches=types.SimpleNamespace(target=types.SimpleNamespace(k=kv)))


@pytest.mark.parametrize("tied", [False, True])
def test_bytes_per_plain_step(tied):
    engine = fake_engine(tied)
    weights = 256 + 3200  # untied: layer + head; tied: layer + the embedding matrix as the head (same 3200)
    kv_per_token = 2 * 3 * 2 * 4 * 2  # (K, V) x layers x kv_heads x head_dim x bf16
    assert bytes_per_plain_step(engine, 4, 10.5) == weights + 4 * 10.5 * kv_per_token


def test_step_costs_and_no_copy_rate_on_cpu():
    costs = step_costs(3.0, 1.5, 3e9, 4e12)
    assert costs["round_cost_plain_steps"] == 2.0 and costs["plain_step_ms"] == 1.5
    assert costs["hbm_fraction"] == pytest.approx(3e9 / 1.5e-3 / 4e12)
    assert step_costs(3.0, 1.5, 3e9, None)["hbm_fraction"] is None
    assert copy_rate_bytes_per_s("cpu") is None
