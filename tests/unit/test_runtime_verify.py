"""Tree verification: greedy against a brute-force reference, and sampling against the EXACT target.

Sampling is tested end to end on synthetic "table LMs": over a 6-token vocabulary, the target's
and the draft's next-token logits are fixed random tables indexed by (position, previous token).
Each of B = 1e5 identical rows drafts a tree from the draft table, verifies it against the target
table with ``verify_sampling`` and continues from the new root until it has 3 tokens; the joint
distribution of those 3 tokens is compared with the product of target-table probabilities by a
chi-square test. Three plausible bugs are the positive controls: the same test at the same size
must reject each of them.
"""

from __future__ import annotations

import pytest
import torch

from tests.stats import chi2_pvalue
from torchspec.runtime.sampling import SamplingParams, process_logits, sample_without_replacement
from torchspec.runtime.tree import DraftTree, chain_tree
from torchspec.runtime.verify import PAD, rejection_step, verify_greedy, verify_sampling

V = 6  # vocabulary
P = 12  # table positions (positions beyond are clamped: they never influence the first 3 tokens)
ROWS = 100_000
OUT = 3  # tokens per row whose joint distribution is tested
PROMPT = 2  # the root token of the first round

Shape = tuple[tuple[str, ...], ...]
# Per depth, the kind of each child slot of every node at the depth above, in sibling_rank order:
# "s" drawn without replacement from the parent's draft distribution, "d" the next of its top tokens.
SHAPES: dict[str, Shape] = {
    "chain": (("s",), ("s",), ("s",)),
    "sampled": (("s", "s"), ("s", "s")),
    "deterministic": (("d", "d"), ("d", "d")),
    "mixed": (("d", "s", "s"), ("s", "d")),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def table_lms(params: SamplingParams, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed (target, draft) next-token tables [P, V, V]: [position, previous token] -> probs.

    The draft is a noisy copy of the target, so acceptance is partial and every branch of the
    verifier (accept, reject, residual, bonus) is exercised.
    """
    g = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(P, V, V, generator=g)
    draft = 0.6 * target + 1.2 * torch.randn(P, V, V, generator=g)
    return process_logits(target, params), process_logits(draft, params)


def build_tree(prev: torch.Tensor, pos: torch.Tensor, shape: Shape, draft: torch.Tensor,
               g: torch.Generator, min_conf: float | None = None) -> DraftTree:
    """Draft a fixed-shape tree per row, root = prev (the token at position pos - 1).

    Levels are laid out breadth first, so node indices are topological and the expanded nodes
    (all but the last level) come first: a node's ``dists`` row is its node index.
    ``min_conf`` is positive control (b): drop sampled children whose own draft probability is
    below it, i.e. choose how many drawn nodes to verify from their confidences.
    """
    b = prev.shape[0]
    zeros = torch.zeros(b, 1, dtype=torch.long)
    tokens, parents, depths, ranks, dists = [prev[:, None]], [zeros - 1], [zeros], [zeros], []
    valid, sampled = [torch.ones(b, 1, dtype=torch.bool)], [torch.zeros(b, 1, dtype=torch.bool)]
    front_tok, front_valid, front_idx, n = prev[:, None], valid[0], zeros, 1
    for d, slots in enumerate(shape, start=1):
        f, k = front_tok.shape[1], len(slots)
        q = draft[(pos + d - 1).clamp(max=P - 1)[:, None], front_tok]  # [B, f, V] for position pos + d - 1
        dists.append(q)
        kinds = torch.tensor([s == "s" for s in slots])
        drawn, ok = sample_without_replacement(q, int(kinds.sum()), g)  # [B, f, ns]
        top = torch.sort(q, dim=-1, descending=True, stable=True).indices[..., : int((~kinds).sum())]
        si, di, tok, okk = 0, 0, [], []
        for s in slots:
            if s == "s":
                tok.append(drawn[..., si])
                okk.append(ok[..., si])
                si += 1
            else:
                tok.append(top[..., di])
                okk.append(torch.ones(b, f, dtype=torch.bool))
                di += 1
        tok, okk = torch.stack(tok, -1), torch.stack(okk, -1) & front_valid[:, :, None]  # [B, f, k]
        if min_conf is not None:
            conf = q.gather(-1, tok)
            okk &= ~kinds | (conf > min_conf)
        tokens.append(tok.reshape(b, f * k))
        valid.append(okk.reshape(b, f * k))
        parents.append(front_idx[:, :, None].expand(b, f, k).reshape(b, f * k))
        depths.append(torch.full((b, f * k), d))
        sampled.append(kinds.repeat(f).expand(b, f * k))
        ranks.append(torch.arange(k).repeat(f).expand(b, f * k))
        front_tok, front_valid = tokens[-1], valid[-1]
        front_idx = n + torch.arange(f * k).expand(b, f * k)
        n += f * k
    dist_rows = torch.cat(dists, 1)  # [B, E, V]
    idx = torch.arange(n).expand(b, n)
    return DraftTree(
        tokens=torch.cat(tokens, 1), parents=torch.cat(parents, 1), depths=torch.cat(depths, 1),
        valid=torch.cat(valid, 1), sampled=torch.cat(sampled, 1), sibling_rank=torch.cat(ranks, 1),
        dist_index=torch.where(idx < dist_rows.shape[1], idx, -1), dists=dist_rows)


def node_target_probs(tree: DraftTree, pos: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B, N, V]: the target's next-token distribution after root..i (position pos + depth)."""
    return target[(pos[:, None] + tree.depths).clamp(max=P - 1), tree.tokens]


def generate(shape: Shape, target: torch.Tensor, draft: torch.Tensor, g: torch.Generator, step=rejection_step,
             min_conf: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rounds from PROMPT until every row has OUT tokens.

    -> (first OUT tokens [ROWS, OUT], drafted tokens accepted per round by rows still generating).
    """
    prev = torch.full((ROWS,), PROMPT)
    pos = torch.zeros(ROWS, dtype=torch.long)
    depth = len(shape)
    out = torch.zeros(ROWS, OUT + depth + 2, dtype=torch.long)  # last column: trash
    accepted = []
    while bool((pos < OUT).any()):
        tree = build_tree(prev, pos, shape, draft, g, min_conf)
        res = verify_sampling(tree, node_target_probs(tree, pos, target), g, max_depth=depth, step=step)
        emitted = torch.cat([res.accepted_tokens, torch.zeros(ROWS, 1, dtype=torch.long)], 1)  # [B, D + 1]
        emitted.scatter_(1, res.num_accepted[:, None], res.next_token[:, None])
        k = torch.arange(depth + 1)
        col = torch.where(k <= res.num_accepted[:, None], pos[:, None] + k, out.shape[1] - 1)
        out.scatter_(1, col.clamp(max=out.shape[1] - 1), emitted)
        accepted.append(res.num_accepted[pos < OUT])
        prev, pos = res.next_token, pos + res.num_accepted + 1
    return out[:, :OUT], torch.cat(accepted)


def exact_joint(target: torch.Tensor) -> torch.Tensor:
    """[V, V, V] probability of the first three tokens under the target table."""
    p0 = target[0, PROMPT].double()
    return p0[:, None, None] * target[1].double()[:, :, None] * target[2].double()[None]


def joint_pvalue(tokens: torch.Tensor, target: torch.Tensor) -> float:
    cells = (tokens[:, 0] * V + tokens[:, 1]) * V + tokens[:, 2]
    return chi2_pvalue(torch.bincount(cells, minlength=V**3), exact_joint(target))


def run_case(shape: str, params: SamplingParams, seed: int, **kw) -> tuple[float, torch.Tensor]:
    """-> (chi-square p-value of the first OUT tokens, accepted drafted tokens per round)."""
    target, draft = table_lms(params)
    toks, accepted = generate(SHAPES[shape], target, draft, torch.Generator().manual_seed(seed), **kw)
    return joint_pvalue(toks, target), accepted


# ---------------------------------------------------------------- sampling: exactness


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_sampling_preserves_the_target_distribution(shape, temperature, top_p):
    pv, accepted = run_case(shape, SamplingParams(temperature=temperature, top_p=top_p), seed=11)
    print(f"{shape} T={temperature} top_p={top_p}: p = {pv:.3g}")
    assert pv > 1e-3
    # the tables exercise every branch: rounds that reject at once and rounds that accept a whole path
    assert (accepted == 0).any() and (accepted == len(SHAPES[shape])).any()


def test_rejection_step_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).expand(4, 4)
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25]]).expand(4, 4)
    token = torch.tensor([1, 1, 0, 3])
    sampled = torch.tensor([False, True, True, True])
    u = torch.tensor([0.29, 0.99, 0.5, 0.0])
    accept, residual = rejection_step(p, token, sampled, q, u)
    # deterministic: u < p(1) = 0.3; sampled: u < p/q = 1.2 (always), 2 (always), 0 (never)
    assert accept.tolist() == [True, True, True, False]
    torch.testing.assert_close(residual[0], torch.tensor([5 / 7, 0, 2 / 7, 0]))  # p without token 1
    torch.testing.assert_close(residual[1], torch.tensor([5 / 6, 1 / 6, 0, 0]))  # norm(max(p - q, 0))
    accept, residual = rejection_step(q, token, sampled, q, torch.full((4,), 0.999))
    assert accept[1:].all()
    torch.testing.assert_close(residual[1:], q[1:])  # p == q leaves no residual mass: fall back to p


# ---------------------------------------------------------------- sampling: positive controls


def step_draft_ratio_for_deterministic(p, token, sampled, q, u):
    """Bug (a): a deterministic candidate accepted with min(1, p/q) as if it had been sampled."""
    _, residual = rejection_step(p, token, sampled, q, u)
    q_tok = q.gather(-1, token[:, None]).squeeze(-1)
    return u * q_tok < p.gather(-1, token[:, None]).squeeze(-1), residual


def step_forget_residual(p, token, sampled, q, u):
    """Bug (c): after a rejected sampled sibling the next sibling is checked against the old p."""
    accept, residual = rejection_step(p, token, sampled, q, u)
    return accept, torch.where(sampled[:, None], p, residual)


CONTROLS = {
    "a_draft_ratio_for_deterministic": ("deterministic", {"step": step_draft_ratio_for_deterministic}),
    "b_confidence_selected_sampled_nodes": ("sampled", {"min_conf": 0.2}),
    "c_forget_residual_after_rejection": ("sampled", {"step": step_forget_residual}),
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_positive_controls_are_rejected(name):
    shape, kw = CONTROLS[name]
    params = SamplingParams(temperature=1.0)
    pv = run_case(shape, params, seed=11, **kw)[0]
    print(f"control {name}: p = {pv:.3g} (correct verifier: {run_case(shape, params, seed=11)[0]:.3g})")
    assert pv < 1e-6


# ---------------------------------------------------------------- greedy


def random_tree(b: int, n: int, vocab: int, seed: int, pad_frac: float = 0.25) -> DraftTree:
    """Random trees with padding nodes anywhere (some pointing at a real parent, as a sampled
    builder leaves them), shuffled sibling ranks, and a small vocabulary so that target matches
    and same-token siblings are common. Every node has a full-support draft distribution."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (b, n), generator=g)
    parents = torch.full((b, n), -1)
    depths = torch.zeros(b, n, dtype=torch.long)
    valid = torch.rand(b, n, generator=g) > pad_frac
    valid[:, 0] = True
    ranks = torch.zeros(b, n, dtype=torch.long)
    for r in range(b):
        real = [0]
        for j in range(1, n):
            par = real[int(torch.randint(len(real), (1,), generator=g))]
            if valid[r, j]:
                parents[r, j], depths[r, j] = par, depths[r, par] + 1
                real.append(j)
            elif torch.rand(1, generator=g) < 0.5:
                parents[r, j] = par  # invalid child of a real node
        for par in range(n):
            kids = (parents[r] == par).nonzero().flatten()
            ranks[r, kids] = torch.randperm(len(kids), generator=g)
    dists = torch.softmax(torch.randn(b, n, vocab, generator=g), -1)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, valid=valid,
                     sampled=torch.rand(b, n, generator=g) < 0.5, sibling_rank=ranks,
                     dist_index=torch.arange(n).expand(b, n).clone(), dists=dists)


def greedy_reference(tree: DraftTree, logits: torch.Tensor, r: int) -> tuple[list[int], int]:
    """Brute force for row r: walk from the root, taking the first child (by sibling_rank, then
    index) among valid children holding the target's argmax."""
    path = [0]
    while True:
        cur = path[-1]
        best = int(logits[r, cur].argmax())
        kids = [j for j in range(1, tree.num_nodes) if tree.valid[r, j] and tree.parents[r, j] == cur]
        hits = sorted((int(tree.sibling_rank[r, j]), j) for j in kids if tree.tokens[r, j] == best)
        if not hits:
            return path, best
        path.append(hits[0][1])


def check_against_reference(res, tree: DraftTree, logits: torch.Tensor, d: int) -> None:
    b = tree.tokens.shape[0]
    assert res.path.shape == (b, d + 1) and res.accepted_tokens.shape == (b, d)
    for r in range(b):
        path, nxt = greedy_reference(tree, logits, r)
        k = len(path) - 1
        assert res.path[r].tolist() == path + [PAD] * (d - k), r
        assert int(res.num_accepted[r]) == k and int(res.next_token[r]) == nxt
        assert res.accepted_tokens[r].tolist() == tree.tokens[r, path[1:]].tolist() + [PAD] * (d - k)


@pytest.mark.parametrize("n, vocab", [(1, 3), (2, 2), (6, 2), (12, 3), (24, 2)])
def test_greedy_accepts_the_longest_argmax_path(n, vocab):
    tree = random_tree(48, n, vocab, seed=n)
    logits = torch.randn(48, n, vocab, generator=torch.Generator().manual_seed(100 + n))
    res = verify_greedy(tree, logits.argmax(-1))
    check_against_reference(res, tree, logits, n - 1)
    if n > 2:
        assert int(res.num_accepted.max()) >= 2  # the random trees do reach depth
    d = int(tree.depths.max())
    check_against_reference(verify_greedy(tree, logits.argmax(-1), max_depth=d), tree, logits, d)


def test_greedy_chain_stops_at_first_mismatch():
    tokens = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3], [5, 0, 2, 3]])
    best = torch.tensor([[1, 2, 3, 4], [1, 0, 3, 4], [1, 2, 3, 4]])  # target argmax at each node
    logits = torch.nn.functional.one_hot(best, 6).float()
    res = verify_greedy(chain_tree(tokens), logits.argmax(-1))
    assert res.num_accepted.tolist() == [3, 1, 0]
    assert res.next_token.tolist() == [4, 0, 1]
    assert res.path.tolist() == [[0, 1, 2, 3], [0, 1, PAD, PAD], [0, PAD, PAD, PAD]]


@pytest.mark.parametrize("n", [6, 12, 24])
def test_sampling_at_temperature_zero_is_greedy(n):
    # One-hot targets: a candidate is accepted iff it is the argmax (p/q >= 1 > u), a rejection
    # leaves the one-hot residual, so any tree, sampled or not, verifies exactly as greedy.
    tree = random_tree(48, n, 3, seed=n)
    logits = torch.randn(48, n, 3, generator=torch.Generator().manual_seed(200 + n))
    probs = process_logits(logits, SamplingParams(temperature=0.0))
    res = verify_sampling(tree, probs, torch.Generator().manual_seed(0))
    check_against_reference(res, tree, logits, n - 1)
