"""The fused TTT head loss (torchspec/train/loss.py) against a naive per-position reference written
with plain autograd: loss, KL, argmaxes, recall counts, and the gradients of the drafter states,
the head weight and the low-rank scorer -- fp32-tight, for several chunk sizes and both scorer
teachers; plus the teacher helpers and the memory check's message."""

from __future__ import annotations

import pytest
import torch

from tests.head_loss_problems import grads, make
from torchspec.train.loss import TeacherHead, auto_chunk_positions, check_chunk_fits, fused_ttt_head_loss


def reference(states, weight, t_hidden, t_weight, t_bias, w, down=None, up=None, coef=1.0, full=False, topk=4):
    """Per (position, step), one row at a time: the definition the fused pass must equal."""
    n, k, _ = states.shape
    loss = states.new_zeros(())
    kl = torch.zeros(n, k)
    argmax = torch.zeros(n, k, dtype=torch.long)
    skl, fhit, thit = torch.zeros(n, k), torch.zeros(n, k, dtype=torch.bool), torch.zeros(n, k, dtype=torch.bool)
    for i in range(n):
        zt = t_weight @ t_hidden[i] + (0 if t_bias is None else t_bias)
        logp = torch.log_softmax(zt, -1)
        t_arg = zt.argmax()
        for j in range(k):
            z = weight @ states[i, j]
            logq = torch.log_softmax(z, -1)
            row_kl = (logp.exp() * (logp - logq)).sum()
            loss = loss + w[i, j] * row_kl
            kl[i, j], argmax[i, j] = row_kl.detach(), z.argmax()
            if down is None:
                continue
            s = up @ (down @ states[i, j].detach())
            logqs = torch.log_softmax(s, -1)
            lt = logq.detach() if full else logp
            row_skl = (lt.exp() * (lt - logqs)).sum()
            loss = loss + coef * w[i, j] * row_skl
            skl[i, j] = row_skl.detach()
            fhit[i, j] = (s > s[z.argmax()]).sum() < topk
            thit[i, j] = (s > s[t_arg]).sum() < topk
    return loss, kl, argmax, skl, fhit, thit


@pytest.mark.parametrize("chunk", [1, 4, 11])
@pytest.mark.parametrize("scorer_teacher", ["target", "full", None])
def test_fused_equals_per_position_reference(chunk, scorer_teacher):
    states, weight, down, up, t_hidden, t_weight, t_bias, w = make(chunk)
    params = [states, weight, down, up]
    scorer = (down, up) if scorer_teacher else None
    teacher = TeacherHead(t_hidden, t_weight, t_bias)
    out = fused_ttt_head_loss(states, weight, teacher, w, scorer=scorer, topk=15, scorer_coef=0.7,
                              scorer_teacher=scorer_teacher or "target", chunk_positions=chunk, backend="torch")
    (1.3 * out.loss).backward()
    got = grads(params[:2]) + (grads(params[2:]) if scorer else [])
    ref = reference(states, weight, t_hidden, t_weight, t_bias, w, *(scorer or (None, None)), coef=0.7,
                    full=scorer_teacher == "full", topk=15)
    (1.3 * ref[0]).backward()
    want = grads(params[:2]) + (grads(params[2:]) if scorer else [])
    tight = {"rtol": 1e-9, "atol": 1e-11}
    scored = (w > 0).any(-1)  # on CPU the pass skips positions no step scores (values there: 0)
    assert 0 < scored.sum() < len(scored)  # the skipping is exercised
    torch.testing.assert_close(out.loss, ref[0].detach(), **tight)
    torch.testing.assert_close(out.kl[scored], ref[1][scored].to(out.kl.dtype), rtol=1e-6, atol=1e-6)
    assert not out.kl[~scored].any()
    assert torch.equal(out.argmax[scored], ref[2][scored])
    assert torch.equal(out.target_argmax[scored], (t_hidden @ t_weight.T + t_bias).argmax(-1)[scored])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tight)
    if scorer:
        torch.testing.assert_close(out.scorer_kl[scored], ref[3][scored].to(out.scorer_kl.dtype), rtol=1e-6, atol=1e-6)
        assert torch.equal(out.full_in_topk[scored], ref[4][scored])
        assert torch.equal(out.target_in_topk[scored], ref[5][scored])
        assert ref[4][scored].any() and not ref[4][scored].all()  # the recall check is not vacuous


def test_fp32_matches_the_fp64_reference_and_frozen_head_gets_no_grad():
    states, weight, down, up, t_hidden, t_weight, t_bias, w = make(7)
    f32 = [x.detach().float() for x in (states, weight, down, up, t_hidden, t_weight, t_bias, w)]
    f32[0].requires_grad_()
    out = fused_ttt_head_loss(f32[0], f32[1], TeacherHead(f32[4], f32[5], f32[6]), f32[7],
                              scorer=(f32[2], f32[3]), topk=4, chunk_positions=3, backend="torch")
    out.loss.backward()
    ref = reference(states, weight, t_hidden, t_weight, t_bias, w, down, up, topk=4)
    ref[0].backward()
    torch.testing.assert_close(out.loss.double(), ref[0].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(f32[0].grad.double(), states.grad, rtol=1e-4, atol=1e-6)


def test_all_masked_batch_gives_zero_loss_and_zero_grads():
    states, weight, down, up, t_hidden, t_weight, t_bias, _ = make(3)
    out = fused_ttt_head_loss(states, weight, TeacherHead(t_hidden, t_weight), torch.zeros(11, 3),
                              scorer=(down, up), topk=4, chunk_positions=5, backend="torch")
    out.loss.backward()
    assert out.loss == 0
    for p in (states, weight, down, up):  # every parameter is touched (contract 4), with zeros
        assert p.grad is not None and not p.grad.any()


def test_teacher_from_logits_and_restriction():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 30, generator=g)
    teacher = TeacherHead.from_logits(logits)
    assert torch.equal(teacher.full_argmax(chunk_rows=3), logits.argmax(-1))
    ids = torch.tensor([1, 4, 7, 20])
    sub = teacher.restricted(ids)
    torch.testing.assert_close(sub.hidden @ sub.weight.T, logits[..., ids])
    assert torch.equal(sub.argmax, logits.argmax(-1))  # still over the full vocabulary


def test_chunk_sizing_and_the_memory_message(monkeypatch):
    assert auto_chunk_positions(151_936, 7, True, torch.bfloat16, 4.0) == 321
    assert auto_chunk_positions(151_936, 7, False, torch.bfloat16, 4.0) > 321
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 2**34))
    with pytest.raises(ValueError, match=r"train.loss_chunk_gib: .* the largest that fits is 80 positions"):
        check_chunk_fits(1000, 151_936, 7, True, torch.bfloat16, torch.device("cuda"))
    check_chunk_fits(1000, 151_936, 7, True, torch.bfloat16, torch.device("cpu"))  # no check on CPU


def test_unsupported_backend_falls_back_to_torch_with_one_warning(monkeypatch):
    from torchspec.train import loss

    monkeypatch.setattr(loss, "_warned", set())
    with pytest.warns(UserWarning, match="needs CUDA.*torch reference path"):
        assert loss.resolve_backend("triton", torch.device("cpu"), 7) == "torch"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning
        assert loss.resolve_backend("triton", torch.device("cpu"), 7) == "torch"
        assert loss.resolve_backend("auto", torch.device("cpu"), 7) == "torch"  # CPU: the reference, silently
    assert "K=17" in loss.loss_rows.triton_unsupported(torch.device("cuda"), 17) or \
        "Triton is not installed" in loss.loss_rows.triton_unsupported(torch.device("cuda"), 17)
