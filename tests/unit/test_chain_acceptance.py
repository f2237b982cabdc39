"""The trainer's chain acceptance (``torchspec.train.ttt.chain_rounds``): the greedy chain rounds of depth K
that serving runs over each held-out response, walked from the unroll's per-(position, step) results.

* a hand-built pattern (a plain row with an unscored tail, a packed row of two documents) gives the
  rounds counted by hand: the first round of a response starts after its first token (the prefill's),
  each commits 1 + its leading run of correct drafts, cut at the response's end;
* it equals ``tools/quality_simulated.replay_rounds`` (the walk bench_quality checks round by round
  against the engine) on the same per-position results;
* through the real ``ttt_unroll`` (walk_chains=True): a naive per-round loop over the unroll's own
  argmaxes; a perfect drafter commits K + 1 per round where it fits; an efficient head whose scorer
  never holds the dense argmax commits 1 per round; without walk_chains nothing is read to the host;
* ``StepStats`` reports tokens / rounds as ``chain_acceptance`` (eval), and no chain number in training.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torchspec.train.ttt as ttt_module
from tests.tool_loader import load_tool
from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter
from torchspec.train.loss import TeacherHead
from torchspec.train.step import StepStats
from torchspec.train.ttt import chain_rounds, scored_mask, ttt_unroll, valid_counts

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3


def tiny_drafter(**flags) -> Eagle4Drafter:
    torch.manual_seed(0)
    return Eagle4Drafter(Eagle4Config(vocab_size=37, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=4, intermediate_size=24, aux_layer_ids=[0, 1, 2],
                                      target_num_layers=4, rope_theta=100.0, **flags))


def by_target_position(by_start: torch.Tensor) -> torch.Tensor:
    """[B, T, K] indexed by round start t -> indexed by the target position p = t + k + 1 of step k."""
    out = torch.zeros_like(by_start)
    for k in range(by_start.shape[-1]):
        for p in range(k + 1, by_start.shape[1]):
            out[:, p, k] = by_start[:, p - k - 1, k]
    return out


def test_hand_built_rounds():
    # row 0: one document x_0..x_9, response x_2..x_7 (mask off on x_8, x_9): starts t = 0..5; rounds from t = 1
    # row 1: documents x_0..x_4 (response x_1..x_4: rounds from t = 0) and x_5..x_9 (x_5 is never scored,
    #        response x_7..x_9: rounds from t = 6), packed
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 0, 1, 1, 1]])
    documents = torch.tensor([[0] * 10, [0] * 5 + [1] * 5])
    right = torch.ones(2, 10, K, dtype=torch.bool)  # right[b, t, k]: the draft of step k from start t is correct
    right[0, 1] = torch.tensor([True, False, True])  # run 1: commits 2 -> next round at t = 3
    right[0, 3] = torch.tensor([True, True, False])  # run 2: x_5..x_7, all that is left: commits 3, ends
    right[1, 0] = torch.tensor([False, False, False])  # run 0: commits 1
    right[1, 1] = torch.tensor([False, True, True])  # run 0: commits 1 -> t = 2: run 1, but x_4 is the last: 1
    right[1, 6] = torch.tensor([True, True, True])  # run 2 (x_8, x_9; x_10 does not exist), 2 left: commits 2
    valid = scored_mask(loss_mask, K, documents)
    tokens, rounds = chain_rounds(by_target_position(right) & valid, valid, loss_mask, documents)
    assert tokens.dtype == rounds.dtype == torch.float64
    assert (float(tokens), float(rounds)) == (2 + 3 + 1 + 1 + 1 + 2, 6)
    # positive control: without document ids, row 1's rounds run across the document boundary
    blind = scored_mask(loss_mask, K)
    assert chain_rounds(by_target_position(right) & blind, blind, loss_mask) != (tokens, rounds)


def per_input(correct: torch.Tensor) -> torch.Tensor:
    """[T, K] by target position -> by input position t (step k at p = t + k + 1), as quality_simulated keeps it."""
    out = torch.zeros_like(correct)
    for k in range(correct.shape[1]):
        out[: correct.shape[0] - k - 1, k] = correct[k + 1:, k]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_walk_is_bench_qualitys_replay(seed):
    """One conversation per row: prompt x_0..x_{P-1}, response x_P..x_{E}; replay_rounds walks it as serving
    does (its rounds agree with the engine's on the H200); chain_rounds must give the same rounds."""
    replay_rounds = load_tool("quality_simulated").replay_rounds
    g = torch.Generator().manual_seed(seed)
    t_len, prompts = 40, [3, 7, 12, 20]
    loss_mask = torch.zeros(len(prompts), t_len, dtype=torch.long)
    for i, p in enumerate(prompts):
        loss_mask[i, p:] = 1
    valid = scored_mask(loss_mask, K)
    correct = (torch.rand(len(prompts), t_len, K, generator=g) < 0.75) & valid
    tokens, rounds = chain_rounds(correct, valid, loss_mask)
    replays = [replay_rounds(per_input(correct[i]), p, t_len - p) for i, p in enumerate(prompts)]
    assert (float(tokens), float(rounds)) == (sum(map(sum, replays)), sum(map(len, replays)))


def tiny_batch(seed: int = 1, t_len: int = 9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 37, (2, t_len), generator=g)
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0, 1, 1, 0]]).repeat(1, 2)[:, :t_len]
    aux = [torch.randn(2, t_len, 16, generator=g) * s for s in (1.0, 5.0, 30.0)]
    logits = torch.randn(2, t_len, 37, generator=g) * 3
    return ids, loss_mask, aux, TeacherHead.from_logits(logits)


def unroll(model, batch, monkeypatch=None, force=None):
    """``ttt_unroll`` at K steps; ``force(out) -> out`` rewrites the fused head loss's output, and the
    outputs it saw are returned beside the result."""
    seen = []
    original = ttt_module.fused_ttt_head_loss

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        out = force(out) if force else out
        seen.append(out)
        return out

    if monkeypatch is not None:
        monkeypatch.setattr(ttt_module, "fused_ttt_head_loss", recording)
    ids, loss_mask, aux, teacher = batch
    return ttt_unroll(model, ids, loss_mask, aux, teacher, K, 0.8, valid_counts(loss_mask, K)), seen


def perfect(out, in_topk: bool | None = None):
    """The drafter's argmax is the target's everywhere; an efficient head's top-k holds it or never."""
    n = out.target_argmax.shape[0]
    forced = dataclasses.replace(out, argmax=out.target_argmax[:, None].expand(n, K).clone())
    if in_topk is not None:
        forced = dataclasses.replace(forced, full_in_topk=torch.full((n, K), in_topk))
    return forced


def naive_walk(batch, out, proposes=lambda i, p, k: True, depth: int = K) -> tuple[float, float]:
    """Serving's rounds over every response of the rows (one document per row here): x_P is the prefill's;
    a round at t drafts steps k (predicting x_{t+k+2}) while that token is in the response and right,
    and commits 1 + that run, at most what is left of the response."""
    ids, loss_mask, _, _ = batch
    b, t_len = ids.shape
    argmax, target = out.argmax.view(b, t_len, K), out.target_argmax.view(b, t_len)
    tokens = rounds = 0
    for i in range(b):
        u = 0
        while u < t_len:
            if not loss_mask[i, u]:
                u += 1
                continue
            end = u
            while end + 1 < t_len and loss_mask[i, end + 1]:
                end += 1
            t = u - 1  # x_u = x_P from the prefill; the first round drafts from t = P - 1
            while t + 2 <= end:
                run = 0
                while run < depth and t + run + 2 <= end and argmax[i, t + run + 1, run] == target[i, t + run + 1] \
                        and proposes(i, t + run + 1, run):
                    run += 1
                commit = min(1 + run, end - t - 1)
                tokens, rounds, t = tokens + commit, rounds + 1, t + commit
            u = end + 1
    return float(tokens), float(rounds)


def partly_right(out):
    """About 70% of the drafts made the target's token (a random tiny drafter gets none right)."""
    n = out.target_argmax.shape[0]
    hit = torch.rand(n, K, generator=torch.Generator().manual_seed(0)) < 0.7
    return dataclasses.replace(out, argmax=torch.where(hit, out.target_argmax[:, None], out.argmax))


def unroll_walked(model, batch, monkeypatch, force):
    seen = []
    original = ttt_module.fused_ttt_head_loss

    def recording(*args, **kwargs):
        seen.append(force(original(*args, **kwargs)))
        return seen[-1]

    monkeypatch.setattr(ttt_module, "fused_ttt_head_loss", recording)
    ids, loss_mask, aux, teacher = batch
    return ttt_unroll(model, ids, loss_mask, aux, teacher, K, 0.8, valid_counts(loss_mask, K), walk_chains=True), seen


def test_unroll_walks_serving_rounds_over_its_argmaxes(monkeypatch):
    batch = tiny_batch(t_len=16)
    result, (out,) = unroll_walked(tiny_drafter(), batch, monkeypatch, partly_right)
    assert (float(result.chain_tokens), float(result.chain_rounds)) == naive_walk(batch, out)
    assert 0 < float(result.correct.sum()) < float(result.valid.sum())  # a non-trivial pattern
    plain, _ = unroll(tiny_drafter(), batch)  # training steps: nothing walked, nothing read to the host
    assert float(plain.chain_rounds) == float(plain.chain_tokens) == 0


def test_every_serving_depth_is_walked_over_the_first_d_steps(monkeypatch):
    batch = tiny_batch(t_len=16)
    result, (out,) = unroll_walked(tiny_drafter(), batch, monkeypatch, partly_right)
    tokens, rounds = result.aux["chain_tokens_by_depth"], result.aux["chain_rounds_by_depth"]
    assert tokens.shape == rounds.shape == (K,)
    for d in range(1, K + 1):
        assert (float(tokens[d - 1]), float(rounds[d - 1])) == naive_walk(batch, out, depth=d), d
    assert (float(tokens[-1]), float(rounds[-1])) == (float(result.chain_tokens), float(result.chain_rounds))
    assert float(tokens[0] / rounds[0]) < float(tokens[-1] / rounds[-1])  # depth matters on this pattern
    stats = StepStats()
    stats.add(result, tokens=1)
    stats.all_reduce()
    summary = stats.summary("eval")
    assert summary[f"eval/chain_acceptance_d{K}"] == pytest.approx(summary["eval/chain_acceptance"], rel=1e-12)
    assert summary["eval/chain_acceptance_d1"] == pytest.approx(float(tokens[0] / rounds[0]), rel=1e-12)


def test_a_perfect_drafter_commits_k_plus_one_where_it_fits(monkeypatch):
    batch = tiny_batch()
    result, (out,) = unroll_walked(tiny_drafter(), batch, monkeypatch, perfect)
    # row 0: response x_1..x_8: rounds at t = 0 (4 tokens), t = 4 (x_6..x_8: 3) -> 7 in 2
    # row 1: responses x_3..x_4 (round at t = 2: x_4, 1 token) and x_6..x_7 (t = 5: x_7, 1) -> 2 in 2
    assert (float(result.chain_tokens), float(result.chain_rounds)) == (9, 4)
    assert (float(result.chain_tokens), float(result.chain_rounds)) == naive_walk(batch, out)


@pytest.mark.parametrize("in_topk", [False, True])
def test_an_efficient_head_accepts_only_what_its_candidates_hold(monkeypatch, in_topk):
    model = tiny_drafter(lm_head_rank=8, lm_head_topk=6)
    result, _ = unroll_walked(model, tiny_batch(), monkeypatch, lambda out: perfect(out, in_topk))
    assert float(result.correct.sum()) == float(result.valid.sum())  # the dense argmax is always right
    if in_topk:
        assert (float(result.chain_tokens), float(result.chain_rounds)) == (9, 4)  # as the perfect full head
    else:  # serving drafts another token: every round commits only the target's own token
        assert float(result.chain_tokens) == float(result.chain_rounds) > 0


def test_step_stats_report_the_ratio_of_sums(monkeypatch):
    model, results = tiny_drafter(), []
    for seed in (1, 2):
        results.append(unroll_walked(model, tiny_batch(seed, t_len=16), monkeypatch, partly_right)[0])
        monkeypatch.undo()
    stats = StepStats()
    for r in results:
        stats.add(r, tokens=1)
    stats.all_reduce()
    expected = sum(float(r.chain_tokens) for r in results) / sum(float(r.chain_rounds) for r in results)
    assert stats.summary("eval")["eval/chain_acceptance"] == pytest.approx(expected, rel=1e-12)
    train = StepStats()
    train.add(unroll(model, tiny_batch(1))[0], tokens=1)
    train.all_reduce()
    assert not any(k.startswith("train/chain_acceptance") for k in train.summary("train"))
