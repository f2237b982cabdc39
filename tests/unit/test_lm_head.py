"""EAGLE-4 efficient LM head: exact re-scoring, SVD initialisation (optimal rank-r error), recall
counts of the fused loss pass, and that the scorer's distillation trains recall (the fused pass
itself is checked against a per-position reference in test_fused_loss.py)."""

from __future__ import annotations

import pytest
import torch

from torchspec.models.lm_head import EfficientLMHead, randomized_svd
from torchspec.train.loss import TeacherHead, fused_ttt_head_loss


def decaying_matrix(v: int, h: int, seed: int) -> torch.Tensor:
    """[v, h] with singular values 1/(1+i)^0.7: a slowly decaying spectrum like a real LM head."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(v, h, generator=g)).Q
    vh = torch.linalg.qr(torch.randn(h, h, generator=g)).Q
    s = 1.0 / (1.0 + torch.arange(h, dtype=torch.float32)) ** 0.7
    return (u * s) @ vh.T


def head_from(weight: torch.Tensor, rank: int, topk: int, **svd) -> EfficientLMHead:
    head = EfficientLMHead(weight.shape[1], weight.shape[0], rank=rank, topk=topk)
    head.init_from_full(weight, **svd)
    return head


def test_candidate_logits_are_the_full_logits_at_those_ids():
    torch.manual_seed(0)
    head = EfficientLMHead(32, 300, rank=6, topk=17)
    h = torch.randn(3, 5, 32)
    ids, logits = head.candidates(h)
    assert ids.shape == logits.shape == (3, 5, 17)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct ids per token
    full = head.full_logits(h)
    torch.testing.assert_close(logits, full.gather(-1, ids), rtol=1e-6, atol=1e-6)
    # the candidates are the top-k of the low-rank scores, not of the full logits
    scores = head.lowrank_scores(h)
    kth = scores.topk(17, dim=-1).values[..., -1:]
    assert (scores.gather(-1, ids) >= kth).all()
    sparse = head.draft_logits_sparse(h)
    assert torch.isinf(sparse).sum() == 3 * 5 * (300 - 17)
    torch.testing.assert_close(sparse.gather(-1, ids), logits)


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_svd_init_reaches_the_optimal_rank_r_error(method):
    v, h, r = 400, 64, 8
    w = decaying_matrix(v, h, seed=2)
    head = head_from(w, rank=r, topk=4, method=method)
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    best = (u[:, :r] * s[:r]) @ vh[:r]  # Eckart-Young: the optimal rank-r approximation
    optimal_error = float(s[r:].square().sum().sqrt())
    approx = (head.up @ head.down).detach().double()
    error = float(torch.linalg.matrix_norm(w.double() - approx))
    x = torch.randn(50, h, dtype=torch.float64)
    if method == "exact":
        assert error == pytest.approx(optimal_error, rel=1e-5)
        scores = head.lowrank_scores(x.float()).detach().double()
        torch.testing.assert_close(scores, x @ best.T, rtol=0, atol=1e-5)
    else:  # a random sketch with power iterations: within a fraction of a percent of optimal
        assert optimal_error <= error <= 1.005 * optimal_error
    # balanced split: both factors carry S^(1/2)
    torch.testing.assert_close(head.up.norm(), head.down.norm(), rtol=1e-4, atol=0)
    # the tolerances resolve one rank: the best rank r-1 error is 4.5% above the rank-r optimum
    assert float(s[r - 1 :].square().sum().sqrt()) > 1.02 * optimal_error


def test_randomized_svd_is_deterministic_and_keeps_global_rng():
    w = decaying_matrix(120, 30, seed=3)
    state = torch.get_rng_state()
    a, b = randomized_svd(w, 5, seed=7), randomized_svd(w, 5, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    torch.testing.assert_close(a[1], torch.linalg.svdvals(w)[:5], rtol=1e-4, atol=0)


def distill(h, head, w, teacher_logits=None, target_argmax=None, teacher="target"):
    """The scorer's distillation through the fused head loss (one TTT step): h [N, H], w [N].
    Returns (scorer loss, counts as the training metrics sum them)."""
    logits = teacher_logits if teacher_logits is not None else head.full_logits(h).detach()
    t = TeacherHead.from_logits(logits)
    t.argmax = target_argmax
    weight = head.weight.detach()  # the full head's own loss is not under test here
    out = fused_ttt_head_loss(h.detach()[:, None], weight, t, w[:, None], scorer=(head.down, head.up),
                              topk=head.topk, scorer_teacher=teacher, backend="torch")
    main = (out.kl[:, 0] * w).sum()
    valid = w > 0
    t_arg = out.target_argmax
    stats = {"valid": valid.sum(), "full_in_topk": (out.full_in_topk[:, 0] & valid).sum(),
             "target_in_topk": (out.target_in_topk[:, 0] & valid).sum(),
             "correct_in_topk": (out.full_in_topk[:, 0] & (out.argmax[:, 0] == t_arg) & valid).sum()}
    return out.loss - main.detach(), stats


def test_full_rank_scorer_hits_every_argmax():
    w = decaying_matrix(200, 24, seed=1)
    head = head_from(w, rank=24, topk=5)
    h = torch.randn(36, 24)
    full = head.full_logits(h)
    _, stats = distill(h, head, torch.ones(36), target_argmax=full.argmax(-1))
    assert stats["full_in_topk"] == stats["target_in_topk"] == stats["valid"] == 36


def test_recall_counts_on_a_hand_made_example():
    head = EfficientLMHead(hidden_size=2, vocab_size=5, rank=2, topk=2)
    with torch.no_grad():
        head.down.copy_(torch.eye(2))
        head.up.copy_(torch.tensor([[1.0, 0], [0, 1], [-1, 0], [0, -1], [0.5, 0.5]]))
        head.weight.copy_(torch.tensor([[0.0, 0], [0, 0], [0, 5], [0, 0], [1, 1]]))
    h = torch.tensor([[1.0, 0.2], [0.0, 1.0], [-1.0, 0.1], [1.0, 0.2]])
    # low-rank top-2: {0, 4}, {1, 4}, {2, 1}, {0, 4};  full argmax: 4, 2, 2, 4
    # target argmax:   0,      1,      3,      0   ;   the 4th position is masked out
    w = torch.tensor([1.0, 1.0, 1.0, 0.0])
    _, stats = distill(h, head, w, target_argmax=torch.tensor([0, 1, 3, 0]))
    assert (int(stats["valid"]), int(stats["full_in_topk"]), int(stats["target_in_topk"])) == (3, 2, 2)
    assert int(stats["correct_in_topk"]) == 0  # full argmax 4, 2, 2 vs target 0, 1, 3: never right
    # a target that agrees with the full head at the 1st and 3rd positions (both hits) and the 2nd (a miss)
    _, stats3 = distill(h, head, w, target_argmax=torch.tensor([4, 2, 2, 4]))
    assert int(stats3["correct_in_topk"]) == 2


@pytest.mark.parametrize("teacher", ["full", "target"])
def test_distill_steps_increase_heldout_recall(teacher):
    """Drafter states live near a 4-dim subspace; the SVD of W cannot know that, the distillation
    loss learns it: recall on held-out states goes from ~15% to ~95% in 30 steps."""
    torch.manual_seed(5)
    n, hd, v, k = 256, 32, 400, 8
    head = EfficientLMHead(hd, v, rank=4, topk=k)
    with torch.no_grad():
        head.weight.mul_(50.0)
    head.init_scorer()
    basis = torch.randn(4, hd)

    def states():
        return torch.randn(n, 4) @ basis + 0.05 * torch.randn(n, hd)

    h_train, h_test = states(), states()
    weights = torch.full((n,), 1.0 / n)

    def recall():
        with torch.no_grad():
            _, stats = distill(h_test, head, weights)
        return float(stats["full_in_topk"] / stats["valid"])

    before = recall()
    opt = torch.optim.Adam([head.down, head.up], lr=0.02)
    for _ in range(30):
        loss, _ = distill(h_train, head, weights, teacher=teacher)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = recall()
    assert before < 0.3 and after > 0.8, (before, after)


def test_config_errors_name_the_values():
    with pytest.raises(ValueError, match="rank=40"):
        EfficientLMHead(32, 100, rank=40)
    with pytest.raises(ValueError, match="topk=101"):
        EfficientLMHead(32, 100, rank=4, topk=101)
    with pytest.raises(ValueError, match="scorer_teacher='self'"):
        fused_ttt_head_loss(torch.randn(2, 1, 8), torch.randn(20, 8), TeacherHead.from_logits(torch.randn(2, 20)),
                            torch.ones(2, 1), scorer_teacher="self")
