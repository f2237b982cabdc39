"""Drafting one round: a dynamic tree (EAGLE-2), a chain, or a sampled tree of fixed shape.

All shapes are static per round (every row drafts the same node count), so a round is a fixed
sequence of drafter forwards that can be CUDA-graph captured.

**Dynamic tree** (greedy, or T > 0 with deterministic candidates): the depth-1 candidates are the
top-k of the root's draft distribution; each later depth runs the drafter on the current
frontier (k nodes), takes the top-k children of each, and keeps the k best of the k*k by
cumulative log-probability as the next frontier. After ``depth`` levels the ``num_nodes`` best
nodes of everything proposed are kept (stable sort by cumulative score: scores never increase
along a path and ties keep pool order, so the kept set is ancestor-closed). A **chain** is the
same with k = 1. Candidates are deterministic (verified with the point-mass rule at T > 0). The
greedy chain runs without scores (``draft_greedy_chain``: it keeps every node it drafts).

**Sampled tree** (T > 0): every node of depth d - 1 draws ``branching[d-1]`` children without
replacement from its processed draft distribution; the shape is fixed before any draw (choosing
nodes by their sampled confidences would bias the output -- tests/unit/test_runtime_verify.py
has that positive control). A sampled chain is branching (1, 1, ..., 1).

**Mixed rounds.** The rows of a round may carry different settings (``sampling.RowSampling``). A
round whose rows are all greedy drafts the dynamic tree as above; a round with any sampled row
(``params.greedy`` False) drafts the sampled tree for every row (or the dynamic tree with
deterministic candidates, ``candidates='deterministic'``). A greedy row's processed distribution is
the point mass on the draft argmax, so each of its nodes gets one valid child (the others are
``valid = False`` padding): a greedy chain, verified against the target's point mass, still lossless.

Drafter cache layout within a round: draft nodes of depth d are written after the committed
prefix in processing order (slot ctx + sum of earlier frontier sizes + i), each attends its
draft ancestors and itself, and the committed prefix through the drafter's window anchored at
n = ctx - 1 (``torchspec/runtime/drafter_runner.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from torchspec.runtime.drafter_runner import DrafterRunner
from torchspec.runtime.paged_kv import TRASH_PAGE, AttentionMeta, PagedKVCache, slots_for_positions
from torchspec.runtime.sampling import RowSampling, SamplingParams, process_logits, sample_without_replacement
from torchspec.runtime.tree import DraftTree, chain_tree
from torchspec.runtime.tree_select import assemble_tree, expand_frontier, with_ancestors

SHAPES = ("tree", "chain")
CANDIDATES = ("auto", "sampled", "deterministic")


@dataclass(frozen=True)
class SpecConfig:
    """How a round drafts. ``shape='chain'`` drafts ``depth`` tokens; ``'tree'`` a dynamic tree of
    ``num_nodes`` nodes (greedy / deterministic) or a sampled tree of ``branching`` (T > 0)."""

    shape: str = "tree"
    depth: int = 5
    topk: int = 8
    num_nodes: int = 32
    candidates: str = "auto"  # auto: greedy -> deterministic, T > 0 -> sampled
    branching: tuple[int, ...] = (4, 2, 1, 1, 1, 1, 1, 1)

    def validate(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"spec shape={self.shape!r} must be one of {SHAPES}.")
        if self.candidates not in CANDIDATES:
            raise ValueError(f"spec candidates={self.candidates!r} must be one of {CANDIDATES}.")
        if not 1 <= self.depth <= 32:
            raise ValueError(f"spec depth={self.depth} must lie in [1, 32].")
        if self.shape == "tree":
            if self.topk < 1:
                raise ValueError(f"spec topk={self.topk} must be >= 1.")
            most = self.proposed()
            if not 1 <= self.num_nodes <= most:
                raise ValueError(f"spec num_nodes={self.num_nodes} must lie in [1, {most}] "
                                 f"(topk + (depth - 1) * topk^2 nodes are proposed).")
            if len(self.branching) < self.depth or any(b < 1 for b in self.branching):
                raise ValueError(f"spec branching={self.branching} needs {self.depth} entries >= 1 (one per depth).")

    def proposed(self, depth: int | None = None) -> int:
        """Nodes the dynamic tree (a chain: k = 1) proposes after ``depth`` of its depths (default all of them)."""
        k = 1 if self.shape == "chain" else self.topk
        return k + ((self.depth if depth is None else depth) - 1) * k * k

    def sampled(self, params: SamplingParams | RowSampling) -> bool:
        return not params.greedy and self.candidates != "deterministic"

    def widths(self, params: SamplingParams | RowSampling) -> tuple[int, ...]:
        """Children per expanded node at each depth (sampled) -- the static shape of the round."""
        if self.shape == "chain":
            return (1,) * self.depth
        return tuple(self.branching[: self.depth])

    def num_drafted(self, params: SamplingParams | RowSampling) -> int:
        """Drafted nodes per round (the verify forward sees 1 + this many tokens)."""
        if self.sampled(params):
            total, level = 0, 1
            for w in self.widths(params):
                level *= w
                total += level
            return total
        return self.depth if self.shape == "chain" else self.num_nodes

    def max_tries(self, params: SamplingParams | RowSampling) -> int:
        """Most candidates one row can try when verifying a round (bounds verify_sampling's loop)."""
        if self.sampled(params):
            return sum(self.widths(params))
        k = 1 if self.shape == "chain" else self.topk
        return min(self.depth * k, self.num_drafted(params))

    def draft_slots(self, params: SamplingParams | RowSampling) -> int:
        """Drafter cache slots a round writes beyond the committed prefix."""
        if self.sampled(params):
            total, level = 0, 1
            for w in self.widths(params)[:-1]:
                level *= w
                total += level
            return total
        k = 1 if self.shape == "chain" else self.topk
        return (self.depth - 1) * k


@dataclass
class DraftInputs:
    """Per-row state a round starts from (rows = the active batch)."""

    root: torch.Tensor  # [B] last committed token (the target's previous bonus)
    normed: torch.Tensor  # [B, H] drafter output at the last committed position (predicts depth 1)
    feedback: torch.Tensor  # [B, H] its feedback hidden
    ctx_len: torch.Tensor  # [B] committed drafter positions (= the target's KV length)
    block_table: torch.Tensor  # [B, P]
    row_valid: torch.Tensor  # [B] bool


def _top(runner: DrafterRunner, normed: torch.Tensor, k: int, params: SamplingParams | RowSampling
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best candidates (log-probability descending, ids) of each frontier node: of the raw
    draft distribution for greedy rounds (no vocabulary-wide op, ``DrafterRunner.top_candidates``),
    of the processed one (T, top-p/k) otherwise."""
    if params.greedy:
        return runner.top_candidates(normed, k)
    return torch.log(process_logits(runner.logits(normed), params)).topk(k, dim=-1)


class _DraftWriter:
    """Runs the drafter on successive frontiers, tracking each frontier node's draft ancestors.

    The cache slots of every draft node of the round are looked up once (``slots``, [B, total]);
    each depth takes the next ``f`` of them, so a depth adds no block-table arithmetic; every depth's
    RoPE positions are built once too. A depth's ancestor mask is one fused region on CUDA
    (``tree_select.with_ancestors``)."""

    def __init__(self, runner: DrafterRunner, cache: PagedKVCache, inputs: DraftInputs, total_slots: int,
                 depth: int):
        self.runner, self.cache, self.inp = runner, cache, inputs
        b = inputs.root.shape[0]
        dev = inputs.root.device
        self.anc = torch.zeros(b, 0, total_slots, dtype=torch.bool, device=dev)
        self.written = 0
        self.total = total_slots
        slots = slots_for_positions(inputs.block_table, inputs.ctx_len[:, None] + torch.arange(total_slots, device=dev),
                                    cache.page_size)
        self.slots = torch.where(inputs.row_valid[:, None], slots, torch.full_like(slots, TRASH_PAGE * cache.page_size))
        self.anchor = inputs.ctx_len - 1  # n: the last committed position
        self.positions = self.anchor[:, None] + torch.arange(depth, device=dev)  # [B, depth]: depth d at n + d

    def run(self, tokens: torch.Tensor, hidden: torch.Tensor, parent_rows: torch.Tensor | None,
            depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft nodes tokens [B, F] at ``depth`` (hidden [B, F, H]; parent_rows [B, F] index the
        previous frontier, None at depth 1) -> (normed, feedback) [B, F, H]."""
        b, f = tokens.shape
        self.anc = with_ancestors(self.anc, parent_rows, self.written, f)  # each node: its slot + its ancestors'
        return self.forward(tokens, hidden, self.anc, self.positions[:, depth:depth + 1].expand(b, f))

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, own: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter on the next ``f`` draft slots: ``own`` [B, F, total] the draft slots each node
        sees (ancestors and itself), ``positions`` [B, F] its RoPE positions."""
        b, f = tokens.shape
        width = self.written + f
        meta = AttentionMeta(write_slots=self.slots[:, self.written:width], block_table=self.inp.block_table,
                             ctx_len=self.inp.ctx_len, anchor=self.anchor[:, None].expand(b, f),
                             tree_mask=own[:, :, :width], page_size=self.cache.page_size, window=self.runner.window)
        out = self.runner.forward(tokens, hidden, positions, self.cache, meta)
        self.written = width
        return out


@dataclass
class TreePool:
    """A dynamic tree as it grows (``grow_dynamic_tree``): every node drafted so far, per depth (``tok`` /
    ``sc``: [B, k] then [B, k*k]; ``parent``: pool parents of depths >= 2), and the frontier the next depth
    would expand (its cumulative scores ``front_sc`` [B, k]; None after the last depth)."""

    tok: list[torch.Tensor]
    sc: list[torch.Tensor]
    parent: list[torch.Tensor]
    front_sc: torch.Tensor | None
    _edges: torch.Tensor | None = None  # [B, k] the frontier's own last-edge scores (depth 0: its scores)
    _children: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (child scores [B, k*k], frontier pool ids, base)

    def front_edge(self) -> torch.Tensor:
        """[B, k] the log-probability of each frontier node's last edge (gathered only when asked: the fixed
        tree never needs it)."""
        if self._children is not None:
            child_sc, front_idx, base = self._children
            return torch.gather(child_sc, 1, front_idx - base)
        return self._edges

    def tree(self, root: torch.Tensor, m: int) -> DraftTree:
        """The ``m`` best nodes by cumulative score as the round's tree (``tree_select.assemble_tree``); m = 0:
        the root alone (a plain step's verification). A chain's pool (k = 1) is in depth order and its
        scores never increase along it, so its m best are its first m: ``chain_tree`` of them, without the
        sorts and gathers (the same tree: ``tests/unit/test_runtime_chain_draft.py``)."""
        if m == 0 or self.tok[0].shape[1] == 1:
            return chain_tree(torch.cat([root[:, None], *self.tok], 1)[:, :m + 1])
        b, dev = root.shape[0], root.device
        tokens, parents, depths, rank, score_rank = assemble_tree(root, self.tok, self.sc, self.parent, m)
        return DraftTree(tokens=tokens, parents=parents, depths=depths, score_rank=score_rank,
                         valid=torch.ones(b, m + 1, dtype=torch.bool, device=dev),
                         sampled=torch.zeros(b, m + 1, dtype=torch.bool, device=dev), sibling_rank=rank,
                         dist_index=torch.full((b, m + 1), -1, dtype=torch.long, device=dev))


def pool_steps(topk: int) -> tuple[int, int]:
    """(first, step): the nodes ``grow_dynamic_tree``'s pool holds after depth 1 and adds each later depth -- k,
    then all k * k children of its k-node frontier (a chain, k = 1: one a depth)."""
    return topk, topk * topk


def grow_dynamic_tree(runner: DrafterRunner, cache: PagedKVCache, inp: DraftInputs, spec: SpecConfig,
                      params: SamplingParams | RowSampling, frontier_at_last: bool = False) -> Iterator[TreePool]:
    """The greedy / deterministic-candidate tree (a chain when spec.shape == 'chain'), yielded after each of its
    ``spec.depth`` depths; a caller that stops iterating drafts no further depth (the draft controller).
    ``frontier_at_last``: the last depth's pool keeps a frontier too (``front_sc`` / ``front_edge``: what one
    more depth would expand), for a controller that weighs a depth this round does not draft. A greedy chain
    grows through ``grow_scored_chain`` (the same pools without the frontier's sorts and gathers), anything else
    through ``grow_topk_tree``."""
    if spec.shape == "chain" and params.greedy:
        return grow_scored_chain(runner, cache, inp, spec, frontier_at_last)
    return grow_topk_tree(runner, cache, inp, spec, params, frontier_at_last)


def grow_topk_tree(runner: DrafterRunner, cache: PagedKVCache, inp: DraftInputs, spec: SpecConfig,
                   params: SamplingParams | RowSampling, frontier_at_last: bool = False) -> Iterator[TreePool]:
    """``grow_dynamic_tree`` for any k (k = 1 for a chain): each depth expands the k-node frontier's top-k
    children and keeps the k best as the next frontier (module docstring)."""
    k = 1 if spec.shape == "chain" else spec.topk
    depth = spec.depth
    b = inp.root.shape[0]
    dev = inp.root.device
    writer = _DraftWriter(runner, cache, inp, max(1, (depth - 1) * k), depth)
    sc, tok = _top(runner, inp.normed, k, params)  # [B, k], sorted
    pool = TreePool(tok=[tok], sc=[sc], parent=[], front_sc=sc if depth > 1 or frontier_at_last else None, _edges=sc)
    front_idx, front_tok = torch.arange(k, device=dev).expand(b, k), tok
    front_hidden = inp.feedback[:, None].expand(b, k, -1)
    parent_rows = None
    base = k
    yield pool
    for d in range(1, depth):
        normed, feedback = writer.run(front_tok, front_hidden, parent_rows, d)
        csc, ctok = _top(runner, normed, k, params)  # [B, k, k]
        last = d == depth - 1
        out = expand_frontier(pool.front_sc, csc, ctok, front_idx, feedback, base, last and not frontier_at_last)
        pool.sc.append(out[0]), pool.tok.append(out[1]), pool.parent.append(out[2])
        if last and not frontier_at_last:
            pool.front_sc = None
        else:
            parent_rows, front_idx, front_tok, pool.front_sc, front_hidden = out[3:]
            pool._children = (csc.reshape(b, k * k), front_idx, base)  # views: no kernel unless front_edge is asked
        base += k * k
        yield pool


def grow_scored_chain(runner: DrafterRunner, cache: PagedKVCache, inp: DraftInputs, spec: SpecConfig,
                      frontier_at_last: bool = False) -> Iterator[TreePool]:
    """``grow_dynamic_tree``'s pools for a greedy chain (k = 1), walked as the scoreless chain walks
    (``_walk_chain``): each depth takes its one best candidate with its log-probability and adds it to the
    path's score. A one-node frontier needs no sort, gather or ancestor mask (the draft controller's chain
    rounds; the same pools and drafter cache as the k = 1 tree, ``tests/unit/test_runtime_chain_draft.py``)."""
    depth, b = spec.depth, inp.root.shape[0]
    pool, parents = None, None
    scored = _walk_chain(runner, cache, inp, depth, lambda n: [t.reshape(b, 1) for t in runner.top_candidates(n, 1)])
    for d, (edge, tok) in enumerate(scored):  # [B, 1] each: depth d + 1's log-probability and token
        keep = d < depth - 1 or frontier_at_last  # a frontier one more depth would expand
        if pool is None:
            pool = TreePool(tok=[tok], sc=[edge], parent=[], front_sc=edge if keep else None, _edges=edge)
        else:
            if parents is None:  # depth d + 1's pool parent is node d - 1
                parents = torch.arange(depth - 1, device=tok.device).expand(b, depth - 1)
            cum = pool.sc[-1] + edge
            pool.sc.append(cum), pool.tok.append(tok), pool.parent.append(parents[:, d - 1: d])
            pool.front_sc, pool._edges = (cum, edge) if keep else (None, None)
        yield pool


def draft_dynamic_tree(runner: DrafterRunner, cache: PagedKVCache, inp: DraftInputs, spec: SpecConfig,
                       params: SamplingParams | RowSampling) -> DraftTree:
    """Greedy / deterministic-candidate tree (a chain when spec.shape == 'chain'): every depth, then the
    ``num_nodes`` best nodes."""
    *_, pool = grow_dynamic_tree(runner, cache, inp, spec, params)  # every depth
    return pool.tree(inp.root, spec.num_drafted(params))


def draft_greedy_chain(runner: DrafterRunner, cache: PagedKVCache, inp: DraftInputs, spec: SpecConfig) -> DraftTree:
    """The greedy chain: ``draft_dynamic_tree`` with k = 1 without its scores. That tree keeps all
    ``depth`` nodes it proposes, in pool order, so no cumulative score, sort or gather decides
    anything: each depth takes the draft argmax (``DrafterRunner.best_candidate``) and feeds its own
    feedback on (``_walk_chain``). Same tree and drafter cache (``tests/unit/test_runtime_chain_draft.py``),
    ~15 fewer kernels a depth."""
    b = inp.root.shape[0]
    walk = _walk_chain(runner, cache, inp, spec.depth, lambda n: [runner.best_candidate(n).reshape(b, 1)])
    return chain_tree(torch.cat([inp.root[:, None], *(tok for (tok,) in walk)], 1))


def _walk_chain(runner: DrafterRunner, cache: PagedKVCache, inp: DraftInputs, depth: int,
                pick: Callable[[torch.Tensor], list[torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
    """A chain's ``depth`` depths: ``pick`` (the drafter's output at a node -> [..., token [B, 1]]) chooses each
    depth's node from its parent's output, and each node feeds its own feedback on. Yields ``pick``'s result a
    depth; the next depth's drafter forward runs only when asked. Every depth's attention mask (slot i, depth
    i + 1, sees slots 0..i) and positions are built once, before the second depth."""
    b = inp.root.shape[0]
    total = max(1, depth - 1)
    writer = _DraftWriter(runner, cache, inp, total, depth)
    picked = pick(inp.normed)  # depth 1, from the last committed position
    yield picked
    if depth == 1:
        return
    hidden = inp.feedback[:, None]
    sees = torch.ones(total, total, dtype=torch.bool, device=inp.root.device).tril()
    for d in range(1, depth):
        own = sees[None, d - 1: d].expand(b, 1, total)
        normed, hidden = writer.forward(picked[-1], hidden, own, writer.positions[:, d: d + 1])
        picked = pick(normed)
        yield picked


def draft_sampled_tree(runner: DrafterRunner, cache: PagedKVCache, inp: DraftInputs, spec: SpecConfig,
                       params: SamplingParams | RowSampling, generator: torch.Generator) -> DraftTree:
    """T > 0: every node of depth d - 1 draws widths[d-1] children without replacement."""
    widths = spec.widths(params)
    b = inp.root.shape[0]
    dev = inp.root.device
    writer = _DraftWriter(runner, cache, inp, max(1, spec.draft_slots(params)), spec.depth)
    q = process_logits(runner.logits(inp.normed), params)[:, None]  # [B, 1, V] root's distribution
    dists = [q]
    tokens = [inp.root[:, None]]
    parents = [torch.full((b, 1), -1, dtype=torch.long, device=dev)]
    depths = [torch.zeros(b, 1, dtype=torch.long, device=dev)]
    ranks = [torch.zeros(b, 1, dtype=torch.long, device=dev)]
    valid = [torch.ones(b, 1, dtype=torch.bool, device=dev)]
    dist_index = [torch.zeros(b, 1, dtype=torch.long, device=dev)]
    front_nodes = torch.zeros(b, 1, dtype=torch.long, device=dev)  # node index of the expanded nodes
    front_valid = valid[0]
    front_hidden = inp.feedback[:, None]
    n_nodes, n_dists = 1, 1
    for d, w in enumerate(widths, start=1):
        f = front_nodes.shape[1]
        ids, ok = sample_without_replacement(q, w, generator)  # [B, f, w], draw order
        child_valid = (ok & front_valid[:, :, None]).reshape(b, f * w)
        child_tok = ids.reshape(b, f * w)
        tokens.append(child_tok)
        parents.append(front_nodes[:, :, None].expand(b, f, w).reshape(b, f * w))
        depths.append(torch.full((b, f * w), d, dtype=torch.long, device=dev))
        ranks.append(torch.arange(w, device=dev).repeat(f).expand(b, f * w))
        valid.append(child_valid)
        child_nodes = n_nodes + torch.arange(f * w, device=dev).expand(b, f * w)
        n_nodes += f * w
        if d == len(widths):
            dist_index.append(torch.full((b, f * w), -1, dtype=torch.long, device=dev))
            break
        dist_index.append(n_dists + torch.arange(f * w, device=dev).expand(b, f * w))
        n_dists += f * w
        parent_rows = None if d == 1 else torch.arange(f, device=dev).repeat_interleave(w).expand(b, f * w)
        hidden = front_hidden.repeat_interleave(w, dim=1)
        normed, feedback = writer.run(child_tok, hidden, parent_rows, d)
        q = process_logits(runner.logits(normed), params)  # [B, f*w, V]
        dists.append(q)
        front_nodes, front_valid, front_hidden = child_nodes, child_valid, feedback
    return DraftTree(
        tokens=torch.cat(tokens, 1), parents=torch.cat(parents, 1), depths=torch.cat(depths, 1),
        valid=torch.cat(valid, 1), sampled=torch.cat(depths, 1) > 0, sibling_rank=torch.cat(ranks, 1),
        dist_index=torch.cat(dist_index, 1), dists=torch.cat(dists, 1))


def draft_round(runner: DrafterRunner, cache: PagedKVCache, inp: DraftInputs, spec: SpecConfig,
                params: SamplingParams | RowSampling, generator: torch.Generator) -> DraftTree:
    if spec.sampled(params):
        return draft_sampled_tree(runner, cache, inp, spec, params, generator)
    if spec.shape == "chain" and params.greedy:
        return draft_greedy_chain(runner, cache, inp, spec)
    return draft_dynamic_tree(runner, cache, inp, spec, params)


__all__ = ["SpecConfig", "DraftInputs", "TreePool", "draft_round", "draft_dynamic_tree", "grow_dynamic_tree",
           "grow_scored_chain", "grow_topk_tree", "draft_greedy_chain", "draft_sampled_tree"]
