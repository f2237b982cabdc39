"""What the engine runs when it captures a draft controller's rounds as CUDA graphs before they are planned
(``engine_forwards.capture_round_shapes``, ``SpeculativeEngine.capture_controller_graphs``): each round on idle
rows -- every row invalid, context 0 -- over the live block table, mid-run, whatever the rows hold. On the CPU
(fp32, the tiny pair), every round the controller may plan, greedy and sampled, tree and chain, held plans'
fixed shapes and catch-ups after plain streaks included, with deferred drafter entries pending: nothing raises,
nothing but the trash page is written, and the deferred counts stay. A negative position there is a read
before a row's block table, which the GPU does not stop (thirtieth session)."""

from __future__ import annotations

import pytest
import torch

from tests.controller_cases import cpu_engine, table
from torchspec.runtime.drafting import DraftInputs, SpecConfig
from torchspec.runtime.engine_forwards import round_args, round_step
from torchspec.runtime.paged_kv import TRASH_PAGE
from torchspec.runtime.pending_drafter import catch_up_pending
from torchspec.runtime.plan_averages import PLANS_ENV
from torchspec.runtime.sampling import SamplingParams

SPECS = [SpecConfig(shape="tree", depth=4, topk=3, num_nodes=12), SpecConfig(shape="chain", depth=4)]


@pytest.fixture(scope="module")
def engine(controller_pair):
    return cpu_engine(controller_pair)


@pytest.fixture
def live_rows(engine):
    """Two slots holding real pages and deferred drafter entries (3 and 1): (slots, their block table)."""
    pages = [engine.allocator.alloc(engine.pages_per_row) for _ in range(2)]
    slots = torch.tensor([0, 1])
    for i, row in enumerate(pages):
        engine.block_table[i] = torch.tensor(row)
    engine.caches.pending.reset(slots)
    engine.caches.pending.count[:2] = torch.tensor([3, 1])
    yield slots, engine.block_table[:2].clone()
    engine.caches.pending.reset(slots)
    engine.block_table[:2] = TRASH_PAGE
    for row in pages:
        engine.allocator.free(row)


def caches(engine) -> list[torch.Tensor]:
    c = engine.caches
    return [t.clone() for t in (c.target.k, c.target.v, c.drafter.k, c.drafter.v)]


def assert_only_trash_written(engine, before: list[torch.Tensor]) -> None:
    trash = torch.arange(TRASH_PAGE * engine.page_size, (TRASH_PAGE + 1) * engine.page_size)
    for got, was in zip(caches(engine), before):
        got[:, trash], was[:, trash] = 0, 0
        assert torch.equal(got, was)


@pytest.mark.parametrize("plans", ["average", "held"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.shape)
def test_every_round_a_capture_runs_on_idle_rows_writes_nothing(engine, live_rows, spec, plans, monkeypatch):
    monkeypatch.setenv(PLANS_ENV, plans)
    slots, bt = live_rows
    costs = table(engine, depth=0.05, verify_per_node=0.02)
    engine.configure(spec=spec, controller=costs, concurrency=2)
    ctl, ran = engine.controller, 0
    ctx, valid = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.bool)
    engine.generator = torch.Generator().manual_seed(0)
    before = caches(engine)
    for params in (SamplingParams(), SamplingParams(temperature=0.8)):
        for shape, round_costs in ctl.round_shapes(params, 2, 100):
            name, step = round_step(engine, shape, round_costs, False)
            step(**round_args(engine, name, slots, ctx, valid, bt, params, round_costs))
            ran += 1
    assert ran > 10 and any(c is not None and c.flush for _, c in ctl.round_shapes(SamplingParams(), 2, 100))
    assert_only_trash_written(engine, before)
    assert engine.caches.pending.count[:2].tolist() == [3, 1]


def test_an_idle_catch_up_at_context_0_with_entries_pending_changes_nothing(engine, live_rows):
    """The catch-up on deferred plain rounds starts at ctx - count: an invalid row catches up on nothing (it read
    the block table at column -1) and keeps its count and drafter state."""
    slots, bt = live_rows
    before = caches(engine)
    normed, feedback = torch.randn(2, engine.normed.shape[1]), torch.randn(2, engine.normed.shape[1])
    idle = DraftInputs(root=torch.zeros(2, dtype=torch.long), normed=normed, feedback=feedback,
                       ctx_len=torch.zeros(2, dtype=torch.long), block_table=bt,
                       row_valid=torch.zeros(2, dtype=torch.bool))
    out = catch_up_pending(engine.runner, engine.caches, idle, slots)
    assert engine.caches.pending.count[:2].tolist() == [3, 1]
    assert torch.equal(out.normed, normed) and torch.equal(out.feedback, feedback)
    assert_only_trash_written(engine, before)

