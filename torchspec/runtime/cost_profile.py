"""Measure a ``CostTable`` on this device by timing the runtime's own building blocks.

For every context bucket and padded batch size b, on an idle engine whose rows are given pages for
``ctx`` committed tokens plus a round:

* **one draft depth** at frontier width w: the drafter forward over w frontier nodes a row (the
  depth's ancestor mask, paged attention over the committed prefix and the draft ancestors), the
  top-w children of each node with their log-probabilities, and the frontier expansion keeping the
  w best of the w * w -- the code of a dynamic tree's depth (``drafting._DraftWriter``,
  ``drafting._top``, ``tree_select.expand_frontier``). Width 1 is a chain depth with scores (the
  controller needs the drafter's confidence, which the scoreless greedy chain does not compute).
* **a whole round of width 0**: the draft controller's ahead round planned (1 depth, 0 nodes) --
  depth 0's top-k candidates, the decision, the root's verify forward, acceptance, compaction and
  the drafter's catch-up (``steps.speculate``): what every speculating round pays beyond its verify
  forward and later depths.
* **the host's time a round** (``overhead_ms``, per batch): random prompts of the first context bucket
  decoded plainly through the engine itself (``generate``; a long run less a short one, ``OVERHEAD_ROUNDS``
  rounds apart, so a call's fixed cost cancels): the wall time a decode round less the timed plain step is what the engine adds around its forwards (bookkeeping,
  inputs, launches, the sync) -- on a GPU, time it idles; every round pays it, plain or not.
* **depth 0 as served** (``round_extra_ms``, per batch): the same prompts decoded with a fixed depth-1 round
  (top-k candidates, one node verified), its wall time a round less the plain round's and less the verify
  forward's own difference -- what the engine's speculating rounds pay for depth 0, where the width-0 round
  above is timed as graphs replayed alone (``cost_table`` module docstring).
* **the verify forward** over n drafted nodes a row: the target forward over root + n nodes with
  the tree's attention mask and the drafter's aux layers captured, and the argmax at every node (as
  ``steps.speculate`` runs it); n = 0 is ``steps.plain_step``. The nodes form a chain: for an
  attention target the cost depends on the node count, not the shape; for a hybrid target, whose
  recurrence steps once per depth, a chain is the dearest shape.

On CUDA the time is the median of R runs bracketed by CUDA events, each launched on an idle GPU as an
engine's rounds are, after three eager warm-ups (which also compile the fused regions), in one of two
``timing`` modes: ``"graph"``, each measured function captured in a CUDA graph and replayed (what a
graphed round pays: the controller's default "ahead" mode), or ``"eager"``, each run launched op by op
from the host, so the time holds the launches the GPU waits for (what the host-chained "within" mode pays:
it serves without graphs, ``controlled_drafting.py``). The table records its mode (``meta["timing"]``).
Elsewhere it is the median of R wall-clock runs after two warm-ups: enough to exercise the profiler in CPU tests, meaningless as
costs.

Under tensor parallelism every rank runs the same measurements (the target's collectives pair up);
the table is rank 0's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime

import torch

from torchspec.runtime.cost_table import CostTable, cost_key
from torchspec.runtime.drafting import DraftInputs, SpecConfig, _DraftWriter, _top
from torchspec.runtime.paged_kv import TRASH_PAGE
from torchspec.runtime.sampling import SamplingParams
from torchspec.runtime.steps import plain_step, verify_forward
from torchspec.runtime.tree import chain_tree
from torchspec.runtime.tree_select import expand_frontier, with_ancestors

GREEDY = SamplingParams()
OVERHEAD_ROUNDS = 24  # plain decode rounds timed for the host's time a round (beyond a short run's)
SHORT_ROUNDS = 4  # the short run's new tokens: the long run less it cancels a generate call's fixed cost


def graph_replay(fn: Callable[[], object], replays: int, keep_graph: bool = False
                 ) -> tuple[float, torch.cuda.CUDAGraph]:
    """(Median replay time (ms) of ``fn`` captured in a CUDA graph after 3 eager warm-ups, the graph;
    ``keep_graph`` keeps its cudaGraph_t for node counting, ``tools/profile_round.py``). The GPU is idle
    when each replay is launched, as between an engine's rounds (the host syncs on every round's
    counts), so the time includes whatever the launch makes the GPU wait for."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    with torch.cuda.graph(graph):
        fn()
    if keep_graph:
        graph.instantiate()
    return _event_median(graph.replay, replays), graph


def graph_ms(fn: Callable[[], object], replays: int) -> float:
    """``graph_replay``'s time alone (the graph is freed)."""
    return graph_replay(fn, replays)[0]


def eager_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median time (ms) of ``fn`` launched op by op on an idle GPU (CUDA events around the launches, a
    sync before each run) after 3 warm-ups: the host's launch latency counts where the GPU waits for it."""
    for _ in range(3):
        fn()
    return _event_median(fn, repeats)


def _event_median(launch: Callable[[], object], repeats: int) -> float:
    """Median ms between CUDA events around ``launch()``, each run started on an idle GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


TIMERS = {"graph": graph_ms, "eager": eager_ms}


def wall_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall-clock time (ms) of ``fn`` over ``repeats`` runs after 2 warm-ups (CPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile_rows_needed(contexts: list[int], widths: list[int], nodes: list[int]) -> int:
    """Tokens a row must hold: the largest context plus the largest round measured at it."""
    return max(contexts) + max(2 * max(widths), max(nodes) + 1)


class _Rows:
    """``b`` live-looking rows of ``ctx`` committed tokens over the engine's block table."""

    def __init__(self, engine, b: int, ctx: int, extra: int):
        dev = engine.device
        self.b, self.ctx = b, ctx
        self.ctx_len = torch.full((b,), ctx, dtype=torch.long, device=dev)
        self.valid = torch.ones(b, dtype=torch.bool, device=dev)
        self.block_table = engine.block_table[:b, :engine.table_columns_for(ctx + extra)]  # the columns a round reads
        self.tokens = torch.randint(0, engine.decoder.vocab_size, (b, max(extra, 1)), device=dev)


def depth_fn(engine, b: int, ctx: int, w: int) -> Callable[[], object]:
    """One draft depth at frontier width ``w`` (module docstring): the second depth of a dynamic tree
    of top-w children, its frontier's parents the first depth's w nodes."""
    runner = engine.runner
    rows = _Rows(engine, b, ctx, 2 * w)
    inp = DraftInputs(root=rows.tokens[:, 0], normed=engine.normed[:b], feedback=engine.feedback[:b],
                      ctx_len=rows.ctx_len, block_table=rows.block_table, row_valid=rows.valid)
    writer = _DraftWriter(runner, engine.caches.drafter, inp, 2 * w, 3)
    first = with_ancestors(writer.anc, None, 0, w)  # the first depth's nodes: draft slots 0 .. w - 1
    tokens = rows.tokens[:, :w]
    hidden = engine.feedback[:b, None].expand(b, w, -1).contiguous()  # [B, W, H]
    parent_rows = torch.arange(w, device=engine.device).expand(b, w)
    front_sc = -torch.arange(w, dtype=torch.float32, device=engine.device).expand(b, w)  # [B, W] descending
    front_idx = parent_rows

    def depth():
        writer.anc, writer.written = first, w  # every call drafts the same depth (a replay re-runs it anyway)
        normed, feedback = writer.run(tokens, hidden, parent_rows, 2)
        child_sc, child_tok = _top(runner, normed, w, GREEDY)  # [B, W, W]
        return expand_frontier(front_sc, child_sc, child_tok, front_idx, feedback, w, False)

    return depth


def verify_fn(engine, b: int, ctx: int, n: int) -> Callable[[], object]:
    """The verify forward over ``n`` drafted nodes a row (a chain), or a plain step for n = 0."""
    decoder, caches = engine.decoder, engine.caches
    rows = _Rows(engine, b, ctx, n + 1)
    if n == 0:
        return lambda: plain_step(decoder, caches, rows.block_table, rows.ctx_len, rows.tokens[:, 0], rows.valid,
                                  GREEDY, None)
    tree = chain_tree(rows.tokens[:, :n + 1])
    aux_ids = tuple(engine.runner.config.aux_layer_ids)

    def verify():
        out, _ = verify_forward(decoder, caches, tree, n, rows.block_table, rows.ctx_len, rows.valid, None, aux_ids,
                                (1,) * (n + 1))
        return decoder.argmax(out.hidden), out.aux

    return verify


def round_fn(engine, b: int, ctx: int, k: int) -> Callable[[], object]:
    """A whole ahead-mode round planned (1, 0) with top-``k`` candidates (module docstring)."""
    from torchspec.runtime.calibration import Calibration
    from torchspec.runtime.round_costs import RoundCosts
    from torchspec.runtime.steps import speculate

    rows = _Rows(engine, b, ctx, 2)
    inp = DraftInputs(root=rows.tokens[:, 0], normed=engine.normed[:b], feedback=engine.feedback[:b],
                      ctx_len=rows.ctx_len, block_table=rows.block_table, row_valid=rows.valid)
    spec = SpecConfig(shape="tree", depth=1, topk=k, num_nodes=1)
    ones = torch.ones(1, device=engine.device)
    costs = RoundCosts(ones, ones.expand(2).contiguous(), Calibration(engine.device), plan=(1, 0))
    return lambda: speculate(engine.decoder, engine.runner, engine.caches, inp, spec, GREEDY, None, costs=costs)


@torch.no_grad()
def profile_costs(engine, *, batches: list[int], contexts: list[int], widths: list[int], nodes: list[int],
                  repeats: int, timing: str = "graph", log: Callable[[str], None] | None = None) -> CostTable:
    """Measure the table of ``engine``'s setup (module docstring; ``timing``: "graph" or "eager" on CUDA).
    The engine must be idle, hold a drafter, and fit ``max(batches)`` rows of ``profile_rows_needed(...)``
    tokens; its pages are lent to the measured rows and given back at the end."""
    if timing not in TIMERS:
        raise ValueError(f"timing={timing!r} must be one of {sorted(TIMERS)}.")
    if engine.runner is None:
        raise ValueError("profiling costs needs a drafter: load the engine with one.")
    if engine.has_work:
        raise ValueError("profiling costs needs an idle engine: finish or cancel its requests first.")
    need = profile_rows_needed(contexts, widths, nodes)
    if max(batches) > engine.max_batch or need > engine.max_context:
        raise ValueError(f"the engine holds {engine.max_batch} rows of {engine.max_context} tokens; profiling needs "
                         f"{max(batches)} rows of {need}: build it with max_batch and max_context at least that.")
    on_gpu = engine.device.type == "cuda"
    timer = TIMERS[timing] if on_gpu else wall_ms
    lent = [engine.allocator.alloc(engine.pages_per_row) for _ in range(max(batches))]
    for i, pages in enumerate(lent):
        engine.block_table[i] = torch.tensor(pages, device=engine.device)
    depth = torch.zeros(len(contexts), len(batches), len(widths), dtype=torch.float64)
    verify = torch.zeros(len(contexts), len(batches), len(nodes), dtype=torch.float64)
    whole = torch.zeros(len(contexts), len(batches), dtype=torch.float64)
    try:
        for c, ctx in enumerate(contexts):
            for i, b in enumerate(batches):
                for j, w in enumerate(widths):
                    depth[c, i, j] = timer(depth_fn(engine, b, ctx, w), repeats)
                for j, n in enumerate(nodes):
                    verify[c, i, j] = timer(verify_fn(engine, b, ctx, n), repeats)
                whole[c, i] = timer(round_fn(engine, b, ctx, max(widths)), repeats)
                if log is not None:
                    log(f"ctx {ctx:>6}  b {b:>3}  depth ms " + " ".join(f"{t:.3f}" for t in depth[c, i].tolist())
                        + "  verify ms " + " ".join(f"{t:.3f}" for t in verify[c, i].tolist())
                        + f"  round ms {float(whole[c, i]):.3f}")
    finally:
        engine.block_table[: len(lent)] = TRASH_PAGE
        for pages in lent:
            engine.allocator.free(pages)
    meta = {"timing": timing if on_gpu else "wall-clock (CPU: not a cost)", "repeats": repeats,
            "page_size": engine.page_size, "torch": torch.__version__,
            "created": datetime.now(UTC).isoformat(timespec="seconds")}
    table = CostTable(key=cost_key(engine.decoder, engine.runner), widths=list(widths), nodes=list(nodes),
                      batches=list(batches), contexts=list(contexts), depth=depth, verify=verify, round=whole, meta=meta)
    rounds = max(1, min(OVERHEAD_ROUNDS, engine.max_context - SHORT_ROUNDS - 3))  # a small context: fewer rounds
    ctx = max(1, min(contexts[0], engine.max_context - rounds - SHORT_ROUNDS - 2))
    first = SpecConfig(shape="tree", depth=1, topk=max(widths), num_nodes=1)  # depth 0 alone, one node verified
    overhead, extra = [], []
    for b in batches:
        verify = table.verify_ms(b, ctx)
        plain = decode_round_ms(engine, b, ctx, rounds)
        overhead.append(max(0.0, plain - float(verify[0])))
        extra.append(max(0.0, decode_round_ms(engine, b, ctx, rounds, spec=first) - plain - float(verify[1] - verify[0])))
    table.overhead = torch.tensor(overhead, dtype=torch.float64)
    table.round_extra = torch.tensor(extra, dtype=torch.float64)
    table.meta["overhead"] = (f"plain decode rounds at ctx {ctx} (engine.generate; a long run less a short one) less "
                              "the timed plain step")
    table.meta["round_extra"] = (f"fixed depth-1 rounds (top-{max(widths)}, one node verified) at ctx {ctx}, decoded "
                                 "as the overhead's, less the plain rounds and the verify forwards' difference")
    if log is not None:
        log("host ms a round " + "  ".join(f"b {b}: {t:.3f}" for b, t in zip(batches, overhead))
            + "   depth 0 as served " + "  ".join(f"b {b}: {t:.3f}" for b, t in zip(batches, extra)))
    return table


def decode_round_ms(engine, b: int, ctx: int, rounds: int = OVERHEAD_ROUNDS, spec=None) -> float:
    """The wall time (ms) of one decode round of ``b`` rows after ``ctx`` tokens, through ``engine.generate``
    (plain, or with the fixed shape ``spec``; its rounds as the engine counts them):
    after a warm-up run (graph captures, compiles), a run of ``SHORT_ROUNDS`` new tokens and one of
    ``SHORT_ROUNDS + rounds``, their wall-time difference over their difference in rounds (the median of
    3 such pairs), so what a ``generate`` call pays once -- its set-up, the prefill, the results -- cancels out.
    (Dividing one run's wall time less its prefill by its rounds left 8-13 ms of a call's set-up in 24 rounds:
    0.2-0.5 ms a round too much on an H100 against the plain rounds a bench then timed, 2-4x the host's real
    time a round, which made every speculating round look relatively cheaper to the controller.) Random prompts from a fixed
    seed: every tensor-parallel rank decodes the same ones."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, engine.decoder.vocab_size, (b, max(ctx, 1)), generator=g).tolist()

    def run(new_tokens: int) -> tuple[float, int]:
        rounds, t0 = engine.decode_rounds, time.perf_counter()
        engine.generate(prompts, max_new_tokens=new_tokens, concurrency=b, ignore_eos=True, spec=spec)
        return time.perf_counter() - t0, engine.decode_rounds - rounds

    run(SHORT_ROUNDS)
    per_round = []
    for _ in range(3):
        (short_s, short_rounds), (long_s, long_rounds) = run(SHORT_ROUNDS), run(SHORT_ROUNDS + rounds)
        per_round.append(1e3 * (long_s - short_s) / max(1, long_rounds - short_rounds))
    return statistics.median(per_round)


__all__ = ["OVERHEAD_ROUNDS", "SHORT_ROUNDS", "TIMERS", "decode_round_ms", "depth_fn", "eager_ms", "graph_ms", "round_fn", "graph_replay",
           "profile_costs", "profile_rows_needed", "verify_fn", "wall_ms"]
