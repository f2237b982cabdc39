"""Hand-built cost tables for controller tests: a table of an engine's own key whose times follow a rule."""

from __future__ import annotations

import torch

from torchspec.runtime.cost_table import CostTable, cost_key


def linear_table(engine, depth: float, verify_per_node: float, *, widths: list[int], nodes: list[int],
                 noise: float = 0.0, seed: int = 0, batches: tuple[int, ...] = (1, 4, 512)) -> CostTable:
    """A depth costs ``depth`` ms (a round's depth 0 too: its whole width-0 round is a plain step and a depth), a
    plain step 1 ms and each verified node ``verify_per_node`` ms more, at every
    batch (``batches``) and context (16, 256); ``noise``: random multiplicative jitter (verify kept non-decreasing),
    so decisions vary from cell to cell."""
    g = torch.Generator().manual_seed(seed)
    batches, contexts = list(batches), [16, 256]

    def jitter(*shape: int) -> torch.Tensor:
        return 1 + noise * torch.rand(*shape, generator=g, dtype=torch.float64)

    d = depth * jitter(len(contexts), len(batches), len(widths))
    v = (1 + verify_per_node * torch.tensor(nodes, dtype=torch.float64)) * jitter(len(contexts), len(batches), len(nodes))
    v = v.cummax(-1).values
    return CostTable(key=cost_key(engine.decoder, engine.runner), widths=widths, nodes=nodes, batches=batches,
                     contexts=contexts, depth=d, verify=v, round=v[..., 0] + d[..., 0], meta={})
