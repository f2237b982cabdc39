"""GPU: the Triton row pass equals the torch reference row pass, and the bf16 fused loss equals a
fp32 per-chunk reference within bf16 tolerance (loss, grads of the states, the head and the scorer);
the in-place fp32 accumulation of a bf16 GEMM (``addmm_f32_``) is exact against an fp32 GEMM."""

from __future__ import annotations

import pytest
import torch

from torchspec.train.loss import TeacherHead, addmm_f32_, fused_ttt_head_loss

pytestmark = pytest.mark.gpu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.double()).norm() / b.detach().double().norm().clamp(min=1e-30))


def inputs(n=300, k=7, h=256, v=5003, r=32, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    states = torch.randn(n, k, h, device="cuda", generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5 * 4).to(dtype).requires_grad_()
    down = (torch.randn(r, h, device="cuda", generator=g) * h**-0.5).to(dtype).requires_grad_()
    up = (torch.randn(v, r, device="cuda", generator=g) * r**-0.5 * 2).to(dtype).requires_grad_()
    t_hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    t_weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5 * 4).to(dtype)
    w = torch.rand(n, k, device="cuda", generator=g) * (torch.rand(n, k, device="cuda", generator=g) > 0.2)
    return states, weight, down, up, t_hidden, t_weight, w


def run(args, backend, scorer_teacher="target", chunk=64):
    states, weight, down, up, t_hidden, t_weight, w = args
    out = fused_ttt_head_loss(states, weight, TeacherHead(t_hidden, t_weight), w, scorer=(down, up), topk=64,
                              scorer_teacher=scorer_teacher, chunk_positions=chunk, backend=backend)
    out.loss.backward()
    grads = [p.grad.clone() for p in args[:4]]
    for p in args[:4]:
        p.grad = None
    return out, grads


@pytest.mark.parametrize("scorer_teacher", ["target", "full"])
def test_triton_row_pass_equals_torch_row_pass(scorer_teacher):
    args = inputs()
    a, ga = run(args, "triton", scorer_teacher)
    b, gb = run(args, "torch", scorer_teacher)
    assert rel(a.loss, b.loss) < 1e-5
    assert rel(a.kl, b.kl) < 1e-4 and rel(a.scorer_kl, b.scorer_kl) < 1e-4
    assert (a.argmax == b.argmax).float().mean() > 0.999  # fp32 logits: ties only
    assert torch.equal(a.target_argmax, b.target_argmax)
    assert (a.full_in_topk == b.full_in_topk).float().mean() > 0.999
    for x, y in zip(ga, gb):
        assert rel(x, y) < 1e-2  # both store bf16 logit gradients; rounding differs only


def test_bf16_fused_loss_within_bf16_tolerance_of_fp32():
    args = inputs()
    out, grads = run(args, "triton")
    f32 = [x.detach().float().requires_grad_(x.requires_grad) for x in args]
    ref, ref_grads = run(f32, "torch")
    assert rel(out.loss, ref.loss) < 1e-2
    for x, y in zip(grads, ref_grads):
        assert rel(x, y) < 3e-2


def test_addmm_accumulates_in_place_in_fp32():
    g = torch.Generator(device="cuda").manual_seed(1)
    acc = torch.randn(512, 384, device="cuda", generator=g)
    a = torch.randn(512, 1000, device="cuda", generator=g).bfloat16()
    b = torch.randn(1000, 384, device="cuda", generator=g).bfloat16()
    want = acc + a.float() @ b.float()
    ptr = acc.data_ptr()
    addmm_f32_(acc, a, b)
    assert acc.data_ptr() == ptr and acc.dtype == torch.float32
    assert rel(acc, want) < 1e-5
