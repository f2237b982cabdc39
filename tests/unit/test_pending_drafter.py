"""torchspec.runtime.pending_drafter.PendingDrafter: per-slot deferred drafter inputs. Pushes land at each slot's
next entry, invalid rows count nothing, ``take`` returns and clears the valid rows' entries, and an idle run
(every row invalid: a CUDA-graph warm-up) changes no count.

    python -m pytest -q tests/unit/test_pending_drafter.py
"""

from __future__ import annotations

import pytest
import torch

from torchspec.runtime.pending_drafter import PendingDrafter


def test_push_take_and_idle_runs():
    pend = PendingDrafter(slots=4, capacity=3, num_aux=2, hidden=5, dtype=torch.float32, device=torch.device("cpu"))
    slots = torch.tensor([2, 0])
    for step in range(3):
        aux = [torch.full((2, 1, 5), 10.0 * step + i) for i in range(2)]
        pend.push(slots, torch.tensor([100 + step, 200 + step]), aux, torch.tensor([True, step != 1]))
    assert pend.count.tolist() == [2, 0, 3, 0]  # slot 0 was invalid at step 1: its step-2 entry took that place
    tokens, aux, count = pend.take(slots, torch.tensor([False, False]))  # idle: nothing cleared
    assert count.tolist() == [3, 2] and pend.count.tolist() == [2, 0, 3, 0]
    assert tokens.tolist() == [[100, 101, 102], [200, 202, 0]]
    assert aux[1][0, :, 0].tolist() == [1.0, 11.0, 21.0] and aux[0][1, :2, 0].tolist() == [0.0, 20.0]
    _, _, count = pend.take(slots, torch.tensor([True, True]))
    assert count.tolist() == [3, 2] and pend.count.tolist() == [0, 0, 0, 0]
    pend.push(torch.tensor([1]), torch.tensor([7]), [torch.zeros(1, 1, 5)] * 2, torch.tensor([True]))
    pend.reset(torch.tensor([1, 3]))
    assert pend.count.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="capacity=0"):
        PendingDrafter(4, 0, 2, 5, torch.float32, torch.device("cpu"))
