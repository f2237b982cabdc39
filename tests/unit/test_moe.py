"""MoEMLP: dense equivalence, hand-set routing, aux loss, gradients of unused experts, loads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchspec.models.layers import SwiGLU
from torchspec.models.moe import MoEMLP, load_imbalance
from torchspec.targets.layers import RMSNorm

DISPATCHES = ["dense", "sorted"]


def expert_out(moe: MoEMLP, e: int, x: torch.Tensor) -> torch.Tensor:
    """Reference: expert e as a plain SwiGLU on x [..., H]."""
    i = moe.down.shape[1]
    gu = moe.gate_up[e]
    return (F.silu(x @ gu[:, :i]) * (x @ gu[:, i:])) @ moe.down[e]


def hand_routed(logits: torch.Tensor, intermediate: int = 8, **kwargs) -> tuple[MoEMLP, torch.Tensor]:
    """MoE whose router gives token n exactly ``logits[n]``: x_n is the n-th basis vector of R^N
    (H = N) and column n of the router weight is ``logits[n]``. Returns (moe, x [1, N, H])."""
    n, e = logits.shape
    torch.manual_seed(0)
    moe = MoEMLP(n, intermediate, e, **kwargs)
    with torch.no_grad():
        moe.router.weight.copy_(logits.t())
    return moe, torch.eye(n)[None]


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_one_expert_equals_dense_swiglu(dispatch):
    torch.manual_seed(0)
    mlp = SwiGLU(16, 32)
    moe = MoEMLP.from_dense(mlp, num_experts=1, top_k=1, dispatch=dispatch)
    x = torch.randn(2, 5, 16)
    out, stats = moe(x)
    ref = mlp(x)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    assert stats.expert_load.tolist() == [10.0]
    assert stats.aux_loss.item() == pytest.approx(1.0)

    (out * ref.detach()).sum().backward()
    (ref * ref.detach()).sum().backward()
    i = 32
    torch.testing.assert_close(moe.gate_up.grad[0, :, :i], mlp.gate_proj.weight.grad.t(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(moe.gate_up.grad[0, :, i:], mlp.up_proj.weight.grad.t(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(moe.down.grad[0], mlp.down_proj.weight.grad.t(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_upcycled_copies_equal_dense(dispatch):
    """Every expert a copy of the dense MLP and renormalised weights: still the dense MLP."""
    torch.manual_seed(0)
    mlp = SwiGLU(16, 32)
    moe = MoEMLP.from_dense(mlp, num_experts=4, top_k=2, dispatch=dispatch)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(moe(x)[0], mlp(x), atol=1e-5, rtol=1e-5)


def test_extra_norm_normalises_the_output():
    torch.manual_seed(0)
    mlp = SwiGLU(16, 32)
    moe = MoEMLP.from_dense(mlp, num_experts=1, top_k=1, extra_norm=True)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(moe(x)[0], RMSNorm(16)(mlp(x)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dispatch", DISPATCHES)
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_topk_routing_picks_the_hand_set_experts(dispatch, norm_topk_prob):
    logits = torch.tensor([
        [3.0, 1.0, 0.0, -1.0],   # top-2: experts 0, 1
        [0.0, 0.0, 5.0, 2.0],    # top-2: experts 2, 3
        [-2.0, 4.0, 0.0, 3.5],   # top-2: experts 1, 3
        [1.0, -1.0, 0.5, 0.0],   # top-2: experts 0, 2
        [0.0, 2.0, 2.5, 0.0],    # top-2: experts 2, 1
    ])
    expected_experts = [[0, 1], [2, 3], [1, 3], [0, 2], [2, 1]]
    moe, x = hand_routed(logits, top_k=2, dispatch=dispatch, norm_topk_prob=norm_topk_prob)
    out, stats = moe(x)
    probs = torch.softmax(logits, dim=-1)
    for n, experts in enumerate(expected_experts):
        p = probs[n, experts]
        w = p / p.sum() if norm_topk_prob else p
        ref = sum(w[j] * expert_out(moe, e, x[0, n]) for j, e in enumerate(experts))
        torch.testing.assert_close(out[0, n], ref, atol=1e-6, rtol=1e-5)
    assert stats.expert_load.tolist() == [2.0, 3.0, 3.0, 2.0]


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_top1_output_is_the_chosen_expert(dispatch):
    logits = torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 1.0], [0.0, 0.0, 4.0], [0.0, 1.0, 0.5]])
    moe, x = hand_routed(logits, top_k=1, dispatch=dispatch)
    out, stats = moe(x)
    for n, e in enumerate([1, 0, 2, 1]):
        torch.testing.assert_close(out[0, n], expert_out(moe, e, x[0, n]), atol=1e-6, rtol=1e-5)
    assert stats.expert_load.tolist() == [1.0, 2.0, 1.0]


def test_aux_loss_hand_computed_and_reaches_the_router():
    # Token probs [0.75, 0.25], [0.8, 0.2], [0.25, 0.75] -> experts 0, 0, 1.
    # f = [2/3, 1/3], P = [0.6, 0.4], aux = 2 * (2/3 * 0.6 + 1/3 * 0.4) = 16/15.
    # The 4th token would go to expert 1 but is padding: it must change nothing.
    logits = torch.tensor([[math.log(3), 0.0], [math.log(4), 0.0], [0.0, math.log(3)], [0.0, 5.0]])
    moe, x = hand_routed(logits, top_k=1)
    mask = torch.tensor([[1, 1, 1, 0]])
    _, stats = moe(x, token_mask=mask)
    assert stats.aux_loss.item() == pytest.approx(16 / 15, abs=1e-6)
    assert stats.expert_load.tolist() == [2.0, 1.0]
    assert not stats.expert_load.requires_grad

    stats.aux_loss.backward()
    # d aux / d logit_{n,j} = (E / N) p_nj (f_j - sum_e f_e p_ne) for valid n, 0 for padding;
    # x_n is the n-th basis vector, so router.weight.grad[:, n] is that row.
    probs = torch.softmax(logits, dim=-1)
    f = torch.tensor([2 / 3, 1 / 3])
    d_logits = (2 / 3) * probs * (f - (probs * f).sum(-1, keepdim=True))
    d_logits[3] = 0
    torch.testing.assert_close(moe.router.weight.grad, d_logits.t(), atol=1e-6, rtol=1e-5)
    assert moe.router.weight.grad.abs().sum() > 0


def test_aux_loss_of_a_collapsed_router_is_num_experts():
    logits = torch.tensor([[30.0, 0.0, 0.0, 0.0]] * 4)
    moe, x = hand_routed(logits, top_k=1)
    _, stats = moe(x)
    assert stats.aux_loss.item() == pytest.approx(4.0, abs=1e-5)
    assert load_imbalance(stats.expert_load).item() == pytest.approx(4.0)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_unused_experts_get_zero_not_none_grads(dispatch):
    # Every token goes to experts 0 or 1 (top-1); experts 2 and 3 receive nothing.
    logits = torch.tensor([[4.0, 0.0, -4.0, -4.0], [0.0, 4.0, -4.0, -4.0], [4.0, 1.0, -4.0, -4.0]])
    moe, x = hand_routed(logits, top_k=1, dispatch=dispatch, shared_expert=True, extra_norm=True)
    out, stats = moe(x)
    assert stats.expert_load.tolist() == [2.0, 1.0, 0.0, 0.0]
    (out.sum() + 0.01 * stats.aux_loss).backward()
    for name, param in moe.named_parameters():
        assert param.grad is not None, name
    assert torch.all(moe.gate_up.grad[2:] == 0) and torch.all(moe.down.grad[2:] == 0)
    assert moe.gate_up.grad[:2].abs().sum() > 0 and moe.down.grad[:2].abs().sum() > 0
    assert moe.router.weight.grad.abs().sum() > 0


def test_load_imbalance():
    assert load_imbalance(torch.tensor([3.0, 3.0, 3.0, 3.0])).item() == 1.0
    assert load_imbalance(torch.tensor([12.0, 0.0, 0.0, 0.0])).item() == 4.0
    assert load_imbalance(torch.tensor([2.0, 1.0, 1.0, 0.0])).item() == 2.0
    assert load_imbalance(torch.zeros(4)).item() == 1.0
    batched = load_imbalance(torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 0.0]]))
    assert batched.tolist() == [1.0, 2.0, 1.0]


def test_token_mask_excludes_padding_from_loads():
    # B=2, T=3: the padded positions (b=0, t=2) and (b=1, t=1..2) all route to expert 2.
    torch.manual_seed(0)
    moe = MoEMLP(8, 16, num_experts=3, top_k=1)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(3, 8) * 10)
    route_to = torch.tensor([[0, 1, 2], [0, 2, 2]])
    x = F.one_hot(route_to, 8).float()  # token goes to expert route_to[b, t]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    _, stats = moe(x, token_mask=mask)
    assert stats.expert_load.tolist() == [2.0, 1.0, 0.0]
    _, unmasked = moe(x)
    assert unmasked.expert_load.tolist() == [2.0, 1.0, 3.0]
    _, empty = moe(x, token_mask=torch.zeros_like(mask))
    assert empty.expert_load.tolist() == [0.0, 0.0, 0.0] and empty.aux_loss.item() == 0.0
    assert load_imbalance(empty.expert_load).item() == 1.0


@pytest.mark.parametrize(
    "hidden, dtype",
    [(16, torch.float32),   # grouped_mm path
     (16, torch.float64),   # per-expert loop fallback (grouped_mm takes no float64)
     (6, torch.float32)],   # fallback: 6 * 4 bytes rows are not 16-byte aligned
)
def test_dispatches_agree_outputs_and_grads(hidden, dtype):
    torch.manual_seed(0)
    dense = MoEMLP(hidden, 12, num_experts=6, top_k=2, shared_expert=True, extra_norm=True,
                   dispatch="dense").to(dtype)
    sorted_ = MoEMLP(hidden, 12, num_experts=6, top_k=2, shared_expert=True, extra_norm=True,
                     dispatch="sorted").to(dtype)
    sorted_.load_state_dict(dense.state_dict())
    x = torch.randn(2, 7, hidden, dtype=dtype)
    mask = torch.ones(2, 7)
    mask[1, 5:] = 0
    upstream = torch.randn(2, 7, hidden, dtype=dtype)
    results = []
    for moe in (dense, sorted_):
        out, stats = moe(x, token_mask=mask)
        ((out * upstream).sum() + stats.aux_loss).backward()
        results.append((out, stats, dict(moe.named_parameters())))
    (out_d, stats_d, params_d), (out_s, stats_s, params_s) = results
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-12, "rtol": 1e-10}
    torch.testing.assert_close(out_s, out_d, **tol)
    torch.testing.assert_close(stats_s.aux_loss, stats_d.aux_loss, **tol)
    assert torch.equal(stats_s.expert_load, stats_d.expert_load)
    assert stats_d.expert_load.sum().item() == 12 * 2
    for name, p in params_d.items():
        torch.testing.assert_close(params_s[name].grad, p.grad, **tol, msg=name)


def test_dispatches_agree_under_bf16_autocast():
    torch.manual_seed(0)
    dense = MoEMLP(16, 32, num_experts=4, top_k=2, dispatch="dense")
    sorted_ = MoEMLP(16, 32, num_experts=4, top_k=2, dispatch="sorted")
    sorted_.load_state_dict(dense.state_dict())
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_d, _ = dense(x)
        out_s, _ = sorted_(x)
    assert out_d.dtype == out_s.dtype == torch.bfloat16
    torch.testing.assert_close(out_s.float(), out_d.float(), atol=2e-3, rtol=2e-2)


def test_invalid_configuration_is_refused():
    with pytest.raises(ValueError, match="top_k"):
        MoEMLP(8, 16, num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="dispatch"):
        MoEMLP(8, 16, num_experts=2, top_k=1, dispatch="scatter")


def test_aux_loss_is_one_when_every_token_uses_every_expert():
    """k = E: f_e = 1/E whatever the router says, so aux = E * sum_e P_e / E = 1 (not k)."""
    torch.manual_seed(0)
    moe = MoEMLP(8, 16, num_experts=3, top_k=3)
    _, stats = moe(torch.randn(2, 4, 8))
    assert stats.aux_loss.item() == pytest.approx(1.0, abs=1e-6)
    assert stats.expert_load.tolist() == [8.0, 8.0, 8.0]


def test_serving_skips_the_statistics_and_unmasked_stats_match_an_all_ones_mask():
    """``with_stats=False`` (serving: the layer passes it when no one collects stats) gives the same output
    and no stats; without a token mask the stats are those of an all-ones mask (no host tensor made)."""
    torch.manual_seed(0)
    moe = MoEMLP(8, 16, num_experts=4, top_k=2, shared_expert=True)
    x = torch.randn(2, 3, 8)
    out, stats = moe(x)
    served, none = moe(x, with_stats=False)
    assert none is None and torch.equal(served, out)
    _, masked = moe(x, token_mask=torch.ones(2, 3))
    assert stats.aux_loss.item() == pytest.approx(masked.aux_loss.item(), abs=1e-7)
    assert torch.equal(stats.expert_load, masked.expert_load)


def test_moe_drafter_serves_losslessly_without_collecting_stats(tmp_path, tiny_tokenizer, monkeypatch):
    """An MoE EAGLE-4 drafter in the engine: greedy speculation equals plain decoding, and serving never
    computes the load statistics training needs (the old per-forward host tensor broke CUDA graphs)."""
    from tests.runtime_pair import build_pair
    from torchspec.runtime.drafting import SpecConfig
    from torchspec.runtime.loading import load_engine

    target, drafter = build_pair(tmp_path, tiny_tokenizer, moe=True)
    engine = load_engine(target, drafter, device="cpu", dtype="float32", max_batch=2, max_context=96, page_size=8)
    assert isinstance(engine.runner.model.layer.mlp, MoEMLP)
    monkeypatch.setattr(MoEMLP, "_stats", lambda *a: (_ for _ in ()).throw(AssertionError("stats in serving")))
    ps = [tiny_tokenizer.encode(t, add_special_tokens=False) for t in ("hello there", "one two three")]
    plain = engine.generate(ps, max_new_tokens=24, ignore_eos=True)
    for spec in (SpecConfig(shape="chain", depth=4), SpecConfig(shape="tree", depth=3, topk=2, num_nodes=5)):
        out = engine.generate(ps, max_new_tokens=24, spec=spec, ignore_eos=True)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
        assert sum(map(sum, (r.accept_lengths for r in out))) / sum(len(r.accept_lengths) for r in out) > 1.05  # drafts accepted


def test_sorted_dispatch_avoids_host_syncs_where_grouped_mm_has_no_native_kernel():
    """On CUDA only bf16 with 16-byte aligned rows reaches torch's native grouped GEMM; fp32 / fp16 (and
    misaligned rows) would read the group sizes on the host, which graph capture refuses (an fp32 MoE
    drafter's rounds ran eagerly on the H200), so the sorted dispatch computes them densely there."""
    from torchspec.models.moe import grouped_mm_syncs

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not grouped_mm_syncs(cuda, torch.bfloat16, 576, 1536)
    assert grouped_mm_syncs(cuda, torch.float32, 576, 1536) and grouped_mm_syncs(cuda, torch.float16, 576, 1536)
    assert grouped_mm_syncs(cuda, torch.bfloat16, 576, 1535)  # 2 x 1535 bytes: not 16-byte aligned
    assert not grouped_mm_syncs(cpu, torch.float32, 576, 1536)  # no graphs on the CPU: keep the grouped path


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_route_bias_moves_the_selection_not_the_weights(dispatch):
    """A bias on expert 3 makes every token pick it, and the mixing weights stay the router's own
    probabilities (renormalised over what was picked); a zero bias routes as before."""
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    moe, x = hand_routed(logits, top_k=2, dispatch=dispatch)
    _, top0, w0 = moe.route(x[0])
    assert torch.equal(top0, logits.softmax(-1).topk(2).indices)
    with torch.no_grad():
        moe.route_bias[3] = 100.0
    probs, top, weights = moe.route(x[0])
    assert (top == 3).any(-1).all()
    picked = probs.gather(1, top)
    assert torch.allclose(weights, picked / picked.sum(-1, keepdim=True))
    assert "route_bias" in moe.state_dict()


def test_balance_steps_undo_a_collapsed_router():
    """Loss-free balancing with no gradient at all: a router that sends every token to expert 0 first
    is balanced by sign steps of the bias on the step's own loads (8 experts, top-2)."""
    torch.manual_seed(0)
    moe = MoEMLP(16, 8, 8, top_k=2)
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.3)
        moe.router.weight[0] += 2.0 * torch.ones(16) / 4  # expert 0 wins for tokens with a positive mean
    x = torch.randn(512, 16).abs()  # every token prefers expert 0 at the start

    def imbalance() -> float:
        _, top, _ = moe.route(x)
        return float(load_imbalance(torch.bincount(top.reshape(-1), minlength=8)))

    start = imbalance()
    for _ in range(400):
        _, top, _ = moe.route(x)
        moe.balance_step(torch.bincount(top.reshape(-1), minlength=8), rate=0.01)
    assert start > 3.0 and imbalance() < 1.3, (start, imbalance())
    assert moe.route_bias[0] < 0 < moe.route_bias[1:].max()  # the overloaded expert is pushed down


def test_route_bias_stays_fp32_when_the_module_is_cast():
    moe = MoEMLP(8, 8, 4, top_k=2).to(torch.bfloat16)
    assert moe.gate_up.dtype == torch.bfloat16 and moe.route_bias.dtype == torch.float32
    moe.balance_step(torch.tensor([4.0, 0.0, 2.0, 2.0]), rate=0.01)
    assert moe.route_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    for _ in range(300):  # 3.00 + 0.01 is still representable: a bf16 bias would have stopped moving
        moe.balance_step(torch.tensor([0.0, 4.0, 2.0, 2.0]), rate=0.01)
    assert moe.route_bias[0].item() == pytest.approx(2.99, abs=1e-5)


def test_balancing_terms_are_the_global_aux_however_the_batch_is_split(monkeypatch):
    """``ttt.load_balancing_terms``: one process with one micro-batch gives the aux itself (times the micro-batch's
    share of the step); two ranks holding halves of a batch give parts that add up to the whole batch's aux, with
    the whole batch's router gradient -- where the mean of the halves' own auxes (the per-rank loss it replaced)
    is another number (positive control)."""
    import torchspec.train.ttt as ttt

    torch.manual_seed(0)
    moe = MoEMLP(16, 32, 4, top_k=2)
    x = torch.randn(4, 6, 16)
    x[:2, :, 0], x[2:, :, 0] = 3.0, -3.0  # the halves prefer different experts: each is unbalanced on its own
    with torch.no_grad():
        moe.router.weight[0, 0], moe.router.weight[1, 0] = 2.0, -2.0
    mask = torch.ones(4, 6)
    mask[3, 4:] = 0
    _, whole = moe(x, mask)
    valids, denominators = torch.tensor([20.0]), torch.tensor([40.0])
    terms = ttt.load_balancing_terms([whole], valids, denominators)
    assert terms.item() == pytest.approx(0.5 * whole.aux_loss.item(), rel=1e-6)
    (grad_whole,) = torch.autograd.grad(terms.sum(), moe.router.weight)

    halves = [moe(x[:2], mask[:2])[1], moe(x[2:], mask[2:])[1]]
    scored = [torch.tensor([12.0]), torch.tensor([8.0])]

    def packed(st, v):
        return torch.cat([st.expert_load[None], torch.as_tensor(st.num_tokens).reshape(1, 1), v[:, None]], 1)

    parts = []
    for rank in (0, 1):  # all_reduce_sum as gloo would do it: this rank's vector plus the other's
        other = packed(halves[1 - rank], scored[1 - rank])
        monkeypatch.setattr(ttt, "all_reduce_sum", lambda t, o=other: t.add_(o))
        parts.append(ttt.load_balancing_terms([halves[rank]], scored[rank], denominators))
    assert (parts[0] + parts[1]).item() == pytest.approx(terms.item(), rel=1e-6)
    (grad_parts,) = torch.autograd.grad((parts[0] + parts[1]).sum(), moe.router.weight)
    torch.testing.assert_close(grad_parts, grad_whole, rtol=1e-5, atol=1e-7)
    per_rank_mean = 0.5 * sum(h.aux_loss for h in halves) * 0.5
    assert per_rank_mean.item() > 1.05 * terms.item()
