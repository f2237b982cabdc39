"""The bookkeeping behind StepGraphs' steady inputs (runs anywhere; the graphs themselves: tests/gpu)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchspec.runtime.graphs import _same_sources, _sources


@dataclass
class Costs:
    depth_ms: torch.Tensor
    verify_ms: torch.Tensor
    plan: tuple[int, int] | None = None


def test_sources_are_the_same_only_for_the_same_unwritten_tensors():
    a, b = torch.zeros(3), torch.ones(5)
    first = _sources(Costs(a, b, plan=(1, 2)))
    assert _same_sources(first, _sources(Costs(a, b, plan=(5, 8))))  # another wrapper, other host fields
    assert not _same_sources(None, first)
    assert not _same_sources(first, _sources(Costs(a.clone(), b)))  # equal values, another tensor
    a.add_(1)  # written in place
    assert not _same_sources(first, _sources(Costs(a, b)))


def test_a_tensor_input_is_its_own_source_and_host_values_have_none():
    t = torch.zeros(2)
    assert _same_sources(_sources(t), _sources(t))
    assert _sources(3) == () and _sources(None) == ()
