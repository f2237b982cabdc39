"""Gated DeltaNet ops (`torchspec.targets.gdn_ops`) in fp32 on CPU: every form of the recurrence agrees.

Oracles: stepping token by token (`delta_rule_step`, the recurrence of `torchspec.attend.RecurrentMix`
written out), transformers' torch fallback for the chunked rule, and ``F.conv1d`` for the conv (how
HF applies the layer's conv1d). Resets at document starts must equal running each document alone,
and carrying the final state / conv history across a split must equal one pass (what serving does).
Tolerances (fp32, values O(1)): 2e-6 between forms of the same recurrence (measured ~3e-7), 1e-6
for the conv (measured ~1e-7). A form that ignored the state, the decay or a reset fails them.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from torchspec.targets import gdn_ops
from torchspec.targets.gdn_ops import causal_conv, delta_rule, delta_rule_chunked, delta_rule_step

ATOL = 2e-6
B, H, DK, DV = 2, 3, 8, 5


def _inputs(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, t, H, DK, generator=g), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(B, t, H, DK, generator=g), dim=-1)
    v = torch.randn(B, t, H, DV, generator=g)
    decay = -torch.rand(B, t, H, generator=g) * 0.3  # exp(g) in (0.74, 1]: the state matters for ~10 tokens
    beta = torch.rand(B, t, H, generator=g)
    state = torch.randn(B, H, DK, DV, generator=g)
    return q, k, v, decay, beta, state


def _stepped(q, k, v, decay, beta, state=None, starts=None):
    """Token by token; a start zeroes the state before its token."""
    s = torch.zeros(B, H, DK, DV) if state is None else state
    out = []
    for t in range(q.shape[1]):
        if starts is not None:
            s = s * (~starts[:, t]).float()[:, None, None, None]
        o, s = delta_rule_step(s, q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t])
        out.append(o)
    return torch.stack(out, dim=1), s


def _diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("t, chunk", [(1, 64), (37, 16), (100, 32), (130, 64)])
def test_chunked_equals_stepping_with_initial_state_and_resets(t, chunk):
    q, k, v, decay, beta, state = _inputs(t)
    starts = torch.rand(B, t, generator=torch.Generator().manual_seed(1)) < 0.05
    starts[1, 0] = True  # a row that starts a document: its initial state is ignored
    if t > 20:
        starts[0, 16] = True  # on a chunk boundary
    want, want_state = _stepped(q, k, v, decay, beta, state, starts)
    got, got_state = delta_rule_chunked(q, k, v, decay, beta, state, starts, chunk_size=chunk)
    assert got.shape == (B, t, H, DV) and got_state.shape == (B, H, DK, DV) and got_state.dtype == torch.float32
    assert _diff(got, want) <= ATOL and _diff(got_state, want_state) <= ATOL
    # positive control: the initial state reaches the outputs of a row without a start at 0
    no_init, _ = delta_rule_chunked(q, k, v, decay, beta, None, starts, chunk_size=chunk)
    assert not torch.allclose(no_init[0, 0], want[0, 0], atol=1e-3)


def test_chunked_equals_transformers_fallback():
    q, k, v, decay, beta, state = _inputs(90, seed=2)
    got, got_state = delta_rule_chunked(q, k, v, decay, beta, state)
    want, want_state = torch_chunk_gated_delta_rule(q * DK**0.5, k, v, decay, beta, initial_state=state,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=False)
    assert _diff(got, want) <= ATOL and _diff(got_state, want_state) <= ATOL


def test_packed_documents_equal_each_document_alone():
    q, k, v, decay, beta, _ = _inputs(50, seed=3)
    bounds = [0, 7, 8, 40, 50]
    starts = torch.zeros(B, 50, dtype=torch.bool)
    starts[:, bounds[:-1]] = True
    got, _ = delta_rule_chunked(q, k, v, decay, beta, starts=starts, chunk_size=16)
    for lo, hi in zip(bounds, bounds[1:]):
        alone, _ = delta_rule_chunked(*(x[:, lo:hi] for x in (q, k, v, decay, beta)), chunk_size=16)
        assert _diff(got[:, lo:hi], alone) <= ATOL
    leaky, _ = delta_rule_chunked(q, k, v, decay, beta, chunk_size=16)  # positive control: no resets
    assert not torch.allclose(leaky[:, 8:12], got[:, 8:12], atol=1e-3)


def test_final_state_continues_a_split_sequence():
    q, k, v, decay, beta, _ = _inputs(70, seed=4)
    whole, whole_state = delta_rule_chunked(q, k, v, decay, beta)
    first, state = delta_rule_chunked(*(x[:, :45] for x in (q, k, v, decay, beta)))
    second, end = delta_rule_chunked(*(x[:, 45:] for x in (q, k, v, decay, beta)), initial_state=state)
    assert _diff(torch.cat((first, second), dim=1), whole) <= ATOL and _diff(end, whole_state) <= ATOL


def test_dispatcher_runs_the_reference_off_cuda(monkeypatch):
    q, k, v, decay, beta, state = _inputs(20, seed=5)
    assert not gdn_ops.uses_fla(q.device)
    got, got_state = delta_rule(q, k, v, decay, beta, state)
    want, want_state = delta_rule_chunked(q, k, v, decay, beta, state)
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    monkeypatch.setattr(gdn_ops, "USE_REFERENCE", True)
    assert not gdn_ops.uses_fla(torch.device("cuda"))


def _conv_inputs(t: int, c: int = 6, kernel: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, t, c, generator=g), torch.randn(c, kernel, generator=g), torch.randn(B, c, kernel - 1, generator=g)


def _conv1d(x, weight):
    """HF's causal_conv1d_fn: depthwise conv1d with K - 1 zero padding, the first T outputs, SiLU."""
    c, kernel = weight.shape
    y = F.conv1d(x.transpose(1, 2), weight[:, None], padding=kernel - 1, groups=c)[..., : x.shape[1]]
    return F.silu(y).transpose(1, 2)


def test_causal_conv_equals_conv1d_and_continues_from_history():
    x, weight, history = _conv_inputs(11)
    assert _diff(causal_conv(x, weight), _conv1d(x, weight)) <= 1e-6
    # history = the K - 1 inputs before x: equal to convolving them in front and dropping their outputs
    want = _conv1d(torch.cat((history.transpose(1, 2), x), dim=1), weight)[:, 3:]
    assert _diff(causal_conv(x, weight, history), want) <= 1e-6
    assert not torch.allclose(causal_conv(x, weight)[:, :3], want[:, :3], atol=1e-3)


def test_causal_conv_resets_at_document_starts():
    x, weight, history = _conv_inputs(12, seed=1)
    bounds = [0, 2, 3, 9, 12]  # documents shorter than the kernel too
    starts = torch.zeros(B, 12, dtype=torch.bool)
    starts[:, bounds[:-1]] = True
    got = causal_conv(x, weight, history, starts)
    for lo, hi in zip(bounds, bounds[1:]):
        assert _diff(got[:, lo:hi], _conv1d(x[:, lo:hi], weight)) <= 1e-6
    # without a start at 0 the history counts; with one, it does not
    starts[:, 0] = False
    assert _diff(causal_conv(x, weight, history, starts)[:, :2],
                 _conv1d(torch.cat((history.transpose(1, 2), x[:, :2]), dim=1), weight)[:, 3:]) <= 1e-6


def _fake_fla(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """fla's contract (varlen: B = 1, one initial / final state per sequence), run by the reference."""
    assert scale == 1.0 and not use_qk_l2norm_in_kernel and output_final_state
    if cu_seqlens is None:
        return delta_rule_chunked(q, k, v, g, beta, initial_state)
    assert q.shape[0] == 1
    outs, finals = [], []
    for n, (lo, hi) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        init = None if initial_state is None else initial_state[n : n + 1]
        o, s = delta_rule_chunked(*(x[:, lo:hi] for x in (q, k, v, g, beta)), init)
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, dim=1), torch.cat(finals)


def test_fla_dispatch_flattens_packed_rows_into_varlen_sequences(monkeypatch):
    """The fla path's plumbing (cu_seqlens, per-row initial and final states), on CPU with a fake fla."""
    monkeypatch.setattr(gdn_ops, "_fla_chunk", lambda: _fake_fla)
    monkeypatch.setattr(gdn_ops, "uses_fla", lambda device: True)
    q, k, v, decay, beta, state = _inputs(40, seed=6)
    starts = torch.zeros(B, 40, dtype=torch.bool)
    starts[0, [5, 30]] = True  # row 0 continues the initial state until 5
    starts[1, [0, 12]] = True  # row 1 starts a document at 0: no initial state
    for init, rows in ((state, starts), (None, starts), (state, None)):
        got, got_state = delta_rule(q, k, v, decay, beta, init, rows)
        want, want_state = delta_rule_chunked(q, k, v, decay, beta, init, rows)
        assert _diff(got, want) <= ATOL and _diff(got_state, want_state) <= ATOL
