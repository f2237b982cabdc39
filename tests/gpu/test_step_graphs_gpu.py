"""StepGraphs' steady inputs on CUDA: copied into the graph only when their tensors change."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from torchspec.runtime.graphs import StepGraphs

pytestmark = pytest.mark.gpu


@dataclass
class Rows:
    scale: torch.Tensor
    shift: torch.Tensor


def _step(x, rows):
    return x * rows.scale + rows.shift


def test_a_steady_input_is_recopied_when_written_or_replaced_and_skipped_otherwise():
    graphs, dev = StepGraphs(), torch.device("cuda")
    x = torch.arange(4.0, device=dev)
    rows = Rows(torch.full((4,), 2.0, device=dev), torch.ones(4, device=dev))
    run = lambda r: graphs.run("k", _step, {"x": x, "rows": r}, steady=frozenset({"rows"})).clone()  # noqa: E731
    assert torch.equal(run(rows), x * 2 + 1)
    static_rows = graphs._graphs["k"][1]["rows"]
    static_rows.scale.fill_(-7.0)  # a skipped copy leaves this in place: proof that nothing was copied
    assert torch.equal(run(Rows(rows.scale, rows.shift)), x * -7 + 1)  # same tensors, unwritten: skipped
    rows.scale.fill_(3.0)  # written in place: its version moves, so it is copied again
    assert torch.equal(run(rows), x * 3 + 1)
    assert torch.equal(run(Rows(torch.full((4,), 5.0, device=dev), rows.shift)), x * 5 + 1)  # another tensor


def test_inputs_not_named_steady_are_copied_every_replay():
    graphs, dev = StepGraphs(), torch.device("cuda")
    x = torch.arange(4.0, device=dev)
    rows = Rows(torch.full((4,), 2.0, device=dev), torch.ones(4, device=dev))
    graphs.run("k", _step, {"x": x, "rows": rows})
    graphs._graphs["k"][1]["rows"].scale.fill_(-7.0)
    assert torch.equal(graphs.run("k", _step, {"x": x, "rows": rows}), x * 2 + 1)
