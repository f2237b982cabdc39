"""Serving's fused target on CUDA (skipped without a GPU): same numbers, fewer kernels.

* Fused decode (``fuse_for_serving``: compiled regions, the one-launch KV write, the pending-residual
  loop) == unfused decode over the paged cache: fp32 within 1e-4 and the same argmax, bf16 within 2%
  of each hidden state's magnitude (the tolerance of ``test_target_gpu.py``) and every argmax
  disagreement a near-tie (top-2 logit gap <= 0.1).
* A fused decode step replays in a CUDA graph to the eager step's numbers.
* Kernel counts (torch.profiler): each fused region is ONE kernel (residual add + RMSNorm; q/k norm +
  RoPE of q and k for Qwen3, Llama and the hybrid's partial RoPE; the K/V write), and one plain
  decode step of a Qwen3-family target launches per layer (the difference of a 4- and a 2-layer
  target, so embedding, final norm and metadata cancel out) at most

      7 non-GEMM kernels  add+norm (input), q/k norm+RoPE, KV write, paged attention, its split-K
                          combine, add+norm (post-attention), SwiGLU
      8 cuBLAS kernels    q|k|v, o, gate|up, down (+ a split-K reduction each at most)

  i.e. 13 at the Qwen3-8B shape on an H200 (4 GEMMs + 2 split-K reductions), down from 19.
"""

from __future__ import annotations

import collections
import re

import pytest
import torch

from tests.cuda_kernels import kernel_counts
from torchspec.runtime.paged_kv import PagedAttend, PagedKVCache, build_attention_meta
from torchspec.targets import TargetDecoder, build_tiny_target
from torchspec.targets.layers import add_rms_norm_fused, qk_norm_rope_fused

pytestmark = pytest.mark.gpu

PAGE, PROMPT, STEPS = 16, 24, 6
REL_TOL_BF16 = 2e-2
NON_GEMM_PER_LAYER, GEMM_PER_LAYER = 7, 8
GEMM = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitk|cublas|dot_kernel|reduce_1block", re.IGNORECASE)


def _target(root, num_layers: int) -> str:
    return build_tiny_target(str(root / f"qwen3_{num_layers}"), "qwen3", vocab_size=384, num_layers=num_layers,
                             hidden_size=512, num_heads=8, num_kv_heads=2, initializer_range=0.05)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_gpu")
    return {n: _target(root, n) for n in (2, 4)}


class Decoding:
    """A paged cache with one row's prompt prefilled; ``step(token)`` decodes at a fixed position."""

    def __init__(self, dec: TargetDecoder, prompt: torch.Tensor):
        self.dec, b, t = dec, *prompt.shape
        pages = -(-(t + STEPS + 1) // PAGE)
        self.cache = PagedKVCache.for_target(dec, b * pages + 1, PAGE)
        self.block_table = torch.arange(1, b * pages + 1, device="cuda").view(b, pages)
        causal = torch.ones(t, t, dtype=torch.bool, device="cuda").tril().expand(b, t, t)
        meta = build_attention_meta(self.block_table, torch.zeros(b, dtype=torch.long, device="cuda"), causal, PAGE)
        self.first = dec(prompt, torch.arange(t, device="cuda").expand(b, t), PagedAttend(self.cache, meta)).hidden
        self.ctx = torch.full((b,), t, dtype=torch.long, device="cuda")
        self.one = torch.ones(b, 1, 1, dtype=torch.bool, device="cuda")

    def step(self, token: torch.Tensor) -> torch.Tensor:
        meta = build_attention_meta(self.block_table, self.ctx, self.one, PAGE)
        return self.dec(token, self.ctx[:, None], PagedAttend(self.cache, meta)).hidden[:, -1]  # [B, H]

    def decode(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        out = [self.first[:, -1]]
        for s in range(tokens.shape[1]):
            out.append(self.step(tokens[:, s:s + 1]))
            self.ctx += 1
        return out


def _load(path: str, dtype: torch.dtype, fuse: bool) -> TargetDecoder:
    dec = TargetDecoder.from_pretrained(path, (), dtype=dtype, device="cuda")
    return dec.fuse_for_serving() if fuse else dec


def _ids(shape, seed: int) -> torch.Tensor:
    return torch.randint(0, 384, shape, generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_fused_decode_equals_unfused(targets, dtype):
    prompt, tokens = _ids((2, PROMPT), 0), _ids((2, STEPS), 1)
    want = Decoding(_load(targets[4], dtype, False), prompt).decode(tokens)
    fused = _load(targets[4], dtype, True)
    got = Decoding(fused, prompt).decode(tokens)
    for w, g in zip(want, got):
        if dtype == torch.float32:
            assert (w - g).abs().max().item() <= 1e-4
        else:
            rel = ((w.float() - g.float()).abs().max() / w.float().abs().max()).item()
            assert rel <= REL_TOL_BF16, rel
    want_logits, got_logits = fused.logits(torch.stack(want)), fused.logits(torch.stack(got))  # fp32 [S, B, V]
    differ = want_logits.argmax(-1) != got_logits.argmax(-1)
    top2 = want_logits.topk(2, dim=-1).values
    assert not differ.any() if dtype == torch.float32 else (top2[..., 0] - top2[..., 1])[differ].le(0.1).all()


@torch.no_grad()
def test_fused_decode_step_replays_in_a_cuda_graph(targets):
    run = Decoding(_load(targets[4], torch.bfloat16, True), _ids((1, PROMPT), 2))
    token = _ids((1, 1), 3)
    for _ in range(2):  # compile and warm up outside the capture
        eager = run.step(token)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run.step(token)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager)


def _kernels(fn) -> collections.Counter:
    return kernel_counts(fn, reps=3)


@pytest.mark.parametrize("batch", [1, 4])
@torch.no_grad()
def test_each_fused_region_is_one_kernel(batch):
    from torchspec.runtime.kv_write_triton import write_kv_triton

    dt, h, heads, kvh, d, eps = torch.bfloat16, 4096, 32, 8, 128, 1e-6  # Qwen3-8B, one decode token per row

    def randn(*shape):
        return torch.randn(*shape, dtype=dt, device="cuda")

    x, delta, w = randn(batch, 1, h), randn(batch, 1, h), randn(h)
    assert sum(_kernels(lambda: add_rms_norm_fused(x, delta, w, eps)).values()) == 1
    q, k, v = randn(batch, 1, (heads + 2 * kvh) * d).split([heads * d, kvh * d, kvh * d], -1)
    q, k, v = q.view(batch, 1, heads, d), k.view(batch, 1, kvh, d), v.view(batch, 1, kvh, d).transpose(1, 2)
    norms = (randn(d), randn(d), eps)
    # Qwen3 (q/k norm), Llama (RoPE only), hybrid (1 + w norms, partial RoPE)
    # Qwen3 and Llama: one launch for q and k. The hybrid's partial rotary is 3 kernels under torch
    # 2.11's Inductor on the H200 (a reduction + 2 pointwise: measured 2026-12-01), vs 4 separate ops.
    for rot, args, offset, most in [(d, norms, False, 1), (d, (), False, 1), (d // 4, norms, True, 3)]:
        cos, sin = randn(batch, 1, 1, rot), randn(batch, 1, 1, rot)
        counts = _kernels(lambda: qk_norm_rope_fused(q, k, cos, sin, *args, offset=offset))  # noqa: B023
        assert sum(counts.values()) <= most, (rot, len(args), offset, counts)
    k_new = k.transpose(1, 2)  # [B, kv_heads, 1, D]
    k_pool, v_pool = randn(64 * PAGE, kvh, d), randn(64 * PAGE, kvh, d)
    slots = torch.arange(batch, device="cuda")[:, None] + PAGE
    assert sum(_kernels(lambda: write_kv_triton(k_new, v, k_pool, v_pool, slots)).values()) == 1


@torch.no_grad()
def test_plain_decode_step_kernels_per_layer(targets):
    counts = {}
    for n, path in targets.items():
        run = Decoding(_load(path, torch.bfloat16, True), _ids((1, PROMPT), 4))
        token = _ids((1, 1), 5)
        counts[n] = _kernels(lambda: run.step(token))  # noqa: B023
    per_layer = {k: v / 2 for k, v in (counts[4] - counts[2]).items()}  # 2 more layers
    assert not (counts[2] - counts[4]), counts  # a 4-layer step launches at least what a 2-layer one does
    gemm = {k: v for k, v in per_layer.items() if GEMM.search(k)}
    other = {k: v for k, v in per_layer.items() if not GEMM.search(k)}
    table = "\n".join(f"{v:4.1f}  {k[:110]}" for k, v in sorted(per_layer.items(), key=lambda kv: -kv[1]))
    print(f"kernels per layer: {sum(per_layer.values()):.1f} ({sum(other.values()):.1f} non-GEMM)\n{table}")
    assert sum(other.values()) <= NON_GEMM_PER_LAYER, table
    assert sum(gemm.values()) <= GEMM_PER_LAYER, table
