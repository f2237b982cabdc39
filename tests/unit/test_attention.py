"""TTT attention backends (torchspec/models/attention.py): chunked and flex against the eager
reference (values and gradients), the sliding-window property on the real drafter's projections,
the per-block key bound, the registry."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from torchspec.models import attention
from torchspec.models.attention import (
    TTT_ATTENTION,
    select_ttt_attention,
    ttt_attention_chunked,
    ttt_attention_eager,
    ttt_attention_flex,
)
from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter
from torchspec.models.layers import repeat_kv


def random_inputs(t, steps, b=2, h=3, d=8, seed=0, dtype=torch.float32, device="cpu", grad=True):
    g = torch.Generator().manual_seed(seed)

    def make():
        return torch.randn(b, h, t, d, generator=g).to(device, dtype).requires_grad_(grad)

    return make(), [make() for _ in range(steps + 1)], [make() for _ in range(steps + 1)]


def value_and_grads(fn, q, keys, values, scale, window, **kwargs):
    out = fn(q, keys, values, scale, window, **kwargs)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out)
    grads = torch.autograd.grad(out, [q, *keys, *values], cotangent)
    return out, grads


# (T, chunk, window): T not a multiple of C, C dividing T, one block holding everything, window
# None / 1 / inside / equal to C / >= T.
CASES = [(13, 5, w) for w in (None, 1, 3, 5, 12, 13, 40)] + [(8, 4, None), (8, 4, 2), (9, 512, 4)]


@pytest.mark.parametrize("steps", [0, 1, 2, 3])
@pytest.mark.parametrize("t,chunk,window", CASES)
def test_chunked_matches_eager_values_and_grads(t, chunk, window, steps):
    q, keys, values = random_inputs(t, steps, seed=t + steps)
    ref, ref_grads = value_and_grads(ttt_attention_eager, q, keys, values, 0.35, window)
    out, grads = value_and_grads(ttt_attention_chunked, q, keys, values, 0.35, window, chunk_size=chunk)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=f"gradient of input {i}")


@pytest.mark.parametrize("window", [None, 3])
def test_chunked_bf16_close_to_fp32_reference(window):
    q, keys, values = random_inputs(11, 2, dtype=torch.bfloat16, seed=4)
    out, grads = value_and_grads(ttt_attention_chunked, q, keys, values, 0.35, window, chunk_size=4)
    up = [x.detach().float().requires_grad_() for x in (q, *keys, *values)]
    ref, ref_grads = value_and_grads(ttt_attention_eager, up[0], up[1:4], up[4:], 0.35, window)
    assert out.dtype == torch.bfloat16
    for got, want in [(out, ref), *zip(grads, ref_grads)]:
        rel = (got.float() - want).norm() / want.norm()
        assert rel < 1e-2, rel


def test_chunked_blocks_never_see_more_than_window_keys(monkeypatch):
    """Memory bound: each SDPA call gets C rows and at most C + window - 1 + k*C key columns."""
    calls = []
    sdpa = attention.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask, scale):
        calls.append((q.shape[-2], k.shape[-2], tuple(attn_mask.shape)))
        return sdpa(q, k, v, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    t, chunk, window, steps = 50, 8, 5, 3
    q, keys, values = random_inputs(t, steps, grad=False)
    ttt_attention_chunked(q, keys, values, 0.35, window, chunk_size=chunk)
    assert len(calls) == 7  # ceil(50 / 8)
    for rows, cols, mask_shape in calls:
        assert rows <= chunk and cols <= chunk + window - 1 + steps * rows and mask_shape == (rows, cols)
    assert calls[-1][0] == 2  # the remainder block


def test_chunked_autograd_keeps_only_its_inputs():
    """Blocks are recomputed in backward: what autograd saves is the inputs' storage, nothing
    per block (eager saves [T, T] buffers; chunked without recompute, the concatenated keys)."""
    q, keys, values = random_inputs(256, 3, b=1, h=2, d=16)
    saved = {}

    def pack(x):
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        ttt_attention_chunked(q, keys, values, 0.35, 32, chunk_size=32)
    assert sum(saved.values()) <= sum(x.untyped_storage().nbytes() for x in (q, *keys, *values))


def drafter_qkv(t, steps, window_seed=0):
    """q of step ``steps`` and keys/values of steps 0..steps from a tiny real Eagle4Drafter
    (its q/k/v projections, RoPE at position t + j for step j, GQA expansion as in Attention)."""
    torch.manual_seed(window_seed)
    model = Eagle4Drafter(Eagle4Config(vocab_size=37, hidden_size=16, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=4, intermediate_size=24,
                                       aux_layer_ids=[0, 1, 2], target_num_layers=4, rope_theta=100.0))
    attn = model.layer.self_attn
    groups = attn.num_heads // attn.num_kv_heads
    positions = torch.arange(t)[None]
    keys, values = [], []
    with torch.no_grad():
        for j in range(steps + 1):
            cos, sin = model.rotary.cos_sin(positions + j)
            q, k, v = attn.project_qkv(torch.randn(1, t, 16), cos, sin)
            keys.append(repeat_kv(k, groups))
            values.append(repeat_kv(v, groups))
    return q, keys, values, attn.head_dim**-0.5


def flex_cpu(q, keys, values, scale, window):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        return ttt_attention_flex(q, keys, values, scale, window)


WINDOW_BACKENDS = {"eager": ttt_attention_eager,
                   "chunked": lambda *a: ttt_attention_chunked(*a, chunk_size=4),
                   "flex": flex_cpu}


@pytest.mark.parametrize("backend", sorted(WINDOW_BACKENDS))
def test_sliding_window_property_on_drafter_projections(backend):
    fn = WINDOW_BACKENDS[backend]
    t_len, steps, window, t = 14, 2, 4, 10
    q, keys, values, scale = drafter_qkv(t_len, steps)
    base = fn(q, keys, values, scale, window)[..., t, :]

    def out_at_t(step, position):
        k2, v2 = [k.clone() for k in keys], [v.clone() for v in values]
        k2[step][:, :, position] += 3.0 * torch.randn_like(k2[step][:, :, position])
        v2[step][:, :, position] += 3.0 * torch.randn_like(v2[step][:, :, position])
        return fn(q, k2, v2, scale, window)[..., t, :]

    for s in range(0, t - window + 1):  # step-0 keys at s <= t - window: outside the window
        assert torch.equal(out_at_t(0, s), base), f"step-0 key at {s} leaked into query {t}"
    for s in range(t + 1, t_len):  # the future
        assert torch.equal(out_at_t(0, s), base), f"future key at {s} leaked into query {t}"
    for s in range(t - window + 1, t + 1):  # inside the window, t - window + 1 included
        assert not torch.allclose(out_at_t(0, s), base, atol=1e-4), f"step-0 key at {s} ignored"
    for j in range(1, steps + 1):
        assert not torch.allclose(out_at_t(j, t), base, atol=1e-4), f"diagonal of step {j} ignored"
        for s in (t - 1, t + 1, 0):  # other positions of a diagonal step are never attended
            assert torch.equal(out_at_t(j, s), base), f"step-{j} key at {s} leaked into query {t}"


@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_flex_forward_matches_eager_cpu(window):
    q, keys, values = random_inputs(19, 3, grad=False, d=16)
    torch.testing.assert_close(flex_cpu(q, keys, values, 0.25, window),
                               ttt_attention_eager(q, keys, values, 0.25, window), rtol=1e-5, atol=1e-6)


def test_flex_block_mask_is_sparse():
    """Each 128-row query tile visits the 2 step-0 tiles its 128-wide window touches plus one
    diagonal tile per step (not the (k+1) * T / 128 tiles of the whole key layout); full causal
    visits its causal prefix."""
    cpu = torch.device("cpu")
    windowed = attention._ttt_block_mask(512, 3, 128, cpu)
    assert (windowed.kv_num_blocks + windowed.full_kv_num_blocks).flatten().tolist() == [4, 5, 5, 5]
    causal = attention._ttt_block_mask(512, 3, None, cpu)
    assert (causal.kv_num_blocks + causal.full_kv_num_blocks).flatten().tolist() == [4, 5, 6, 7]


def test_registry_and_unknown_backend():
    assert select_ttt_attention("eager") is ttt_attention_eager
    assert select_ttt_attention("chunked") is ttt_attention_chunked
    assert set(TTT_ATTENTION) >= {"eager", "chunked"}
    with pytest.raises(ValueError, match="nope") as err:
        select_ttt_attention("nope")
    assert "chunked" in str(err.value) and "eager" in str(err.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["chunked", "flex"])
def test_cuda_backends_match_eager(backend, dtype):
    """On CUDA (flex compiled): values and grads vs eager on fp32 copies, by relative norm error.
    T = 300 is no multiple of flex's 128-row tiles nor of the 128-row chunks; head_dim 256 is the
    flagship's."""
    fn = select_ttt_attention(backend)
    if backend == "chunked":
        fn = functools.partial(fn, chunk_size=128)
    for t, d, window, steps in [(300, 64, None, 0), (300, 64, 1, 3), (300, 256, 64, 3), (300, 64, 1000, 2)]:
        q, keys, values = random_inputs(t, steps, b=2, h=4, d=d, seed=t + steps, dtype=dtype, device="cuda")
        out, grads = value_and_grads(fn, q, keys, values, d**-0.5, window)
        up = [x.detach().float().requires_grad_() for x in (q, *keys, *values)]
        n = steps + 1
        ref, ref_grads = value_and_grads(ttt_attention_eager, up[0], up[1 : 1 + n], up[1 + n :], d**-0.5, window)
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-3  # fp32 through tf32 tensor cores in flex
        for i, (got, want) in enumerate([(out, ref), *zip(grads, ref_grads)]):
            rel = ((got.float() - want).norm() / want.norm()).item()
            assert rel < tol, (backend, t, d, window, steps, i, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["chunked", "flex"])
def test_cuda_backends_match_eager_with_documents(backend):
    """Packed rows on CUDA (flex compiled, its block mask built from the batch's document ids):
    values and grads vs eager on fp32 copies. Row 0 holds 3 documents (one of length 1), row 1 one
    document and padding (-1)."""
    t, d, steps = 300, 64, 3
    docs = torch.full((2, t), -1, dtype=torch.long, device="cuda")
    docs[0, :130], docs[0, 130:131], docs[0, 131:] = 0, 1, 2
    docs[1, :250] = 0
    fn = select_ttt_attention(backend)
    for window in (None, 64):
        q, keys, values = random_inputs(t, steps, b=2, h=4, d=d, seed=7, dtype=torch.bfloat16, device="cuda")
        out, grads = value_and_grads(fn, q, keys, values, d**-0.5, window, document_ids=docs)
        up = [x.detach().float().requires_grad_() for x in (q, *keys, *values)]
        n = steps + 1
        ref, ref_grads = value_and_grads(ttt_attention_eager, up[0], up[1 : 1 + n], up[1 + n :], d**-0.5, window,
                                         document_ids=docs)
        for i, (got, want) in enumerate([(out, ref), *zip(grads, ref_grads)]):
            rel = ((got.float() - want).norm() / want.norm()).item()
            assert rel < 2e-2, (backend, window, i, rel)


@pytest.mark.parametrize("window", [None, 1, 3])
def test_every_mask_states_the_one_window_rule(window):
    """Training backends (eager, chunked, flex mask) and the serving cache's metadata admit exactly
    the step-0 keys ``torchspec.attend.in_window`` admits (the rule is written once, there)."""
    from torchspec.attend import in_window
    from torchspec.runtime.paged_kv import build_attention_meta

    t = 7
    pos = torch.arange(t)
    rule = in_window(pos[:, None], pos[None, :], window)  # [T query, T key]
    # Training: one-hot values reveal which step-0 keys each query attends (a key's weight > 0).
    q = torch.zeros(1, 1, t, t)
    values = torch.eye(t)[None, None]
    for name, fn in WINDOW_BACKENDS.items():
        out = fn(q, [torch.zeros(1, 1, t, t)], [values], 1.0, window)[0, 0]  # [T, T] attention weights
        assert torch.equal(out > 0, rule), name
    # Serving: T committed keys, each query anchored at its own position (the drafter's step 0).
    meta = build_attention_meta(torch.arange(1, 5)[None], torch.tensor([t]), torch.zeros(1, t, t, dtype=torch.bool),
                                page_size=4, anchor=pos[None], window=window)
    assert torch.equal(meta.mask[0, 0, :, :t], rule)
