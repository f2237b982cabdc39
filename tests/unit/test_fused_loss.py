"""The fused, chunked LM-head soft cross-entropy equals the plain autograd computation."""

import pytest
import torch

from torchspec.train.loss import fused_linear_soft_ce


@pytest.mark.parametrize("chunk_elems", [7 * 50, 1 << 20])
@pytest.mark.parametrize("freeze_head", [False, True])
def test_fused_matches_plain(chunk_elems, freeze_head):
    g = torch.Generator().manual_seed(0)
    b, n, h, v = 2, 23, 16, 50
    hidden = torch.randn(b, n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=not freeze_head)
    probs = torch.softmax(torch.randn(b, n + 3, v, generator=g) * 2, -1)[:, 2:-1]  # a T-slice, as in TTT
    w = torch.rand(b, n, generator=g) * (torch.rand(b, n, generator=g) > 0.3)

    loss, ce, argmax = fused_linear_soft_ce(hidden, weight, probs, w, chunk_elems=chunk_elems)
    (loss * 1.7).backward()
    grads = (hidden.grad.clone(), None if freeze_head else weight.grad.clone())
    hidden.grad = None
    weight.grad = None

    z = hidden @ weight.T
    ce_ref = -(probs * torch.log_softmax(z, -1)).sum(-1)
    loss_ref = (ce_ref * w).sum()
    (loss_ref * 1.7).backward()
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(ce, ce_ref.detach())
    assert torch.equal(argmax, z.argmax(-1))
    torch.testing.assert_close(grads[0], hidden.grad)
    if not freeze_head:
        torch.testing.assert_close(grads[1], weight.grad)


def test_no_grad_path_computes_no_gradients():
    hidden, weight = torch.randn(1, 5, 4), torch.randn(9, 4)
    probs = torch.softmax(torch.randn(1, 5, 9), -1)
    with torch.no_grad():
        loss, ce, _ = fused_linear_soft_ce(hidden, weight, probs, torch.ones(1, 5))
    assert loss.shape == () and ce.shape == (1, 5)
