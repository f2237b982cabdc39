"""THE parity test of the drafter step: serving (``DrafterRunner`` over a ``PagedKVCache``) equals
the training unroll (``torchspec.train.ttt.unroll_steps``, the loop ``ttt_unroll`` runs).

Training: K TTT steps over a random batch; step d at position t feeds token x_{t+d+1}, RoPE
position t + d and attends step-0 keys in the window of t plus its own diagonal (contract 3).
Serving, the way the runtime runs it: step 0 over the committed prefix x_0..x_{n+1} with
``steps.catch_up_drafter`` (in two forwards, so the second has a committed context), then draft
depths d = 1..K-1 as a chain of draft nodes written by ``drafting._DraftWriter``, each fed the
teacher-forced token x_{n+d+1} and its parent's feedback. At depth d the serving drafter's normed
and feedback states and its target-vocabulary logits must equal the unroll's at TTT step d,
position n (fp32, 1e-5): positions, window anchoring, norms and feedback all meet here.

Positive controls: the same comparison with the serving draft positions shifted by one, or the
serving window widened by one, must FAIL (otherwise the test could not catch those bugs).
"""

from __future__ import annotations

import pytest
import torch

from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter
from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter
from torchspec.runtime.drafter_runner import DrafterRunner
from torchspec.runtime.drafting import DraftInputs, _DraftWriter
from torchspec.runtime.steps import Caches, catch_up_drafter
from torchspec.train.ttt import unroll_steps

V, H, T, K, PAGE = 48, 16, 16, 4, 4
SIZES = dict(vocab_size=V, hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
             intermediate_size=24, aux_layer_ids=[0, 1, 2], target_num_layers=4, rope_theta=100.0)
LAST = torch.tensor([11, 7])  # last committed position n per row (n + K <= T - 1: the chain's tokens exist)
FIRST_CHUNK = 5  # step 0 runs as a prefill of positions 0..4, then a catch-up of 5..n
TOL = 1e-5

CASES = {
    "eagle4_window": ("eagle4", dict(sliding_window=4)),
    "eagle4_window_eager": ("eagle4", dict(sliding_window=4), "eager"),
    "eagle4_window_nope": ("eagle4", dict(sliding_window=3, nope=True)),
    "eagle4_full_causal": ("eagle4", dict(sliding_window=None)),
    "eagle4_moe": ("eagle4", dict(sliding_window=5, moe=True, moe_num_experts=4, moe_top_k=2, moe_shared_expert=True)),
    "eagle4_moe_nope": ("eagle4", dict(sliding_window=4, nope=True, moe=True, moe_num_experts=3, moe_top_k=1,
                                       moe_extra_norm=False)),
    "eagle4_no_post_norms": ("eagle4", dict(sliding_window=4, fc_post_norm=False, norm_output=False,
                                            pre_attn_norm=False, fc_norm=False)),
    "eagle4_efficient_head": ("eagle4", dict(sliding_window=4, lm_head_rank=8, lm_head_topk=6)),
    "eagle3": ("eagle3", dict(draft_vocab_size=24)),
    "eagle3_1": ("eagle3", dict(draft_vocab_size=24, fc_norm=True, norm_output=True)),
}


def build(case: str, seed: int = 0):
    arch, flags, *backend = CASES[case]
    torch.manual_seed(seed)
    if arch == "eagle3":
        model = Eagle3Drafter(Eagle3Config(**SIZES, **flags), attn_backend=(backend or ["chunked"])[0])
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[: flags["draft_vocab_size"]].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        model.set_vocab_mapping(ids - torch.arange(ids.numel()), t2d)  # a pruned, non-trivial mapping
    else:
        model = Eagle4Drafter(Eagle4Config(**SIZES, **flags), attn_backend=(backend or ["chunked"])[0])
    with torch.no_grad():  # non-trivial norm weights and scale, so a skipped or swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() > 1:
                p.mul_(5.0)
        if arch == "eagle4" and flags.get("lm_head_rank"):
            model.lm_head.init_scorer()
    return model.float().eval()


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, T), generator=g)
    aux = [torch.randn(2, T, H, generator=g) for _ in range(3)]
    return ids, aux


@torch.no_grad()
def training(model, ids, aux) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(normed, feedback) [B, T, H] of TTT steps 0..K-1: the training unroll's own step loop."""
    positions = torch.arange(T).expand(ids.shape[0], T)
    return unroll_steps(model, ids, model.fuse_target_states(aux), K, positions)


class PerturbedRunner(DrafterRunner):
    """A serving runner with its window widened and/or its draft positions shifted (the controls)."""

    def __init__(self, model, window_shift: int = 0, position_shift: int = 0):
        super().__init__(model, V)
        self.window_shift, self.position_shift, self.drafting = window_shift, position_shift, False

    @property
    def window(self):
        return None if self.model.window is None else self.model.window + self.window_shift

    def forward(self, tokens, hidden, positions, cache, meta):
        shift = self.position_shift if self.drafting else 0  # a shift of every position is invisible to RoPE
        return super().forward(tokens, hidden, positions + shift, cache, meta)


@torch.no_grad()
def serving(model, ids, aux, window_shift: int = 0, position_shift: int = 0) -> list[tuple]:
    """(normed, feedback, logits) [B, ...] of the serving drafter at depths 0..K-1 after position n = LAST."""
    runner = PerturbedRunner(model, window_shift, position_shift)
    b = ids.shape[0]
    pages = -(-(T + K) // PAGE)
    cache = runner.make_kv_cache(1 + b * pages, PAGE)
    block_table = 1 + torch.arange(b * pages).view(b, pages)  # page 0 is the trash page
    caches, valid = Caches(target=None, drafter=cache, page_size=PAGE), torch.ones(b, dtype=torch.bool)
    # Step 0: position t holds (h_t, x_{t+1}); a prefill of 0..FIRST_CHUNK-1, then a catch-up up to max n.
    end = int(LAST.max()) + 1
    for lo, hi in ((0, FIRST_CHUNK), (FIRST_CHUNK, end)):
        ctx = torch.full((b,), lo)
        last = (LAST - lo).clamp(0, hi - lo - 1)  # rows with a shorter prefix write uncommitted positions
        normed, feedback = catch_up_drafter(runner, caches, block_table, ctx, ids[:, lo + 1:hi + 1],
                                            [a[:, lo:hi] for a in aux], last, valid)
    out = [(normed, feedback, runner.logits(normed))]
    # Depths 1..K-1: a chain of draft nodes rooted after n, written as runtime/drafting.py writes them.
    inp = DraftInputs(root=ids[torch.arange(b), LAST + 1], normed=normed, feedback=feedback, ctx_len=LAST + 1,
                      block_table=block_table, row_valid=valid)
    writer = _DraftWriter(runner, cache, inp, total_slots=K - 1, depth=K)
    runner.drafting = True
    hidden = feedback[:, None]
    for d in range(1, K):
        token = ids[torch.arange(b), LAST + d + 1][:, None]  # teacher forcing: TTT step d at t = n feeds x_{n+d+1}
        parents = None if d == 1 else torch.zeros(b, 1, dtype=torch.long)
        normed, feedback = writer.run(token, hidden, parents, d)
        out.append((normed[:, 0], feedback[:, 0], runner.logits(normed[:, 0])))
        hidden = feedback
    return out


def gap(model, train, serve) -> float:
    """Largest difference between serving at depth d and training at step d, position n (every d)."""
    rows = torch.arange(LAST.numel())
    worst = 0.0
    for (t_normed, t_feedback), (s_normed, s_feedback, s_logits) in zip(train, serve):  # depth d = step d
        t_normed, t_feedback = t_normed[rows, LAST], t_feedback[rows, LAST]
        with torch.no_grad():
            t_logits = model.target_logits(t_normed)
        if not torch.equal(torch.isinf(t_logits), torch.isinf(s_logits)):
            return float("inf")  # an efficient head picked other candidates
        finite = torch.isfinite(t_logits)
        worst = max(worst, float((s_normed - t_normed).abs().max()), float((s_feedback - t_feedback).abs().max()),
                    float((s_logits[finite] - t_logits[finite]).abs().max()))
    return worst


@pytest.mark.parametrize("case", sorted(CASES))
def test_serving_drafter_equals_training_unroll(case):
    model = build(case)
    ids, aux = batch()
    train = training(model, ids, aux)
    assert gap(model, train, serving(model, ids, aux)) < TOL


@pytest.mark.parametrize("case, control", [
    ("eagle4_window", "position"), ("eagle4_window", "window"), ("eagle4_window_nope", "window"),
    ("eagle4_moe", "window"), ("eagle3", "position"),
])
def test_positive_control_a_wrong_position_or_window_fails(case, control):
    """Serving draft positions off by one, or a window one wider, must break the comparison."""
    model = build(case)
    ids, aux = batch()
    train = training(model, ids, aux)
    shifts = {"position": dict(position_shift=1), "window": dict(window_shift=1)}[control]
    assert gap(model, train, serving(model, ids, aux, **shifts)) > 100 * TOL


@pytest.mark.parametrize("case", ["eagle4_window", "eagle4_efficient_head", "eagle3"])
def test_target_logits_are_the_heads_logits_over_the_target_vocabulary(case):
    """Serving logits (``target_logits``) = training logits (``compute_logits``) mapped to target ids:
    the dense head as is, the efficient head exactly at its top-k, EAGLE-3 through d2t; -inf elsewhere."""
    model = build(case)
    normed = torch.randn(3, H)
    with torch.no_grad():
        full, dense = model.target_logits(normed), model.compute_logits(normed).float()
    assert full.shape == (3, V) and full.dtype == torch.float32
    ids = model.draft_vocab_ids()
    if ids is not None:  # EAGLE-3: the draft vocabulary, scattered through d2t
        torch.testing.assert_close(full[:, ids], dense)
        assert torch.isinf(full).sum() == 3 * (V - ids.numel())
    elif CASES[case][1].get("lm_head_rank"):  # efficient head: exactly its top-k are finite
        finite = torch.isfinite(full)
        assert (finite.sum(-1) == model.config.lm_head_topk).all()
        torch.testing.assert_close(full[finite], dense[finite])
    else:
        torch.testing.assert_close(full, dense)
