"""The serving switch of the Triton top-k and its kernels under Triton's interpreter, on CPU.

* ``fuse_serving_layers`` turns ``EfficientLMHead.fast_select`` on; off by default (training).
* With the switch on, CPU tensors keep the torch path (and never import triton: CI has none).
* ``plan`` (launch sizes from shapes only) is legal for every supported shape and picks the
  block sizes the module docstring states.
* tests/gpu/test_select_triton.py under ``TRITON_INTERPRET=1`` in a fresh process (the variable
  is read when triton is imported); skipped where triton is not importable.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from torchspec.models.layers import fuse_serving_layers
from torchspec.models.lm_head import EfficientLMHead

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not importable")


def test_serving_fusion_turns_fast_select_on():
    model = nn.ModuleDict({"head": EfficientLMHead(32, 300, rank=8, topk=16)})
    assert model["head"].fast_select is False
    fuse_serving_layers(model)
    assert model["head"].fast_select is True


def test_fast_select_keeps_the_torch_path_on_cpu():
    torch.manual_seed(0)
    head = EfficientLMHead(32, 300, rank=8, topk=16)
    h = torch.randn(2, 3, 32)
    ids, logits = head.candidates(h)
    head.fast_select = True
    ids_fast, logits_fast = head.candidates(h)
    assert torch.equal(ids, ids_fast) and torch.equal(logits, logits_fast)


@needs_triton
def test_plan_is_legal_and_follows_the_cost_rule():
    from torchspec.runtime.select_triton import MAX_MERGE, plan

    for v in (7, 1000, 1024, 1025, 49152, 151936, 248320, 1 << 21):
        for k in (1, 3, 4, 100, 128):
            for dtype in (torch.bfloat16, torch.float32):
                if k > v:
                    continue
                p = plan(v, k, dtype)
                assert p["block_v"] >= p["kp"] >= k and p["blocks"] * p["block_v"] >= v, p
                assert p["blocks"] == 1 or p["merge"] <= MAX_MERGE, p
    assert plan(1000, 128, torch.bfloat16)["blocks"] == 1  # one launch
    assert plan(49152, 128, torch.bfloat16)["block_v"] == 4096
    assert plan(248320, 128, torch.bfloat16)["block_v"] == 8192


@needs_triton
def test_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
                           "tests/gpu/test_select_triton.py"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
