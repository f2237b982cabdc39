"""Verify a draft tree against the target: greedy matching or exact tree rejection sampling.

Both verifiers take the target's outputs at every tree node, ``[B, N, V]``, where node i's row
is the target's next-token distribution after the path root..i, and return a ``VerifyResult``:
the accepted root-to-node path plus the token the target contributes after it (the bonus when
the walk stops at a leaf, the correction otherwise).

**Sampling** (SpecInfer-style multi-candidate speculative sampling). Starting at the root with
p = the target's processed distribution there, the children of the current node are tried in
``sibling_rank`` order, each with the proposal r it was drawn from:

* deterministic candidate c: r = point mass on c, so it is accepted with probability p(c) and
  the residual is p with c removed, renormalised;
* sampled candidate c: r = q_i, the parent's draft distribution with the earlier-ranked sampled
  siblings removed and renormalised (the distribution c was actually drawn from); accepted with
  probability min(1, p(c) / q_i(c)), residual norm(max(p - q_i, 0)) (p itself if that is empty).

On acceptance the walk moves to the child with p = the target's distribution there; when no child
is left the next token is drawn from the current (residual) p. Each step emits exactly p's
distribution for any proposal it was really drawn from, so the output follows the target for any
tree whose shape is fixed independently of the draws.

Everything is vectorised over the batch and needs no host sync: the walk runs a static N - 1
steps (a row with an untried child consumes one node per step), and outputs are padded to a
static depth bound D (``max_depth``, default N - 1) rather than the tree's depth read back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchspec.runtime.sampling import remove_and_renormalise, sample
from torchspec.runtime.tree import DraftTree
from torchspec.targets.fused_ops import fused

PAD = -1  # fill of ``path`` and ``accepted_tokens`` beyond the accepted prefix

# (p [B, V], token [B], sampled [B], q [B, V], u [B]) -> (accept [B] bool, residual [B, V])
CandidateStep = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [B] long; drafted nodes accepted, 0..D
    path: torch.Tensor  # [B, D + 1] long; accepted node indices, path[:, 0] = 0 (root), then PAD
    next_token: torch.Tensor  # [B] long; the target's token after the last accepted node
    accepted_tokens: torch.Tensor  # [B, D] long; tokens of path[:, 1:], PAD beyond num_accepted


def rejection_step(p: torch.Tensor, token: torch.Tensor, sampled: torch.Tensor, q: torch.Tensor,
                   u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One candidate of the walk: accept ``token`` against target p, or return the residual.

    ``q`` is the candidate's draft distribution q_i (used for sampled candidates only; a
    deterministic candidate's proposal is the point mass on its token), ``u`` a Uniform[0, 1)
    draw per row. Unsampled, a point mass is a sampled candidate like any other:
    accept u < p(c) / 1, residual max(p - onehot(c), 0) = p without c.
    """
    point = torch.zeros_like(p).scatter_(-1, token[:, None], 1.0)
    r = torch.where(sampled[:, None], q, point)  # [B, V] the proposal the token was drawn from
    p_tok = p.gather(-1, token[:, None]).squeeze(-1)
    r_tok = r.gather(-1, token[:, None]).squeeze(-1)
    accept = u * r_tok < p_tok  # u < min(1, p / r) without dividing by r
    residual = (p - r).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)
    return accept, residual


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, N, V], idx [B] -> x[b, idx[b]] [B, V]."""
    return x.gather(1, idx[:, None, None].expand(-1, 1, x.shape[-1])).squeeze(1)


def _node_dists(tree: DraftTree, nodes: torch.Tensor, v: int, dtype: torch.dtype) -> torch.Tensor:
    """Draft distribution [B, V] each row's node drafted its children from (zeros if none)."""
    if tree.dists is None:
        return torch.zeros(nodes.shape[0], v, dtype=dtype, device=nodes.device)
    di = tree.dist_index.gather(1, nodes[:, None]).squeeze(1)  # [B]
    q = _gather_rows(tree.dists, di.clamp(min=0)).to(dtype)
    return torch.where((di >= 0)[:, None], q, torch.zeros_like(q))


def _depth_bound(tree: DraftTree, max_depth: int | None) -> int:
    return tree.num_nodes - 1 if max_depth is None else max_depth


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator,
                    max_depth: int | None = None, step: CandidateStep = rejection_step,
                    max_tries: int | None = None) -> VerifyResult:
    """Tree rejection sampling. target_probs [B, N, V]: ``process_logits`` of the target at every node.

    ``max_depth`` (D) sizes the outputs; it must be >= the tree's depth and defaults to N - 1 so
    that no host sync is needed to read the depth. ``step`` is the per-candidate rule (tests swap
    in biased rules to check that the statistical test detects them). ``max_tries`` bounds the
    candidates one row can try in a round (default N - 1; a tree whose nodes at depth d have at
    most w_d children needs only sum_d w_d: 9 instead of 36 for branching (4, 2, 1, 1, 1)).
    """
    b, n, v = target_probs.shape
    dev = target_probs.device
    d = _depth_bound(tree, max_depth)
    big = torch.iinfo(torch.long).max
    # Try order of every drafted node among its siblings: (sibling_rank, node index); big = never.
    key = tree.sibling_rank * n + torch.arange(n, device=dev)
    key = torch.where(tree.valid & (tree.parents >= 0), key, big)  # [B, N]
    key[:, 0] = big
    p = target_probs[:, 0].float()  # [B, V] current (residual) target distribution
    q = _node_dists(tree, torch.zeros(b, dtype=torch.long, device=dev), v, p.dtype)  # [B, V] minus rejected
    cur = torch.zeros(b, dtype=torch.long, device=dev)  # current node
    tried = torch.full((b,), -1, dtype=torch.long, device=dev)  # key of the last rejected child
    num = torch.zeros(b, dtype=torch.long, device=dev)
    path = torch.full((b, d + 2), PAD, dtype=torch.long, device=dev)  # last column: trash
    path[:, 0] = 0
    tries = n - 1 if max_tries is None else min(max_tries, n - 1)
    for _ in range(tries):  # a row with a child left consumes one node per step; one without stays put
        cand = (tree.parents == cur[:, None]) & (key > tried[:, None])  # [B, N]
        child_key, child = torch.where(cand, key, big).min(dim=1)  # [B] next child to try
        live = child_key < big
        token = tree.tokens.gather(1, child[:, None]).squeeze(1)
        smp = tree.sampled.gather(1, child[:, None]).squeeze(1)
        u = torch.rand(b, generator=generator, device=dev)
        accept, residual = step(p, token, smp, q, u)
        acc, rej = live & accept, live & ~accept
        num = num + acc.long()
        path.scatter_(1, torch.where(acc, num.clamp(max=d + 1), d + 1)[:, None], child[:, None])
        p = torch.where(acc[:, None], _gather_rows(target_probs, child).float(),
                        torch.where(rej[:, None], residual, p))
        q = torch.where(acc[:, None], _node_dists(tree, child, v, p.dtype),
                        torch.where((rej & smp)[:, None], remove_and_renormalise(q, token[:, None]), q))
        tried = torch.where(acc, -1, torch.where(rej, child_key, tried))
        cur = torch.where(acc, child, cur)
    return _result(tree, path[:, : d + 1], num, sample(p, generator))


def verify_greedy(tree: DraftTree, target_tokens: torch.Tensor, max_depth: int | None = None) -> VerifyResult:
    """Accept the longest path whose every node's token is the target's argmax at its parent.

    ``target_tokens`` [B, N] long: the target's argmax after each node (`TargetDecoder.argmax`: under
    TP no rank needs the full logits). Among siblings holding the same matching token the first by
    ``sibling_rank`` (then node index) is taken; the next token is the argmax at the last accepted
    node. ``max_depth`` as in ``verify_sampling``. On CUDA the walk is one fused region (~40 index
    ops of a few microseconds each as separate kernels: a tenth of a small target's plain step).
    """
    num, path, next_token, accepted = _greedy_walk(target_tokens, tree.tokens, tree.parents, tree.depths, tree.valid,
                                                   tree.sibling_rank, _depth_bound(tree, max_depth))
    return VerifyResult(num_accepted=num, path=path, next_token=next_token, accepted_tokens=accepted)


@fused
def _greedy_walk(best: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                 valid: torch.Tensor, sibling_rank: torch.Tensor, d: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_greedy` on the tree's tensors -> (num_accepted, path, next_token, accepted_tokens)."""
    b, n = best.shape
    dev = best.device
    parent = parents.clamp(min=0)
    root_col = torch.arange(n, device=dev)[None, :] == 0
    match = valid & (parents >= 0) & (tokens == best.gather(1, parent)) & ~root_col  # [B, N]
    # Among matching siblings keep the one tried first: lowest (sibling_rank, node index).
    order = sibling_rank * n + torch.arange(n, device=dev)
    big = torch.iinfo(torch.long).max
    first = torch.full((b, n), big, dtype=torch.long, device=dev).scatter_reduce(
        1, parent, torch.where(match, order, big), reduce="amin")  # [B, N] per parent
    chosen = match & (order == first.gather(1, parent))
    on_path = root_col.expand(b, n)
    for _ in range(d):  # after i passes every on-path node of depth <= i is flagged
        on_path = root_col | (chosen & on_path.gather(1, parent))
    depth = torch.where(on_path, depths, -1)
    num = depth.max(dim=1).values  # one on-path node per depth
    last = depth.argmax(dim=1)
    path = torch.full((b, d + 2), PAD, dtype=torch.long, device=dev)
    cols = torch.where(on_path, depths.clamp(max=d + 1), d + 1)
    path = path.scatter(1, cols, torch.arange(n, device=dev).expand(b, n).where(on_path, PAD))[:, : d + 1]
    return num, path, best.gather(1, last[:, None]).squeeze(1), _accepted_tokens(tokens, path)


def _accepted_tokens(tokens: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """Tokens [B, D] of path[:, 1:] (the drafted nodes accepted), PAD beyond them."""
    drafted = path[:, 1:]  # [B, D]
    return torch.where(drafted >= 0, tokens.gather(1, drafted.clamp(min=0)), PAD)


def _result(tree: DraftTree, path: torch.Tensor, num: torch.Tensor, next_token: torch.Tensor) -> VerifyResult:
    return VerifyResult(num_accepted=num, path=path, next_token=next_token,
                        accepted_tokens=_accepted_tokens(tree.tokens, path))


__all__ = ["VerifyResult", "CandidateStep", "PAD", "rejection_step", "verify_greedy", "verify_sampling"]
