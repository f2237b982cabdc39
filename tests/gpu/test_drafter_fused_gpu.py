"""The served drafter step's fused regions on CUDA (skipped without a GPU): same numbers, fewer kernels.

``torchspec.models.layers``: ``rope_tables`` (positions -> cos, sin), ``rope_qk`` (RoPE of q and k), and
``embed_hidden`` (the step's input: the token's embedding row, both RMSNorms and their concatenation) are each
one kernel (``embed_hidden`` at most two: a combo of its two reductions where Inductor makes one), equal to
their eager chains to rounding; ``RMSNorm.add_norm`` takes both residual adds of the layer. A whole served step
(EAGLE-4, bf16, fused for serving) equals the unfused step to bf16 rounding, and its non-GEMM kernels are printed
against a bound that a region falling back to eager (5+ kernels each) would break.
"""

from __future__ import annotations

import collections
import re

import pytest
import torch

from tests.cuda_kernels import kernel_counts
from tests.runtime_pair import build_pair
from torchspec.export.serving import load_exported_drafter
from torchspec.models.layers import (
    embed_hidden,
    embed_hidden_fused,
    rope_qk,
    rope_qk_fused,
    rope_tables,
    rope_tables_fused,
)
from torchspec.runtime.drafter_runner import DrafterRunner
from torchspec.runtime.loading import decoder_identity
from torchspec.runtime.paged_kv import build_attention_meta
from torchspec.targets import TargetDecoder

pytestmark = pytest.mark.gpu

PAGE = 16
GEMM = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitk|cublas|dot_kernel|reduce_1block", re.IGNORECASE)
# non-GEMM kernels of one served EAGLE-4 step (predicted 11-12: step input, RoPE tables, input norm, RoPE,
# KV write, attention (+ its split combine), add+norm, SwiGLU, add+norm; 2026-12-03, not yet measured)
STEP_NON_GEMM_MOST = 16


def _kernels(fn) -> collections.Counter:
    return kernel_counts(fn, reps=3)


def _randn(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, dtype=dtype, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 8])
@torch.no_grad()
def test_each_drafter_region_is_one_kernel_and_equals_its_eager_chain(rows):
    heads, kv_heads, d, h, vocab = 9, 3, 64, 576, 1024
    positions = torch.randint(0, 4000, (1, rows), device="cuda")
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, d, 2, dtype=torch.float32, device="cuda") / d))
    cos, sin = rope_tables_fused(positions, inv_freq)
    want_cos, want_sin = rope_tables(positions, inv_freq)
    torch.testing.assert_close(cos, want_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, want_sin, atol=1e-5, rtol=0)
    assert sum(_kernels(lambda: rope_tables_fused(positions, inv_freq)).values()) == 1

    qkv = _randn(1, rows, (heads + 2 * kv_heads) * d, seed=1)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    q, k = q.view(1, rows, heads, d).transpose(1, 2), k.view(1, rows, kv_heads, d).transpose(1, 2)
    for got, want in zip(rope_qk_fused(q, k, want_cos, want_sin), rope_qk(q, k, want_cos, want_sin)):
        torch.testing.assert_close(got, want)  # bf16: the eager chain's roundings (emulate_precision_casts)
    assert sum(_kernels(lambda: rope_qk_fused(q, k, want_cos, want_sin)).values()) == 1

    weight, ids, hidden = _randn(vocab, h, seed=2), torch.randint(0, vocab, (1, rows), device="cuda"), _randn(1, rows, h, seed=3)
    w_e, w_h = _randn(h, seed=4), _randn(h, seed=5)
    torch.testing.assert_close(embed_hidden_fused(weight, ids, hidden, w_e, 1e-5, w_h, 1e-5),
                               embed_hidden(weight, ids, hidden, w_e, 1e-5, w_h, 1e-5))
    counts = _kernels(lambda: embed_hidden_fused(weight, ids, hidden, w_e, 1e-5, w_h, 1e-5))
    assert sum(counts.values()) <= 2, counts


@torch.no_grad()
def test_served_drafter_step_equals_eager_with_few_kernels(tmp_path, tiny_tokenizer):
    target_dir, export = build_pair(tmp_path, tiny_tokenizer, lm_head_rank=8)
    target = TargetDecoder.from_pretrained(target_dir, aux_layer_ids=[1, 2, 3], dtype=torch.bfloat16, device="cuda")
    runners = []
    for fuse in (False, True):
        model = load_exported_drafter(export, target=decoder_identity(target), dtype=torch.bfloat16).cuda()
        runner = DrafterRunner(model, target.vocab_size)
        if fuse:
            runner.fuse_for_serving()
        runners.append(runner)
    rows, ctx = 4, 20
    tokens = torch.randint(0, target.vocab_size, (rows, 1), device="cuda")
    hidden = _randn(rows, 1, runners[0].hidden_size, seed=6)
    positions = torch.full((rows, 1), ctx, device="cuda")
    pages = -(-(ctx + 2) // PAGE)
    block_table = torch.arange(1, rows * pages + 1, device="cuda").view(rows, pages)
    meta = build_attention_meta(block_table, torch.full((rows,), ctx, device="cuda"),
                                torch.ones(rows, 1, 1, dtype=torch.bool, device="cuda"), PAGE)
    outs, caches = [], []
    for runner in runners:
        cache = runner.make_kv_cache(rows * pages + 1, PAGE)
        cache.k.copy_(_randn(*cache.k.shape, seed=7))  # the same committed keys for both (random, not zeros)
        cache.v.copy_(_randn(*cache.v.shape, seed=8))
        caches.append(cache)
        outs.append(runner.forward(tokens, hidden, positions, cache, meta))
    for want, got in zip(*outs):  # normed, feedback
        rel = ((want.float() - got.float()).abs().max() / want.float().abs().max()).item()
        assert rel <= 2e-2, rel
    counts = _kernels(lambda: runners[1].forward(tokens, hidden, positions, caches[1], meta))
    other = {k: v for k, v in counts.items() if not GEMM.search(k)}
    table = "\n".join(f"{v:4.1f}  {k[:110]}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    print(f"served drafter step: {sum(counts.values()):.0f} kernels, {sum(other.values()):.0f} non-GEMM\n{table}")
    assert sum(other.values()) <= STEP_NON_GEMM_MOST, table
