"""EAGLE-4 efficient LM head: exact re-scoring, SVD initialisation (optimal rank-r error), the
chunked distillation loss against plain autograd, recall counts, and that the loss trains recall."""

from __future__ import annotations

import pytest
import torch

from torchspec.models.lm_head import EfficientLMHead, lowrank_distill_loss, randomized_svd, topk_recall


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


def test_full_rank_scorer_equals_full_head():
    w = decaying_matrix(200, 24, seed=1)
    head = head_from(w, rank=24, topk=5)
    h = torch.randn(4, 9, 24)
    full = head.full_logits(h)
    torch.testing.assert_close(head.lowrank_scores(h), full, rtol=0, atol=1e-4)
    ids, _ = head.candidates(h)
    assert (ids == full.argmax(-1, keepdim=True)).any(-1).all()
    _, stats = lowrank_distill_loss(h, head, torch.ones(4, 9), target_argmax=full.argmax(-1))
    assert stats["full_in_topk"] == stats["target_in_topk"] == stats["valid"] == 36


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


def reference_distill(h, head, w, teacher_probs=None, tau=1.0):
    s = (h @ head.down.T) @ head.up.T
    logq = torch.log_softmax(s / tau, -1)
    if teacher_probs is None:
        logp = torch.log_softmax((h @ head.weight.T) / tau, -1)
        p = logp.exp()
    else:
        p = teacher_probs
        logp = torch.log(p)
    kl = (p * (logp - logq)).sum(-1)
    return (kl * w).sum(), kl


@pytest.mark.parametrize("teacher", ["full", "target"])
@pytest.mark.parametrize("chunk_elems", [7 * 90, 1 << 20])
def test_chunked_distill_matches_plain_autograd(teacher, chunk_elems):
    g = torch.Generator().manual_seed(4)
    b, n, hd, v = 2, 19, 16, 90
    head = EfficientLMHead(hd, v, rank=5, topk=7)
    with torch.no_grad():
        head.weight.normal_(generator=g).mul_(0.5)
    head.init_scorer()
    h = torch.randn(b, n, hd, generator=g, requires_grad=True)
    w = torch.rand(b, n, generator=g) * (torch.rand(b, n, generator=g) > 0.3)
    probs = torch.softmax(torch.randn(b, n + 3, v, generator=g) * 2, -1)[:, 2:-1] if teacher == "target" else None
    tau = 2.0 if teacher == "full" else 1.0
    with torch.no_grad():  # a target that agrees with the full head about half the time
        agree = torch.rand(b, n, generator=g) < 0.5
        target_argmax = torch.where(agree, head.full_logits(h).argmax(-1), torch.randint(0, v, (b, n), generator=g))

    loss, stats = lowrank_distill_loss(h, head, w, teacher_probs=probs, target_argmax=target_argmax,
                                       tau=tau, chunk_elems=chunk_elems)
    (1.7 * loss).backward()
    assert h.grad is None  # the scorer follows the drafter; no gradient reaches the states
    assert head.weight.grad is None  # nor the full head: it is the main loss's
    got = head.down.grad.clone(), head.up.grad.clone()
    head.zero_grad(set_to_none=True)

    loss_ref, kl_ref = reference_distill(h.detach(), head, w, probs, tau)
    (1.7 * loss_ref).backward()
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(got[0], head.down.grad)
    torch.testing.assert_close(got[1], head.up.grad)
    valid = w > 0
    torch.testing.assert_close(stats["kl_sum"], (kl_ref * valid).sum().detach())

    with torch.no_grad():  # recall against an independent computation of the top-k sets
        top = head.lowrank_scores(h).topk(7, -1).indices
        full_hit = (top == head.full_logits(h).argmax(-1, keepdim=True)).any(-1)
        target_hit = (top == target_argmax[..., None]).any(-1)
    assert stats["valid"] == valid.sum()
    assert stats["full_in_topk"] == (full_hit & valid).sum()
    assert stats["target_in_topk"] == (target_hit & valid).sum()
    correct = full_hit & (head.full_logits(h).argmax(-1) == target_argmax)
    assert stats["correct_in_topk"] == (correct & valid).sum()


def test_recall_counts_on_a_hand_made_example():
    head = EfficientLMHead(hidden_size=2, vocab_size=5, rank=2, topk=2)
    with torch.no_grad():
        head.down.copy_(torch.eye(2))
        head.up.copy_(torch.tensor([[1.0, 0], [0, 1], [-1, 0], [0, -1], [0.5, 0.5]]))
        head.weight.copy_(torch.tensor([[0.0, 0], [0, 0], [0, 5], [0, 0], [1, 1]]))
    h = torch.tensor([[[1.0, 0.2], [0.0, 1.0], [-1.0, 0.1], [1.0, 0.2]]])
    # low-rank top-2: {0, 4}, {1, 4}, {2, 1}, {0, 4};  full argmax: 4, 2, 2, 4
    # target argmax:   0,      1,      3,      0   ;   the 4th position is masked out
    target_argmax = torch.tensor([[0, 1, 3, 0]])
    w = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    _, stats = lowrank_distill_loss(h, head, w, target_argmax=target_argmax)
    assert (int(stats["valid"]), int(stats["full_in_topk"]), int(stats["target_in_topk"])) == (3, 2, 2)
    assert int(stats["correct_in_topk"]) == 0  # full argmax 4, 2, 2 vs target 0, 1, 3: never right
    # the same counts when the full argmax comes from the main loss and the teacher is the target
    probs = torch.nn.functional.one_hot(target_argmax, 5).float() * 0.9 + 0.02
    _, stats2 = lowrank_distill_loss(h, head, w, teacher_probs=probs, full_argmax=torch.tensor([[4, 2, 2, 4]]),
                                     target_argmax=target_argmax)
    assert (int(stats2["full_in_topk"]), int(stats2["target_in_topk"])) == (2, 2)
    # a target that agrees with the full head at the 1st and 3rd positions (both hits) and the 2nd (a miss)
    _, stats3 = lowrank_distill_loss(h, head, w, target_argmax=torch.tensor([[4, 2, 2, 4]]))
    assert int(stats3["correct_in_topk"]) == 2
    ratios = topk_recall(stats3)
    assert [float(ratios[k]) for k in ("recall_full", "recall_target", "acc_efficient_lb")] == pytest.approx([2 / 3] * 3)


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
        return torch.randn(1, n, 4) @ basis + 0.05 * torch.randn(1, n, hd)

    h_train, h_test = states(), states()
    with torch.no_grad():
        full_train, full_test = head.full_logits(h_train), head.full_logits(h_test)
    probs = torch.softmax(full_train, -1) if teacher == "target" else None
    weights = torch.full((1, n), 1.0 / n)

    def recall():
        with torch.no_grad():
            _, stats = lowrank_distill_loss(h_test, head, weights, teacher_probs=torch.softmax(full_test, -1),
                                            full_argmax=full_test.argmax(-1))
        return float(stats["full_in_topk"] / stats["valid"])

    before = recall()
    opt = torch.optim.Adam([head.down, head.up], lr=0.02)
    for _ in range(30):
        loss, _ = lowrank_distill_loss(h_train, head, weights, teacher_probs=probs)
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
    head = EfficientLMHead(8, 20, rank=2, topk=3)
    with pytest.raises(ValueError, match="tau=2.0"):
        lowrank_distill_loss(torch.randn(1, 2, 8), head, torch.ones(1, 2),
                             teacher_probs=torch.full((1, 2, 20), 0.05), tau=2.0)
