"""Recurrent state of a hybrid (Gated DeltaNet) target in serving: per-slot buffers, tree recurrence, commit.

A GDN layer's history is not a list of keys but two small per-sequence states (``RecurrentMix`` in
``torchspec/attend.py``): the last K - 1 inputs of its causal convolution and the delta rule's
matrix S. They live in one buffer pair per engine, indexed by slot (not paged: prefix caching does
not apply to them)::

    conv [n_linear_layers, slots, C, K - 1]      model dtype, oldest input first
    ssm  [n_linear_layers, slots, H, Dk, Dv]     fp32

The committed state of a slot always covers exactly the tokens in its KV cache (``ctx``). Each
forward gets a ``RecurrentMeta`` (built once, like ``paged_kv.build_attention_meta``) and a
``RecurrentStep`` that implements ``conv`` / ``delta_rule`` for it, in one of three modes:

* **prefill** (``lengths``): right-padded rows, from zero state or, for rows with ``resume`` (a
  chunk of a prompt whose earlier part is committed), from the slot's committed state. The
  convolution runs over the row after its history (zeros or the committed one); the delta rule runs
  chunked (`gdn_ops.delta_rule`, ``initial_state``) with g = 0, beta = 0 on padding, which leaves S
  exactly unchanged there, so the final state is the last real token's. The committed conv history
  is the last K - 1 inputs up to the last real one. Committed at once.
* **decode** (neither): T = 1, one `gdn_ops.delta_rule_step` from the committed state, committed at
  once (rows with ``row_valid = False`` keep theirs).
* **tree** (``parents``, ``depths``): T = N draft-tree nodes in topological order, node 0 the root,
  parent -1 = continues from the committed state. Convolution: an ancestor table, built once per
  forward, lists each node's K inputs in the space [committed history (K - 1), nodes] (oldest first,
  the node itself last), so a node convolves its own path. Recurrence by depth level: at level d
  every node of depth d steps (`delta_rule_step`) from its parent's state (level d - 1) or from the
  committed state (d = 0). Each level is a static number W_d of nodes per row (`tree_level_widths`,
  exact for chains and sampled trees, an upper bound for dynamic trees), so the loop bounds come
  from the spec, never from data. Every node's state is kept (per-node snapshots: the level state
  tensors, and for the convolution the node inputs plus the ancestor table) until ``commit``.

``commit(last_node, row_valid)`` after verification writes the accepted path's last node's states
into the slots; nothing of a rejected node is ever written, and a row that is not valid commits
nothing. No step syncs with the host or branches on data (the round is CUDA-graph captured). A chain
is the tree whose node i has parent i - 1 (W_d = 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import Tensor

from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.sampling import SamplingParams
from torchspec.targets.gdn_ops import causal_conv, delta_rule, delta_rule_step


class RecurrentState:
    """The committed conv / recurrent state of every slot, for the GDN layers ``layer_ids`` (global ids)."""

    def __init__(self, layer_ids: list[int], num_slots: int, conv_channels: int, conv_kernel: int,
                 num_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.layer_index = {int(g): i for i, g in enumerate(layer_ids)}  # global layer id -> buffer index
        self.conv_kernel = conv_kernel
        n = len(layer_ids)
        self.conv = torch.zeros(n, num_slots, conv_channels, conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(n, num_slots, num_heads, key_dim, value_dim, dtype=torch.float32, device=device)

    @classmethod
    def for_target(cls, decoder, num_slots: int, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None) -> RecurrentState | None:
        """Buffers for a hybrid ``TargetDecoder`` (this rank's shard), None for a pure-attention target."""
        shape = decoder.args.recurrent
        if shape is None:
            return None
        w = decoder.embed_tokens.weight
        return cls(list(decoder.linear_layer_ids), num_slots, shape.conv_channels, shape.conv_kernel,
                   shape.num_heads, shape.key_dim, shape.value_dim, dtype or w.dtype, device or w.device)


@dataclass
class TreeSchedule:
    """The static plan of one tree forward (see the module docstring); N nodes, levels 0..D.

    Level slots are laid out level-major, then position j within the level, then row b: flat slot
    ``(offset_d + j) * B + b``, so one gather orders a layer's inputs for every level and each level
    is a contiguous slice. A level position no node fills steps the row's root (never read).
    """

    window: Tensor  # [B, N, K] each node's conv inputs in [history (K-1), nodes] space, oldest first, self last
    depth: Tensor  # [B, N] node depth (clamped to D)
    pos: Tensor  # [B, N] node's position within its level (clamped to W_depth - 1)
    order: Tensor  # [sum W_d * B] flat node index b * N + node of every level slot
    level_parents: list[Tensor]  # per level d >= 1: [W_d * B] the parent's slot within level d - 1's [W_{d-1} * B]
    out_index: Tensor  # [B * N] each node's level slot (its output among the levels' concatenated outputs)
    widths: tuple[int, ...]  # W_0..W_D: nodes per row stepped at each level


@dataclass
class RecurrentMeta:
    """Static-shape description of one forward (shared by all GDN layers)."""

    slots: Tensor  # [B] long: the state slot of each row
    row_valid: Tensor  # [B] bool: False rows commit nothing
    lengths: Tensor | None = None  # prefill: [B] real tokens per (right-padded) row
    resume: Tensor | None = None  # prefill: [B] bool, continue from the committed state (None: all from zero)
    tree: TreeSchedule | None = None  # tree verification

    @property
    def mode(self) -> str:
        return "prefill" if self.lengths is not None else "tree" if self.tree is not None else "decode"


def tree_level_widths(spec: SpecConfig, params: SamplingParams) -> tuple[int, ...]:
    """Static nodes-per-depth bound W_0..W_D of the trees ``draft_round`` builds for ``spec``.

    Sampled trees (and chains): exact, prod(widths[:d]). Dynamic trees keeping m nodes of top-k
    children: depth-d nodes are children of the k frontier nodes of depth d - 1, ancestor-closed,
    and every depth above holds one, so W_d <= min(k W_{d-1}, k^2, m - (d - 1)).
    """
    if spec.sampled(params):
        w = spec.widths(params)
        return tuple(prod(w[:d]) for d in range(len(w) + 1))
    k = 1 if spec.shape == "chain" else spec.topk
    m = spec.num_drafted(params)
    out = [1]
    for d in range(1, spec.depth + 1):
        out.append(max(1, min(k * out[-1], k * k, m - (d - 1))))
    return tuple(out)


def build_recurrent_meta(slots: Tensor, conv_kernel: int, *, row_valid: Tensor | None = None,
                         lengths: Tensor | None = None, resume: Tensor | None = None, parents: Tensor | None = None,
                         depths: Tensor | None = None, level_widths: tuple[int, ...] | None = None) -> RecurrentMeta:
    """The description of one forward: ``lengths`` [B] for a prefill (``resume`` [B]: rows that
    continue from their committed state), ``parents`` / ``depths`` [B, N]
    (topological, -1 = from the committed state) for a tree, neither for a plain decode step.
    ``level_widths`` bounds the nodes per depth (default N - d for d < N: exact for any tree)."""
    valid = torch.ones_like(slots, dtype=torch.bool) if row_valid is None else row_valid
    if parents is None:
        return RecurrentMeta(slots=slots, row_valid=valid, lengths=lengths, resume=resume)
    b, n = parents.shape
    widths = level_widths or tuple(n - d for d in range(n))
    return RecurrentMeta(slots=slots, row_valid=valid, tree=_tree_schedule(parents, depths, conv_kernel, widths))


def _tree_schedule(parents: Tensor, depths: Tensor, k: int, widths: tuple[int, ...]) -> TreeSchedule:
    b, n = parents.shape
    dev = parents.device
    idx = torch.arange(n, device=dev)
    # conv windows: prev[e] = the input before e in [history (K-1), nodes] space
    hist_prev = (torch.arange(k - 1, device=dev) - 1).clamp(min=0).expand(b, k - 1)
    node_prev = torch.where(parents >= 0, parents + k - 1, torch.full_like(parents, k - 2))
    prev = torch.cat([hist_prev, node_prev], 1)  # [B, K - 1 + N]
    cols = [idx.expand(b, n) + k - 1]
    for _ in range(k - 1):
        cols.append(torch.gather(prev, 1, cols[-1]))
    window = torch.stack(cols[::-1], -1)  # [B, N, K] oldest first

    top = len(widths) - 1
    depth = depths.clamp(0, top)
    same = (depth[:, :, None] == depth[:, None, :]) & (idx[None, :] < idx[:, None])[None]
    w_of, offset = _per_level(depth, widths), _per_level(depth, [sum(widths[:d]) for d in range(len(widths))])
    pos = torch.minimum(same.sum(-1), w_of - 1)  # [B, N] rank within the level (by node index)
    rows = torch.arange(b, device=dev)[:, None]
    order, level_parents = [], []
    for d, w in enumerate(widths):
        slot = torch.where(depth == d, pos, w)  # [B, N]; w = trash column
        nodes = torch.zeros(b, w + 1, dtype=torch.long, device=dev).scatter_(1, slot, idx.expand(b, n))[:, :w]
        order.append((rows * n + nodes).T.reshape(-1))  # [W_d * B], (j, b) order
        if d > 0:
            par = torch.gather(parents, 1, nodes).clamp(min=0)  # [B, W_d]
            ppos = torch.gather(pos, 1, par).clamp(max=widths[d - 1] - 1)
            level_parents.append((ppos * b + rows).T.reshape(-1))
    out_index = ((offset + pos) * b + rows).reshape(-1)  # [B * N]
    return TreeSchedule(window=window, depth=depth, pos=pos, order=torch.cat(order), level_parents=level_parents,
                        out_index=out_index, widths=tuple(widths))


def _per_level(depth: Tensor, values: list[int]) -> Tensor:
    """values[depth] elementwise, without a host-to-device copy (graph capture allows none)."""
    out = torch.zeros_like(depth)
    for d, value in enumerate(values):
        out = torch.where(depth == d, value, out)
    return out


class RecurrentStep:
    """The `torchspec.attend.RecurrentMix` of one serving forward over ``state`` (see the module docstring)."""

    def __init__(self, state: RecurrentState, meta: RecurrentMeta):
        self.state, self.meta = state, meta
        self._conv: dict[int, Tensor] = {}  # tree: layer -> [B, K - 1 + N, C] committed history + node inputs
        self._ssm: dict[int, list[Tensor]] = {}  # tree: layer -> per level [B, W_d, H, Dk, Dv] node states

    def _write(self, pool: Tensor, new: Tensor, valid: Tensor | None = None) -> None:
        """pool[slots] = new where the row is valid (its old state elsewhere)."""
        m = self.meta
        keep = (m.row_valid if valid is None else valid).view(-1, *([1] * (new.dim() - 1)))
        pool.index_copy_(0, m.slots, torch.where(keep, new.to(pool.dtype), pool.index_select(0, m.slots)))

    def _initial(self, pool: Tensor, resume: Tensor | None) -> Tensor | None:
        """A prefill's starting state per row: the slot's committed one where ``resume``, else zeros
        (None when no row resumes: whatever the slots held before is never read)."""
        if resume is None:
            return None
        keep = resume.view(-1, *([1] * (pool.dim() - 1)))
        return torch.where(keep, pool.index_select(0, self.meta.slots), 0)

    def conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor:
        """x [B, T, C], weight [C, K] -> SiLU(causal conv over each row's / node's history) [B, T, C]."""
        m, li = self.meta, self.state.layer_index[layer]
        pool = self.state.conv[li]  # [slots, C, K - 1]
        b, t, c = x.shape
        k = weight.shape[-1]
        if m.mode == "prefill":
            start = self._initial(pool, m.resume)  # [B, C, K - 1] or None (zeros)
            if start is None:
                start = x.new_zeros(b, c, k - 1)
            ext = torch.cat([start.transpose(1, 2).to(x.dtype), x], 1)  # [B, K - 1 + T, C]
            j = m.lengths[:, None] + torch.arange(k - 1, device=x.device)  # [B, K - 1] the last K - 1 inputs
            self._write(pool, torch.gather(ext, 1, j[:, :, None].expand(b, k - 1, c)).transpose(1, 2))
            return causal_conv(x, weight, start)
        hist = pool.index_select(0, m.slots)  # [B, C, K - 1]
        if m.mode == "decode":
            self._write(pool, torch.cat([hist[:, :, 1:], x.transpose(1, 2).to(hist.dtype)], 2))
            return causal_conv(x, weight, hist)
        ext = torch.cat([hist.transpose(1, 2), x.to(hist.dtype)], 1)  # [B, K - 1 + N, C]
        self._conv[li] = ext
        win = m.tree.window[:, :, : k - 1].reshape(b, t * (k - 1), 1).expand(-1, -1, c)
        node_hist = torch.gather(ext, 1, win).view(b * t, k - 1, c).transpose(1, 2)  # [B * N, C, K - 1]
        return causal_conv(x.reshape(b * t, 1, c), weight, node_hist).view(b, t, c)

    def delta_rule(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta [B, T, H] -> o [B, T, H, Dv] from each row's state."""
        m, li = self.meta, self.state.layer_index[layer]
        pool = self.state.ssm[li]  # [slots, H, Dk, Dv]
        if m.mode == "prefill":
            real = (torch.arange(q.shape[1], device=q.device)[None] < m.lengths[:, None])[:, :, None]  # [B, T, 1]
            g, beta = torch.where(real, g, 0), torch.where(real, beta, 0)
            o, final = delta_rule(q, k, v, g, beta, initial_state=self._initial(pool, m.resume))
            self._write(pool, final)
            return o
        s0 = pool.index_select(0, m.slots)  # [B, H, Dk, Dv]
        if m.mode == "decode":
            o, s = delta_rule_step(s0, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            self._write(pool, s)
            return o[:, None]
        tree = m.tree
        b, n = q.shape[:2]
        inputs = [x.flatten(0, 1).index_select(0, tree.order) for x in (q, k, v, g, beta)]  # level slots
        states, outs, start = [], [], 0
        for d, w in enumerate(tree.widths):
            level = [x[start * b:(start + w) * b] for x in inputs]  # [W_d * B, ...] a view
            if d == 0:  # from the committed state
                parent = s0 if w == 1 else s0.repeat(w, 1, 1, 1)  # [W_0 * B, H, Dk, Dv]
            else:
                parent = states[-1].index_select(0, tree.level_parents[d - 1])  # [W_d * B, H, Dk, Dv]
            o, s = delta_rule_step(parent, *level)
            states.append(s)
            outs.append(o)
            start += w
        self._ssm[li] = states
        return torch.cat(outs).index_select(0, tree.out_index).view(b, n, *outs[0].shape[1:])

    def commit(self, last_node: Tensor, row_valid: Tensor) -> None:
        """Tree mode: each valid row's slot takes the states after node ``last_node`` [B] (the accepted
        path's end); invalid rows keep theirs. Only that node's snapshot is read."""
        tree = self.meta.tree
        assert tree is not None, "commit is for tree forwards; prefill and decode commit as they run"
        valid = row_valid & self.meta.row_valid
        b = last_node.shape[0]
        rows = torch.arange(b, device=last_node.device)
        depth, pos = tree.depth.gather(1, last_node[:, None])[:, 0], tree.pos.gather(1, last_node[:, None])[:, 0]
        for li, ext in self._conv.items():  # conv state after the node: its window without the oldest input
            idx = tree.window[rows, last_node, 1:]  # [B, K - 1]
            hist = torch.gather(ext, 1, idx[:, :, None].expand(-1, -1, ext.shape[-1]))
            self._write(self.state.conv[li], hist.transpose(1, 2), valid)
        picks = [(pos.clamp(max=w - 1) * b + rows) for w in tree.widths]  # the node's slot in each level
        for li, states in self._ssm.items():
            new = states[0].index_select(0, picks[0])
            for d in range(1, len(states)):
                new = torch.where((depth == d)[:, None, None, None], states[d].index_select(0, picks[d]), new)
            self._write(self.state.ssm[li], new, valid)


class HybridAttend:
    """The serving attend of a hybrid target: ``PagedAttend`` for attention layers, ``RecurrentStep``
    (``conv``, ``delta_rule``, ``commit``) for Gated DeltaNet layers."""

    def __init__(self, paged, recurrent: RecurrentStep):
        self.paged, self.recurrent = paged, recurrent

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.paged(layer, q, k, v)

    def conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor:
        return self.recurrent.conv(layer, x, weight)

    def delta_rule(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        return self.recurrent.delta_rule(layer, q, k, v, g, beta)

    def commit(self, last_node: Tensor, row_valid: Tensor) -> None:
        self.recurrent.commit(last_node, row_valid)


__all__ = ["HybridAttend", "RecurrentMeta", "RecurrentState", "RecurrentStep", "TreeSchedule",
           "build_recurrent_meta", "tree_level_widths"]
