"""A random fused head-loss problem in fp64 (drafter states, head W, low-rank scorer, teacher head, token
weights) and a gradient collector, shared by the full-vocabulary and candidate-restricted loss tests."""

from __future__ import annotations

import torch


def make(seed, n=11, k=3, h=8, ht=6, v=53, r=3):
    """(states [n, k, h], weight [v, h], down [r, h], up [v, r], t_hidden [n, ht], t_weight [v, ht],
    t_bias [v], w [n, k]); the first four require grad, position n // 2 has no scored step."""
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(n, k, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.7).requires_grad_()
    down = (torch.randn(r, h, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    up = (torch.randn(v, r, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    t_hidden = torch.randn(n, ht, generator=g, dtype=torch.float64)
    t_weight = torch.randn(v, ht, generator=g, dtype=torch.float64)
    t_bias = torch.randn(v, generator=g, dtype=torch.float64)
    w = torch.rand(n, k, generator=g, dtype=torch.float64) * (torch.rand(n, k, generator=g) > 0.3)
    w[n // 2] = 0  # a position no step scores
    return states, weight, down, up, t_hidden, t_weight, t_bias, w


def grads(params):
    """The parameters' gradients (cloned), each reset to None."""
    out = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out
