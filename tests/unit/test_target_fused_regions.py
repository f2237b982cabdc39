"""Serving's fused regions compute exactly what the separate ops compute (`torchspec.targets.fused_ops`).

* ``add_rms_norm`` / ``add_offset_rms_norm`` (a residual add with the norm after it) and
  ``qk_norm_rope`` (q/k norm + RoPE of q and k: Qwen3's norms, none for Llama, the hybrid's
  ``1 + w`` norms with partial RoPE) equal the module-by-module ops bit for bit, in fp32 and bf16,
  on the strided views the decoder hands them (the plain functions, which the fused ones run on CPU).
* The decoder's serving loop (``TargetDecoder.fused``: each residual add carried into the next norm)
  equals the plain loop bit for bit in fp32 for every flavour -- MoE and both hybrid layer kinds
  included -- with every layer captured, so the aux states are still the residual stream after
  each layer.
* ``fused`` itself: a region whose compile fails retries without its extra options, then runs eagerly.
* The one-launch KV write (``kv_write_triton.write_kv_triton``) equals the two ``index_copy_`` of
  the reference, on strided inputs, odd head counts and head sizes, and with a dtype cast. It runs
  on CUDA, or on CPU under Triton's interpreter (skipped otherwise):

      PYTHONPATH=<triton> TRITON_INTERPRET=1 python -m pytest --noconftest -q \
          tests/unit/test_target_fused_regions.py -k write_kv
"""

import importlib.util
import os

import pytest
import torch

from torchspec.runtime.paged_kv import write_kv, write_kv_reference
from torchspec.targets import TargetDecoder, build_tiny_target
from torchspec.targets.capture import dense_attend
from torchspec.targets.layers import (
    OffsetRMSNorm,
    RMSNorm,
    add_offset_rms_norm,
    add_rms_norm,
    add_rms_norm_fused,
    qk_norm_rope,
    qk_norm_rope_fused,
)
from torchspec.targets.rope import apply_rope
from torchspec.targets.tiny import TINY_FLAVOURS, TINY_HYBRID_FLAVOURS

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_cls, region", [(RMSNorm, add_rms_norm), (OffsetRMSNorm, add_offset_rms_norm)])
def test_add_norm_equals_add_then_norm(dtype, norm_cls, region):
    norm = norm_cls(64, eps=1e-6).to(dtype)
    norm.weight.data = _randn(64, dtype=dtype, seed=1)
    x, delta = _randn(3, 5, 64, dtype=dtype), _randn(3, 5, 64, dtype=dtype, seed=2)
    want = x + delta
    got_stream, got = region(x, delta, norm.weight, norm.eps)
    assert torch.equal(got_stream, want) and torch.equal(got, norm(want))
    norm.fused = True  # on CPU the fused module runs the same plain function
    stream, normed = norm.add_norm(x, delta)
    assert torch.equal(stream, want) and torch.equal(normed, norm(want))
    stream, normed = norm.add_norm(x, None)  # layer 0: nothing pending
    assert stream is x and torch.equal(normed, norm(x))
    if norm_cls is RMSNorm:
        assert all(torch.equal(a, b) for a, b in zip(add_rms_norm_fused(x, delta, norm.weight, norm.eps), (want, got)))


# family -> (heads, kv_heads, head_dim, rotary_dim, norm class or None)
QK_CASES = {
    "qwen3": (4, 2, 32, 32, RMSNorm),
    "llama": (4, 2, 32, 32, None),
    "hybrid": (4, 2, 32, 8, OffsetRMSNorm),  # partial RoPE: the leading quarter of each head
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(QK_CASES))
def test_qk_norm_rope_equals_separate_ops(dtype, case):
    heads, kv_heads, d, rot, norm_cls = QK_CASES[case]
    b, t = 2, 3
    qkv = _randn(b, t, (heads + 2 * kv_heads) * d, dtype=dtype)  # the fused projection's output
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    q, k = q.view(b, t, heads, d), k.view(b, t, kv_heads, d)  # strided views, as the layer has them
    cos, sin = _randn(b, 1, t, rot, dtype=dtype, seed=3), _randn(b, 1, t, rot, dtype=dtype, seed=4)
    if norm_cls is None:
        args, want_q, want_k = (), q, k
    else:
        q_norm, k_norm = norm_cls(d, eps=1e-6).to(dtype), norm_cls(d, eps=1e-6).to(dtype)
        q_norm.weight.data, k_norm.weight.data = _randn(d, dtype=dtype, seed=5), _randn(d, dtype=dtype, seed=6)
        args, want_q, want_k = (q_norm.weight, k_norm.weight, 1e-6), q_norm(q), k_norm(k)
    want_q, want_k = apply_rope(want_q.transpose(1, 2), cos, sin), apply_rope(want_k.transpose(1, 2), cos, sin)
    offset = norm_cls is OffsetRMSNorm
    for fn in (qk_norm_rope, qk_norm_rope_fused):
        got_q, got_k = fn(q, k, cos, sin, *args, offset=offset)
        assert got_q.shape == (b, heads, t, d) and got_k.shape == (b, kv_heads, t, d)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("flavour", sorted(TINY_FLAVOURS) + sorted(TINY_HYBRID_FLAVOURS))
def test_serving_loop_equals_plain_loop(tmp_path, flavour):
    """Only the loop's form changes (no GEMM fusion here), so fp32 results are bit-identical."""
    dec = TargetDecoder.from_pretrained(build_tiny_target(str(tmp_path / flavour), flavour), ())
    ids = torch.randint(0, dec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    every_layer = list(range(dec.num_layers))

    def run(fused: bool, capture: list[int]):
        dec.fused = fused
        positions, attend = dense_attend(ids)
        return dec(ids, positions, attend, capture_layers=capture)

    for capture in (every_layer, [dec.num_layers - 1], []):
        want, got = run(False, capture), run(True, capture)
        assert torch.equal(got.hidden, want.hidden)
        assert len(got.aux) == len(capture) and all(torch.equal(g, w) for g, w in zip(got.aux, want.aux))


def _kv_case(b, tq, kvh, d, new_dtype, pool_dtype, trash_rows, seed=0):
    """Random pools and this forward's K/V as the layer hands them (k: a transposed RoPE output, v: a
    view of the fused projection); slots distinct, except that ``trash_rows`` rows all hit page 0."""
    g = torch.Generator().manual_seed(seed)
    page, num_pages = 4, b * tq + 8
    k_pool = torch.randn(num_pages * page, kvh, d, generator=g).to(pool_dtype)
    v_pool = torch.randn(num_pages * page, kvh, d, generator=g).to(pool_dtype)
    k_new = torch.randn(b, tq, kvh, d, generator=g).to(new_dtype).transpose(1, 2)  # [B, kvh, Tq, D], strided
    v_new = torch.randn(b, tq, 3 * kvh * d, generator=g).to(new_dtype)[..., kvh * d: 2 * kvh * d]
    v_new = v_new.view(b, tq, kvh, d).transpose(1, 2)
    slots = (torch.randperm((num_pages - 1) * page, generator=g)[: b * tq] + page).view(b, tq)
    slots[:trash_rows] = torch.arange(tq) % page  # padding rows: the trash page
    return k_new, v_new, k_pool, v_pool, slots


def test_write_kv_on_cpu_is_the_reference():
    k_new, v_new, k_pool, v_pool, slots = _kv_case(2, 3, 2, 16, torch.float32, torch.float32, 0)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    write_kv_reference(k_new, v_new, want_k, want_v, slots)
    write_kv(k_new, v_new, k_pool, v_pool, slots)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    flat = slots.reshape(-1)
    assert torch.equal(k_pool[flat], k_new.transpose(1, 2).reshape(-1, 2, 16))


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA, or TRITON_INTERPRET=1 with triton")
@pytest.mark.parametrize("b, tq, kvh, d, new_dtype, pool_dtype, trash_rows", [
    (1, 1, 8, 128, torch.float16, torch.float16, 0),  # plain decode, Qwen3-8B's KV shape
    (3, 1, 2, 64, torch.float32, torch.float32, 1),  # decode with a padding row
    (2, 5, 3, 80, torch.float32, torch.float32, 0),  # tree / prefill chunk; head count and size not powers of 2
    (2, 4, 1, 16, torch.float32, torch.float16, 1),  # MQA, written with a cast
])
def test_write_kv_triton_equals_reference(b, tq, kvh, d, new_dtype, pool_dtype, trash_rows):
    from torchspec.runtime.kv_write_triton import write_kv_triton

    dev = "cuda" if CUDA else "cpu"
    k_new, v_new, k_pool, v_pool, slots = (x.to(dev) for x in _kv_case(b, tq, kvh, d, new_dtype, pool_dtype,
                                                                          trash_rows))
    want_k, want_v = k_pool.clone(), v_pool.clone()
    write_kv_reference(k_new, v_new, want_k, want_v, slots)
    write_kv_triton(k_new, v_new, k_pool, v_pool, slots)
    keep = slice(4, None)  # the trash page (slots 0..3): several rows write it, any one may win
    assert torch.equal(k_pool[keep], want_k[keep]) and torch.equal(v_pool[keep], want_v[keep])
    if trash_rows:  # ... but whatever landed there is one of the rows' values
        written = k_pool[:tq].cpu()
        candidates = k_new.transpose(1, 2)[:trash_rows].to(pool_dtype).cpu()  # [rows, Tq, kvh, D]
        assert all(any(torch.equal(written[t], c[t]) for c in candidates) for t in range(tq))


def test_fused_retries_without_its_options_then_runs_eagerly(monkeypatch):
    """A compile failure never fails serving: the region retries with the default options, then runs
    eagerly for good (CUDA inputs stood in for by an object that says it is on CUDA)."""
    from types import SimpleNamespace

    from torchspec.targets import fused_ops

    compiled_with = []

    def fake_compile(fn, *, dynamic, fullgraph, options):
        compiled_with.append(options)

        def run(*args):
            if options.get("combo_kernels") or broken_defaults:
                raise RuntimeError("inductor says no")
            return ("compiled", fn(*args))

        return run

    monkeypatch.setattr(fused_ops.torch, "compile", fake_compile)
    x = SimpleNamespace(is_cuda=True, value=3)
    broken_defaults = False
    region = fused_ops.fused(lambda a: a.value, fused_ops.ONE_LAUNCH)
    assert region(x) == ("compiled", 3) and region(x) == ("compiled", 3)
    assert [o.get("combo_kernels", False) for o in compiled_with] == [True, False]  # twice, not once per call
    assert compiled_with[1] == fused_ops._COMPILE_OPTIONS
    broken_defaults, compiled_with[:] = True, []
    region = fused_ops.fused(lambda a: a.value, fused_ops.ONE_LAUNCH)
    assert region(x) == 3 and region(x) == 3 and len(compiled_with) == 2  # eager from then on
    cpu = SimpleNamespace(is_cuda=False, value=4)
    assert fused_ops.fused(lambda a: a.value)(cpu) == 4 and len(compiled_with) == 2  # CPU: never compiled
