"""The next sampled round's depth under the draft controller, from the criterion on this round's own tree.

A sampled round (T > 0) fixes its depth before its draws (``controlled_drafting``'s module docstring): it
drafts the depth at which the previous sampled round's criterion stopped. That criterion is evaluated here,
after the round, level by level on the tree just drafted -- each node scored by the probability its parent's
processed draft distribution gave it, cumulative along its path, read through the calibration -- with the
same ``controller_policy.decide_after_depth`` a greedy round uses, and no host read.
"""

from __future__ import annotations

import torch

from torchspec.runtime.controller_policy import decide_after_depth, next_sampled_depth
from torchspec.runtime.round_costs import RoundCosts
from torchspec.runtime.tree import DraftTree


def sampled_go_flags(tree: DraftTree, depth: int, costs: RoundCosts, row_valid: torch.Tensor) -> torch.Tensor:
    """The criterion after each of a sampled tree's ``depth`` levels, on the tree just drafted -> go flags
    [depth] (bool, no host read): a node's confidence is the probability its parent's processed draft
    distribution gave its token, cumulative along its path; levels beyond the table's are not evaluated."""
    b, n = tree.tokens.shape
    v = tree.dists.shape[-1]
    parent = tree.parents.clamp(min=0)
    row_of = tree.dist_index.gather(1, parent).clamp(min=0)  # [B, N] the parent's distribution row
    q = tree.dists.reshape(b, -1).gather(1, row_of * v + tree.tokens)  # [B, N]
    drafted = (tree.depths > 0) & tree.valid
    edge = torch.where(drafted, torch.log(q.float()), float("-inf"))
    cum = torch.where(drafted, edge, 0.0)
    for _ in range(depth):  # pointer passes: after k, every node of depth <= k + 1 holds its path's sum
        cum = torch.where(tree.depths > 1, edge + cum.gather(1, parent), cum)
    cum = torch.where(drafted, cum, float("-inf"))
    (alpha, scale), flags = costs.calibration.choice(), []
    cum, edge = cum.double() * alpha, edge.double() * alpha  # the confidence as the calibration reads it
    for level in range(1, min(depth, costs.depth_ms.shape[0]) + 1):
        pool = torch.where(tree.depths <= level, cum, float("-inf"))[:, 1:]  # [B, N - 1] the levels so far
        at = tree.depths[:, 1:] == level
        front = torch.where(at, cum[:, 1:], float("-inf"))
        decision = decide_after_depth(pool, front, torch.where(at, edge[:, 1:], float("-inf")), level - 1,
                                      costs.depth_ms, costs.verify_ms, row_valid, scale)
        flags.append(decision.go)
    return torch.stack(flags)


def next_depth_after_sampled(tree: DraftTree, depth: int, costs: RoundCosts, row_valid: torch.Tensor) -> torch.Tensor:
    """The next sampled round's plan [2] int64 (its depth, 0) from this round's tree (module docstring)."""
    next_depth = next_sampled_depth(sampled_go_flags(tree, depth, costs, row_valid), costs.max_sampled_depth)
    return torch.stack([next_depth, torch.zeros_like(next_depth)])


__all__ = ["next_depth_after_sampled", "sampled_go_flags"]
