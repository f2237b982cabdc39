"""The dynamic draft tree's selection arithmetic as fused regions on CUDA; the same ops eagerly elsewhere.

A greedy tree round of a small target drafted ~140 kernels more than the chain of the same depth
(SmolLM2 at b=1, depth 5 / top-4 / 16 nodes: 373 kernels and 0.74 ms against 233 and 0.48 ms; H200,
``docs/results.md``, ninth session): per depth the candidates' log-softmax and top-k (~12 ops), the
cumulative scores, the frontier's stable sort and its gathers (~16), each node's ancestor mask (3), and
once per round the assembly of the kept nodes (~25). Every op of these is a kernel of a few
microseconds; each group is now one ``fused`` region (``torchspec.targets.fused_ops``):

    log_top          candidates' logits -> the k best log-probabilities and their ids
    expand_frontier  a depth's children -> their cumulative scores, pool entries, the next frontier
    with_ancestors   a depth's nodes -> the draft slots each sees (itself and its ancestors)
    assemble_tree    the round's pool -> the kept nodes as a ``DraftTree``'s tensors

``expand_frontier``, ``with_ancestors`` and ``assemble_tree`` are exact (one fp32 add, sorts, integer
and boolean work): compiled equals eager bit for bit. ``log_top``'s log-sum-exp may round differently
compiled, which can only change which of two near-tied nodes is drafted, never what is emitted
(verification decides that). ``tests/gpu/test_tree_select_gpu.py`` checks both, and the kernel counts.
"""

from __future__ import annotations

import torch

from torchspec.targets.fused_ops import fused


@fused
def log_top(logits: torch.Tensor, k: int, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., C] (of candidates ``ids`` [..., C], or of the whole vocabulary when None) ->
    (log-probabilities [..., k] descending, ids [..., k]) = ``log_softmax(logits).topk(k)``."""
    logits = logits.float()
    top, pos = logits.topk(k, dim=-1)
    chosen = pos if ids is None else torch.gather(ids, -1, pos)
    return top - torch.logsumexp(logits, dim=-1, keepdim=True), chosen


@fused
def expand_frontier(front_sc: torch.Tensor, child_sc: torch.Tensor, child_tok: torch.Tensor,
                    front_idx: torch.Tensor, feedback: torch.Tensor, base: int, last: bool) -> tuple[torch.Tensor, ...]:
    """One depth of the dynamic tree.

    front_sc [B, F] the frontier's cumulative log-probabilities, child_sc / child_tok [B, F, k] each
    frontier node's k best children, front_idx [B, F] the frontier's pool indices, feedback [B, F, H]
    the frontier's drafter feedback, base the pool index of this depth's first child ->
    (cum [B, F*k], tokens [B, F*k], parents [B, F*k]: the children's pool entries), and unless ``last``
    the next frontier, the F best children by cumulative score (stable: ties keep pool order):
    (parent_rows [B, F] into this frontier, pool indices, tokens, scores, feedback [B, F, H])."""
    b, f, k = child_sc.shape
    cum = (front_sc[:, :, None] + child_sc).reshape(b, f * k)
    tok = child_tok.reshape(b, f * k)
    parents = front_idx[:, :, None].expand(b, f, k).reshape(b, f * k)
    if last:
        return cum, tok, parents
    pick = torch.sort(cum, dim=-1, descending=True, stable=True).indices[:, :f]  # [B, F]
    rows = pick // k
    hidden = torch.gather(feedback, 1, rows[:, :, None].expand(b, f, feedback.shape[-1]))
    return cum, tok, parents, rows, base + pick, torch.gather(tok, 1, pick), torch.gather(cum, 1, pick), hidden


@fused
def with_ancestors(anc: torch.Tensor, parent_rows: torch.Tensor | None, start: int, f: int) -> torch.Tensor:
    """The draft slots [B, f, total] that draft slots ``start .. start + f - 1`` see: their own and,
    through ``parent_rows`` [B, f] (rows of ``anc`` [B, F', total], the previous depth's nodes), their
    ancestors' (None: the first depth, no draft ancestors)."""
    b, _, total = anc.shape
    own = (torch.arange(total, device=anc.device)[None, None, :]
           == (start + torch.arange(f, device=anc.device))[None, :, None]).expand(b, f, total)
    if parent_rows is None:
        return own
    return own | torch.gather(anc, 1, parent_rows[:, :, None].expand(b, f, total))


@fused
def assemble_tree(root: torch.Tensor, pool_tok: list[torch.Tensor], pool_sc: list[torch.Tensor],
                  pool_parent: list[torch.Tensor], m: int) -> tuple[torch.Tensor, ...]:
    """The round's pool -> the ``m`` best nodes by cumulative score as a tree.

    root [B]; pool_tok / pool_sc: per depth [B, k] (depth 1) then [B, k*k]; pool_parent: the pool
    parents of depths >= 2 (depth 1's parent is the root). Returns (tokens, parents, depths,
    sibling_rank, score_rank) [B, m + 1], node 0 the root (score_rank: a node's rank by score, 0 the best; the
    root -1). The kept set is ancestor-closed (a stable sort by a
    score that never increases along a path), nodes stay in pool (topological) order."""
    tokens, scores = torch.cat(pool_tok, 1), torch.cat(pool_sc, 1)
    b, total = tokens.shape
    dev = tokens.device
    k = pool_tok[0].shape[1]
    parents = torch.cat([torch.full((b, k), -1, dtype=torch.long, device=dev), *pool_parent], 1)
    idx = torch.arange(total, device=dev)
    depths = torch.where(idx < k, 1, 2 + (idx - k) // (k * k)).expand(b, total)
    keep = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :m]
    keep, score_rank = torch.sort(keep, dim=-1)  # pool order is topological; each kept node's rank by score
    node_of = torch.zeros_like(tokens).scatter(1, keep, torch.arange(1, m + 1, device=dev).expand(b, m))
    kept_parent = torch.gather(parents, 1, keep)
    node_parent = torch.where(kept_parent < 0, 0, torch.gather(node_of, 1, kept_parent.clamp(min=0)))
    all_parents = torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=dev), node_parent], 1)
    earlier = torch.ones(m + 1, m + 1, dtype=torch.bool, device=dev).tril(diagonal=-1)
    rank = ((all_parents[:, :, None] == all_parents[:, None, :]) & earlier).sum(-1)
    return (torch.cat([root[:, None], torch.gather(tokens, 1, keep)], 1), all_parents,
            torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev), torch.gather(depths, 1, keep)], 1), rank,
            torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=dev), score_rank], 1))


__all__ = ["log_top", "expand_frontier", "with_ancestors", "assemble_tree"]
