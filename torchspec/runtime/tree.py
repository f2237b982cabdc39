"""The draft tree of one speculation round, batched and padded to a static node count.

Node 0 of every row is the **root**: the last committed token (sampled by the target in the
previous round, not yet in the target's KV cache). Nodes 1..N-1 are drafted tokens, stored in
topological order (a parent's index is smaller than its children's). A chain is the tree whose
node i has parent i - 1.

Each drafted node records how it was proposed, which decides how it is verified at T > 0:

* ``sampled[b, i] = False``: a **deterministic** candidate (e.g. the top-k of the draft
  distribution). It is verified with the point-mass rule: accept with probability p(token);
  on rejection the residual is p with that token removed, renormalised.
* ``sampled[b, i] = True``: the token was **drawn** from its parent's processed draft distribution
  ``dists[b, dist_index[b, parent]]`` without replacement after its earlier-ranked sampled siblings.
  It is verified with that actual distribution q_i (q with earlier siblings removed,
  renormalised): accept with min(1, p/q_i), residual norm(max(p - q_i, 0)).

Siblings are tried in ``sibling_rank`` order (draw order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchspec.targets.fused_ops import fused


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] long; node 0 = root
    parents: torch.Tensor  # [B, N] long; parent node index, -1 for the root and for padding nodes
    depths: torch.Tensor  # [B, N] long; root 0
    valid: torch.Tensor  # [B, N] bool; padding nodes False (never attended, never accepted)
    sampled: torch.Tensor  # [B, N] bool; see module docstring
    sibling_rank: torch.Tensor  # [B, N] long; order among the node's siblings (0 = tried first)
    dist_index: torch.Tensor  # [B, N] long; row of ``dists`` holding the node's own draft distribution, -1 if none
    dists: torch.Tensor | None = None  # [B, E, V] processed draft distributions of expanded nodes
    score_rank: torch.Tensor | None = None  # [B, N] long; a drafted node's rank by path score (0 best; root -1)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def attention_mask(self, max_depth: int | None = None) -> torch.Tensor:
        """[B, N, N] bool: node i attends node j iff j is i or an ancestor of i (padding: self only)."""
        return tree_attention_mask(self.parents, max_depth)


@fused
def tree_attention_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """parents [B, N] (topological, -1 = none) -> ancestors-or-self mask [B, N, N].

    Pointer doubling: after i rounds every node knows its ancestors up to 2^i levels up, so
    ceil(log2(depth + 1)) rounds suffice (``max_depth`` bounds the depth; default N - 1). One fused
    region on CUDA."""
    b, n = parents.shape
    dev = parents.device
    idx = torch.arange(n, device=dev)
    eye = (idx[:, None] == idx[None, :]).expand(b, n, n)
    hop = torch.where(parents >= 0, parents, idx.expand(b, n))  # [B, N] parent (self for roots/padding)
    mask = eye | (idx[None, None, :] == hop[:, :, None])  # self and parent
    reach = 1
    depth = n - 1 if max_depth is None else max_depth
    while reach < depth:
        hop2 = torch.gather(hop, 1, hop)  # 2^i-th ancestor -> 2^(i+1)-th
        mask = mask | torch.gather(mask, 1, hop[:, :, None].expand(b, n, n))  # add my ancestor's ancestors
        hop = hop2
        reach *= 2
    return mask


def chain_tree(tokens: torch.Tensor, sampled: bool = False, dists: torch.Tensor | None = None) -> DraftTree:
    """A chain: root tokens[:, 0] followed by drafted tokens[:, 1:] (node i's parent is i - 1).

    If ``sampled``, node i (i >= 1) was drawn from ``dists[:, i - 1]`` (the distribution drafted at
    node i - 1), so node i - 1 has ``dist_index = i - 1``.
    """
    b, n = tokens.shape
    dev = tokens.device
    idx = torch.arange(n, device=dev).expand(b, n)
    parents = idx - 1
    dist_index = torch.where(idx < n - 1, idx, torch.full_like(idx, -1)) if sampled else torch.full_like(idx, -1)
    return DraftTree(
        tokens=tokens, parents=parents, depths=idx.clone(), valid=torch.ones(b, n, dtype=torch.bool, device=dev),
        sampled=torch.full((b, n), sampled, device=dev) & (idx > 0), sibling_rank=torch.zeros_like(idx),
        dist_index=dist_index, dists=dists)
