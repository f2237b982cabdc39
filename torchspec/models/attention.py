"""TTT attention backends with an optional sliding window: one small function each, chosen once.

Every backend computes the attention of TTT step k = len(keys) - 1 (see ``torchspec/train/ttt.py``)
and has the signature ``fn(q, keys, values, scale, window, document_ids=None) -> out``:

    q [B, h, T, D]; keys[j], values[j] [B, h, T, D] for steps j = 0..k (already GQA-expanded);
    window: int >= 1, or None for full causal attention; document_ids: long [B, T] or None;
    returns [B, h, T, D] in q's dtype.

The query of step k at position t attends to

* step-0 keys at positions s inside the sliding window, ``torchspec.attend.in_window(t, s, window)``
  (the one statement of the rule, shared with the serving runtime) and, with ``document_ids``,
  ``document_ids[s] == document_ids[t]``, and
* the keys of steps 1..k at position t itself (the "diagonal"). They are always attended: they are
  the drafter's own guesses for this very position, so they lie inside any window by definition.

Packed rows (sequence packing, ``torchspec/data/packing.py``): several documents share a row and
``document_ids`` numbers them 0, 1, 2, ... (padding -1). The document condition makes each document
attend only to itself, so a packed row computes exactly what its documents would compute in rows of
their own (with positions restarting at 0 per document, which the caller puts into RoPE). Padding
is a document of its own: pad queries see pad keys (at least themselves), so no softmax row is empty.
None means one document per row (the unpacked behaviour, no extra mask work).

Toy example, T = 6, window = 3, step k = 2 (``x``: step-0 key attended, ``1``/``2``: diagonal key of
step 1/2 attended). The window keeps the query's own position and the window - 1 before it:

    query t | step-0 keys s = 0 1 2 3 4 5 | diagonal
       0    |                  x . . . . . |  1 2
       1    |                  x x . . . . |  1 2
       2    |                  x x x . . . |  1 2
       3    |                  . x x x . . |  1 2
       4    |                  . . x x x . |  1 2
       5    |                  . . . x x x |  1 2

window = 1 leaves the own step-0 key plus the diagonal; window >= T equals window None. Positions
are untouched: RoPE (position t + k for step k) is applied by the caller before these functions,
and the window counts positions of the sequence, never TTT steps. **NoPE** means no rotary
embedding at all (the caller passes ``cos=None`` to ``Attention.project_qkv``): nothing changes
here, attention then sees positions only through the causal/window mask.

Backends (registry ``TTT_ATTENTION``, chosen by name with ``select_ttt_attention``):

* ``eager``: the reference. Materialises [T, T] scores plus one column per diagonal step, one fp32
  softmax. Memory O(T^2) per head: tests and short sequences only.
* ``chunked``: query blocks of ``chunk_size`` rows, one ``scaled_dot_product_attention`` call per
  block with a boolean mask; memory O(C * (C + window + k*C)) per block (O(C * (T + k*C)) with
  window None), recomputed in backward, so autograd keeps nothing per block.
  Runs on any device and dtype; the default for CPU and for any GPU without flex attention.
* ``flex``: ``torch.nn.attention.flex_attention`` over the keys of all steps concatenated, with a
  block-sparse mask, so only the window's tiles and one diagonal tile per step are computed. The
  fast path on CUDA (compiled); on CPU it runs uncompiled and forward only (a test of the mask).
* ``auto`` (the default): ``flex`` for CUDA tensors, ``chunked`` for any other device.

``TTTAttend`` wraps a backend into the drafter's attention contract (``torchspec.attend.Attend``):
the drafter's attention module computes q/k/v and RoPE and calls ``attend(layer, q, k, v)``; the
TTT attend appends this step's (k, v) to the unroll's KV list and runs the backend. Serving passes
``torchspec.runtime.paged_kv.PagedAttend`` instead, so one drafter step serves both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torchspec.attend import in_window, softmax_scale
from torchspec.models.layers import repeat_kv

# fn(q, keys, values, scale, window, document_ids=None) -> out (see the module docstring)
TTTAttention = Callable[..., torch.Tensor]


def _check(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], window: int | None,
           document_ids: torch.Tensor | None) -> None:
    assert window is None or window >= 1, f"window must be None or >= 1, got {window}"
    assert len(keys) == len(values) >= 1, (len(keys), len(values))
    assert all(k.shape == q.shape for k in keys) and all(v.shape == q.shape for v in values), "expand GQA first"
    if document_ids is not None:
        b, _, t, _ = q.shape
        assert tuple(document_ids.shape) == (b, t), f"document_ids {tuple(document_ids.shape)} != [B, T] {(b, t)}"


def _same_document(doc_q: torch.Tensor, doc_k: torch.Tensor) -> torch.Tensor:
    """[B, Tq], [B, Tk] document ids -> [B, 1, Tq, Tk] bool: query and key in the same document."""
    return (doc_q[:, :, None] == doc_k[:, None, :])[:, None]


def ttt_attention_eager(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float, window: int | None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: [T, T] causal(+window)(+document) scores, one column per diagonal step, one fp32 softmax.

    With window None this is plain causal attention plus one diagonal column per later step.
    """
    _check(q, keys, values, window, document_ids)
    t = q.shape[-2]
    scores = torch.matmul(q, keys[0].transpose(-1, -2)).float() * scale  # [B, h, T, T]
    pos = torch.arange(t, device=q.device)
    allowed = in_window(pos[:, None], pos[None, :], window)  # [T, T]
    if document_ids is not None:
        allowed = allowed & _same_document(document_ids, document_ids)  # [B, 1, T, T]
    scores = scores.masked_fill(~allowed, float("-inf"))
    diag = [(q * k).sum(-1, keepdim=True).float() * scale for k in keys[1:]]  # k x [B, h, T, 1]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :t], values[0])  # [B, h, T, D]
    for j, v in enumerate(values[1:]):
        out = out + probs[..., t + j : t + j + 1] * v
    return out


def _chunk_attention(
    q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, doc_q: torch.Tensor | None, doc_k: torch.Tensor | None,
    *diag: torch.Tensor, start: int, lo: int, scale: float, window: int | None,
) -> torch.Tensor:
    """Query rows [start, start + c) against step-0 keys [lo, start + c) and their diagonal keys.

    q [B, h, c, D]; k0/v0 [B, h, n0, D] with n0 = start + c - lo; doc_q [B, c] / doc_k [B, n0] the
    document ids of those rows (or both None); diag = (k_1..k_k, v_1..v_k) rows [start, start + c).
    Key columns: the n0 step-0 keys, then c columns per diagonal step.
    """
    c, n0, steps = q.shape[-2], k0.shape[-2], len(diag) // 2
    rows = torch.arange(start, start + c, device=q.device)[:, None]
    cols = torch.arange(lo, lo + n0, device=q.device)[None, :]
    allowed = in_window(rows, cols, window)  # [c, n0]
    if doc_q is not None:
        allowed = allowed & _same_document(doc_q, doc_k)  # [B, 1, c, n0]
    if steps:
        eye = torch.eye(c, dtype=torch.bool, device=q.device).repeat(1, steps)  # [c, k*c]
        allowed = torch.cat([allowed, eye.expand(*allowed.shape[:-1], -1)], dim=-1)
        k0 = torch.cat([k0, *diag[:steps]], dim=2)  # [B, h, n0 + k*c, D]
        v0 = torch.cat([v0, *diag[steps:]], dim=2)
    return F.scaled_dot_product_attention(q, k0, v0, attn_mask=allowed, scale=scale)


def ttt_attention_chunked(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float, window: int | None,
    document_ids: torch.Tensor | None = None, chunk_size: int = 512,
) -> torch.Tensor:
    """Blocks of ``chunk_size`` query rows; per block one SDPA call with a boolean mask.

    A block [start, end) needs only the step-0 keys [max(0, start - window + 1), end) (views, no
    copy) and rows [start, end) of each diagonal step, which are appended as extra key columns with
    a per-row identity mask. So one fused ``scaled_dot_product_attention`` call does the whole
    softmax, step-0 window and diagonal together, in whatever kernel the device has (flash-CPU,
    memory-efficient CUDA with a bias, cuDNN, math), fp32 or bf16, with its own backward. The
    alternative, a hand-written score + log-sum-exp merge, needs the per-block score matrix in
    memory and unfused matmuls; public SDPA returns no LSE, so merging two SDPA calls is no option.

    Memory: a block's mask is [C, n0 + k*C] and its concatenated keys n0 + k*C <= C + window - 1
    + k*C rows. Under autograd each block runs inside ``torch.utils.checkpoint``: only its input
    views are kept and the block (mask, concatenation, attention) is recomputed in backward. Without
    that, autograd would keep every block's concatenated keys/values, O(T * (window + k*C) / C)
    rows, and O(T^2 / C) rows with window None. The price is one extra attention forward per
    backward (about +1/3 of forward + backward time).

    Wasted work: each row computes C + window - 1 step-0 columns for its window and k*C diagonal
    columns for its k useful ones, so smaller blocks waste less on the diagonal (k*C / window) and
    launch more calls; ``flex`` computes one 128-wide diagonal tile per step instead.

    With ``document_ids`` each block's mask gets a batch dimension, [B, 1, C, n0 + k*C] (the
    document condition differs per row); the key range stays the window's, so keys of an earlier
    document inside the window are computed and masked rather than skipped (skipping them would
    need the document starts on the host: a sync per step).
    """
    _check(q, keys, values, window, document_ids)
    t = q.shape[-2]
    recompute = torch.is_grad_enabled() and any(x.requires_grad for x in (q, *keys, *values))
    outs = []
    for start in range(0, t, chunk_size):
        end = min(start + chunk_size, t)
        lo = 0 if window is None else max(0, start - window + 1)
        block = functools.partial(_chunk_attention, start=start, lo=lo, scale=scale, window=window)
        docs = (None, None) if document_ids is None else (document_ids[:, start:end], document_ids[:, lo:end])
        args = (q[:, :, start:end], keys[0][:, :, lo:end], values[0][:, :, lo:end], *docs,
                *(k[:, :, start:end] for k in keys[1:]), *(v[:, :, start:end] for v in values[1:]))
        if recompute:  # nothing random inside: no RNG state to save and restore
            outs.append(checkpoint(block, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            outs.append(block(*args))
    return torch.cat(outs, dim=2)  # [B, h, T, D]


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


def _build_block_mask(t: int, steps: int, window: int | None, device: torch.device,
                      document_ids: torch.Tensor | None):
    """Block mask over keys laid out [step 0 | step 1 | ... | step k], T columns each.

    T and the window enter the mask as 0-d device tensors, not Python ints, so compiled kernels
    are reused across sequence lengths and windows instead of recompiling for each value. With
    ``document_ids`` [B, T] the mask has a batch dimension and depends on the data.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    t_len = torch.tensor(t, device=device)
    win = torch.tensor(t if window is None else window, device=device)  # window >= T == causal

    def mask_mod(b, h, q_idx, kv_idx):
        step = kv_idx // t_len
        pos = kv_idx - step * t_len
        step0 = (step == 0) & in_window(q_idx, pos, win)
        if document_ids is not None:
            step0 = step0 & (document_ids[b, q_idx] == document_ids[b, pos])
        return step0 | ((step > 0) & (pos == q_idx))

    batch = None if document_ids is None else document_ids.shape[0]
    build = _compiled(create_block_mask) if device.type == "cuda" else create_block_mask
    return build(mask_mod, batch, None, t, (steps + 1) * t, device=device)


@functools.lru_cache(maxsize=32)
def _ttt_block_mask(t: int, steps: int, window: int | None, device: torch.device):
    """The data-independent block mask (no documents): built once per (T, k, window, device)."""
    return _build_block_mask(t, steps, window, device, None)


def ttt_attention_flex(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float, window: int | None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """flex_attention over cat(keys of steps 0..k) with a block-sparse TTT mask.

    The diagonal of step j lives in key columns j*T + t; with 128 x 128 tiles each query tile
    computes the step-0 tiles its causal window touches plus one (two where T is not a multiple
    of 128) diagonal tile per step, so the k*T extra columns cost k tiles, not k*T/128. Compiled
    on CUDA (forward and backward); on CPU flex runs uncompiled and has no backward.

    Without documents the block mask is cached per (T, k, window). With ``document_ids`` it depends
    on the batch, so it is built on every call (once per TTT step: the key layout grows with k);
    ``create_block_mask`` evaluates the mask on the [B, T, (k+1) T] grid, compiled on CUDA. In
    exchange, tiles that lie wholly in another document are skipped, not just masked.
    """
    from torch.nn.attention.flex_attention import flex_attention

    _check(q, keys, values, window, document_ids)
    t = q.shape[-2]
    if document_ids is None:
        block_mask = _ttt_block_mask(t, len(keys) - 1, window, q.device)
    else:
        block_mask = _build_block_mask(t, len(keys) - 1, window, q.device, document_ids)
    k_all = torch.cat(keys, dim=2) if len(keys) > 1 else keys[0]  # [B, h, (k+1) T, D]
    v_all = torch.cat(values, dim=2) if len(values) > 1 else values[0]
    attend = _compiled(flex_attention) if q.is_cuda else flex_attention
    return attend(q, k_all, v_all, block_mask=block_mask, scale=scale)


def ttt_attention_auto(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float, window: int | None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``flex`` on CUDA, ``chunked`` elsewhere (flex has no CPU backward): the default backend. The
    drafter is built on the CPU and moved, so the device is known only here."""
    attend = ttt_attention_flex if q.is_cuda else ttt_attention_chunked
    return attend(q, keys, values, scale, window, document_ids)


TTT_ATTENTION: dict[str, TTTAttention] = {
    "auto": ttt_attention_auto,
    "eager": ttt_attention_eager,
    "chunked": ttt_attention_chunked,
    "flex": ttt_attention_flex,
}


def select_ttt_attention(name: str) -> TTTAttention:
    """The backend registered under ``name``; ValueError naming the choices otherwise."""
    if name not in TTT_ATTENTION:
        raise ValueError(f"unknown TTT attention backend {name!r}; choose one of {sorted(TTT_ATTENTION)}")
    return TTT_ATTENTION[name]


class TTTAttend:
    """The ``torchspec.attend.Attend`` of the training unroll: its j-th call is TTT step j.

    ``kv`` holds the (k, v) [B, kv_heads, T, D] of the steps so far (the caller may pass its own
    list); each call appends this step's, expands GQA and runs ``backend`` with ``window`` and
    ``document_ids`` [B, T] (packed rows; None = one document per row). The drafters have one
    decoder layer, so ``layer`` is always 0.
    """

    def __init__(self, backend: TTTAttention, window: int | None, document_ids: torch.Tensor | None = None,
                 kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.backend, self.window, self.document_ids = backend, window, document_ids
        self.kv = [] if kv is None else kv

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert layer == 0, f"TTTAttend serves one-layer drafters, got layer {layer}"
        self.kv.append((k, v))
        groups = q.shape[1] // k.shape[1]
        keys = [repeat_kv(kk, groups) for kk, _ in self.kv]
        values = [repeat_kv(vv, groups) for _, vv in self.kv]
        return self.backend(q, keys, values, softmax_scale(q), self.window, self.document_ids)  # [B, h, T, D]
