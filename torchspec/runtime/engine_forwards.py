"""The engine's forwards: one prefill forward and one decode round, as functions of a ``SpeculativeEngine``.

``engine.py`` keeps the request API and the scheduling loop; this module turns one scheduling
decision into device work. ``prefill_forward`` runs the next chunk of each planned prompt in one
forward; ``decode_round`` runs one speculation round (or a plain step) over the decoding rows, under a
CUDA graph when the engine has them (every slot runs, the others as invalid rows, so one static shape
serves all rounds), and makes the round's one host sync: the committed count and tokens per row, and
the draft controller's plan for the next round riding on the same transfer.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from torchspec.runtime.controlled_drafting import PLAIN_ROUND
from torchspec.runtime.drafting import DraftInputs
from torchspec.runtime.sampling import RowSampling, SamplingParams
from torchspec.runtime.scheduler import host_to_device
from torchspec.runtime.steps import plain_step, plain_step_deferring_drafter, prefill, speculate

GREEDY = SamplingParams()


def round_sampling(engine, rows: list[int], active, greedy: bool) -> SamplingParams | RowSampling:
    """The round's settings: ``RowSampling`` over ``active`` (``rows`` keep theirs, the others are
    greedy), built on the host and sent by asynchronous copies (no sync)."""
    if greedy:
        return GREEDY
    slots, chosen = engine.scheduler.slots, set(rows)
    host = RowSampling.of([slots[i].request.sampling if i in chosen else GREEDY for i in active], "cpu")
    t, p, k = (host_to_device(x, x.dtype, engine.device) for x in (host.temperature, host.top_p, host.top_k))
    return RowSampling(t, p, k, greedy=host.greedy, filtered=host.filtered)


def prefill_forward(engine, plan: list[tuple[int, int]]) -> None:
    """One prefill forward: the next chunk of each planned slot's prompt [(slot, length)]."""
    t0 = time.perf_counter()
    sch, slots = engine.scheduler, engine.scheduler.slots
    b, width = len(plan), max(n for _, n in plan)
    rows = [i for i, _ in plan]
    lengths = [n for _, n in plan]
    ctx = [slots[i].ctx for i in rows]
    follow, ids = [], []
    for i, n in plan:
        s, prompt = slots[i], slots[i].request.prompt
        follow.append(prompt[s.ctx + n] if s.ctx + n < len(prompt) else -1)
        ids += prompt[s.ctx:s.ctx + n]
        ids += [0] * (width - n)
        sch.ensure_pages(i, s.ctx + n)
    sch.flush_table()
    cols = engine.table_columns_for(max(c + n for c, n in zip(ctx, lengths)))
    packed = host_to_device(rows + lengths + ctx + follow + ids, torch.long, engine.device)  # one copy
    index, lengths_d, ctx_d, follow_d = (packed[k * b:(k + 1) * b] for k in range(4))
    greedy = all(slots[i].request.sampling.greedy for i in rows)
    out = prefill(engine.decoder, engine.runner if engine.spec is not None else None, engine.caches,
                  engine.block_table[index, :cols], packed[4 * b:].view(b, width), lengths_d,
                  round_sampling(engine, rows, rows, greedy), engine.generator, slots=index, ctx=ctx_d,
                  next_tokens=follow_d)
    store_round(engine, index, out)
    if engine.caches.pending is not None:  # a new request's drafter entries are its prefill's
        engine.caches.pending.reset(index)
    first = out.root.tolist()
    dt = time.perf_counter() - t0
    for (i, n), tok, nxt in zip(plan, first, follow):
        sch.prefilled(i, n)
        slots[i].request.result.prefill_s += dt / len(plan)
        if nxt < 0:  # the prompt's last chunk: its first token
            sch.commit(i, [tok])


def store_round(engine, rows: torch.Tensor, out) -> None:
    engine.root[rows] = out.root
    if out.normed is not None:
        engine.normed[rows] = out.normed.to(engine.normed.dtype)
        engine.feedback[rows] = out.feedback.to(engine.feedback.dtype)


def round_label(engine, name: str, spec, costs) -> str:
    """The round's kind in ``engine.round_kinds``: a controller's decided plan ``d<depth>w<width>``, its held plan
    ``held d<depth>w<width>``, a sampled controlled round ``spec``, else the step's name."""
    if costs is not None:
        return f"d{costs.plan[0]}w{costs.plan[1]}" if costs.plan is not None else "spec"
    held = engine.controller.held if engine.controller is not None and spec is not None else None
    return f"held d{held[0]}w{held[1]}" if held else name


def decode_round(engine, rows: list[int], greedy: bool) -> None:
    """One decode round (speculation, or a plain step) over ``rows``; with CUDA graphs every slot
    runs, the others as invalid rows, so one static shape serves all rounds."""
    t0 = time.perf_counter()
    engine.decode_rounds += 1
    sch, spec = engine.scheduler, engine.spec
    slots = sch.slots
    per_round = engine._per_round(greedy)
    for i in rows:
        sch.ensure_pages(i, slots[i].ctx + per_round)  # allocates only when the round crosses into a new page
    sch.flush_table()
    if engine.graphs is not None:  # every slot runs (one static shape); row j is slot j
        active, chosen = range(sch.concurrency), set(rows)
        index = engine.slot_ids[: sch.concurrency]
        ctx = host_to_device([slots[i].ctx if i in chosen else -1 for i in active], torch.long, engine.device)
        valid = ctx >= 0
        ctx = ctx.clamp(min=0)
        position = rows  # of row i in the round's outputs
    else:
        active = rows
        packed = host_to_device(rows + [slots[i].ctx for i in rows], torch.long, engine.device)
        index, ctx = packed[: len(rows)], packed[len(rows):]
        valid = torch.ones(len(rows), dtype=torch.bool, device=engine.device)
        position = range(len(rows))
    longest = max(slots[i].ctx for i in rows)
    cols = engine.table_columns_for(longest + per_round)
    bt = engine.block_table[index, :cols]
    params = round_sampling(engine, rows, active, greedy)
    kind = round_kind(params)
    costs = None
    if spec is not None and engine.controller is not None:  # the round's shape and costs at its batch and context
        if engine.graphs is not None:  # every shape the controller may plan here, captured before any runs
            capture_round_shapes(engine, params, kind, index, bt, longest)
        spec, costs = engine.controller.plan(params, len(active), longest)
    deferring = costs is not None and costs.plan == PLAIN_ROUND  # a controller's plain round: a plain step's inputs
    if deferring:
        spec, costs = None, None
    name, step = round_step(engine, spec, costs, deferring)
    args = round_args(engine, name, index, ctx, valid, bt, params, costs)
    label = round_label(engine, name, spec, costs)
    key = round_key(name, len(active), spec, kind, cols, costs)
    stateful = deferring or costs is not None  # deferred drafter entries, the calibration's evidence
    out = step(**args) if engine.graphs is None else run_graph(engine, key, step, args, stateful)
    store_round(engine, index, out)
    committed = out.synced.tolist()  # the round's one host sync (the controller's plan: a padded last row)
    if engine.controller is not None:
        plan = committed.pop() if out.plan is not None else None
        engine.controller.after(costs, plan, sum(committed[j][0] for j in position), len(rows))
    dt = time.perf_counter() - t0
    tally = engine.round_kinds.setdefault(label, [0, 0.0])  # the round's wall time, host sync included
    tally[0], tally[1] = tally[0] + 1, tally[1] + dt
    kept = 0
    for i, j in zip(rows, position):
        count, *tokens = committed[j]
        s = slots[i]
        s.ctx += count
        result = s.request.result
        result.decode_s += dt
        result.accept_lengths.append(sch.commit(i, tokens[:count]))  # a stop or the limit may cut the round
        kept += result.accept_lengths[-1]
    if len(rows) == sch.concurrency:  # every slot live: a steady-state round (engine.full_rounds)
        full = engine.full_rounds
        full[0], full[1], full[2] = full[0] + 1, full[1] + dt, full[2] + kept


def round_kind(params) -> str:
    """A round's kind of sampling in its graph key (host-side, static): every row greedy, or a mixed batch with or
    without a top-k / top-p row."""
    return "greedy" if params.greedy else "mixed-filtered" if params.filtered else "mixed"


def round_step(engine, spec, costs, deferring: bool):
    """(the round's name, its step function): a plain step ("plain"; "plain-deferring": a controller's plain
    round, its drafter entry deferred to the next drafting round, ``pending_drafter.py``) or a round of
    ``spec`` ("spec"; ``costs``: a controller's, graph inputs)."""
    generator = engine.generator if engine.graphs is None else None  # graphed steps draw from the CUDA default
    if spec is None or deferring:
        def step(bt, ctx, root, valid, slots, params):
            if deferring:
                return plain_step_deferring_drafter(engine.decoder, engine.runner, engine.caches, bt, ctx, root, valid,
                                                    slots)
            return plain_step(engine.decoder, engine.caches, bt, ctx, root, valid, params, generator, slots=slots)
        return ("plain-deferring" if deferring else "plain"), step

    def step(inp, slots, params, costs):  # costs: graph inputs (the table's row for this batch and context)
        return speculate(engine.decoder, engine.runner, engine.caches, inp, spec, params, generator, slots=slots,
                         costs=costs)
    return "spec", step


def round_args(engine, name: str, index, ctx, valid, bt, params, costs) -> dict:
    """The inputs of ``round_step``'s step over the rows ``index`` (committed ``ctx``, live ``valid``)."""
    if name != "spec":
        return {"bt": bt, "ctx": ctx, "root": engine.root[index], "valid": valid, "slots": index, "params": params}
    return {"inp": DraftInputs(root=engine.root[index], normed=engine.normed[index], feedback=engine.feedback[index],
                               ctx_len=ctx, block_table=bt, row_valid=valid),
            "slots": index, "params": params, "costs": costs}


def round_key(name: str, batch: int, spec, kind: str, cols: int, costs) -> tuple:
    """A round's CUDA graph key: what its static shapes and captured addresses depend on."""
    return name, batch, spec, kind, cols, costs and (costs.plan, costs.flush, costs.calibration.serial,
                                                     costs.averages_key is not None)  # plans averaged or the last's


def capture_round_shapes(engine, params, kind: str, index, bt, longest: int) -> int:
    """Capture, once per (padded batch, kind of round, table columns, controller shape, calibration), the graph
    of every round the draft controller may plan there (``Controller.round_shapes``, and a greedy plain round
    deferring its drafter entry), on idle rows (nothing written): the rounds that follow only replay. Capturing
    them as they were first planned put rare shapes' captures (~50 ms each) inside timed runs and served
    requests (docs/results.md, twenty-second session). -> graphs captured now."""
    ctl, batch, cols = engine.controller, index.shape[0], bt.shape[1]
    base = ctl._base(batch) if params.greedy else ctl.spec
    family = (batch, kind, cols, base, ctl.calibration.serial, ctl.plans)
    if family in engine.captured_shapes:
        return 0
    engine.captured_shapes.add(family)
    ctx = torch.zeros(batch, dtype=torch.long, device=engine.device)
    valid = torch.zeros(batch, dtype=torch.bool, device=engine.device)
    rounds = ctl.round_shapes(params, batch, longest)
    if params.greedy and rounds:
        rounds.append((None, None))  # the plain rounds of a width-0 plan
    before = len(engine.graphs)
    for spec, costs in rounds:
        deferring = spec is None
        name, step = round_step(engine, spec, costs, deferring)
        key = round_key(name, batch, spec, kind, cols, costs)
        if key not in engine.graphs:
            engine.graphs.capture(key, step, round_args(engine, name, index, ctx, valid, bt, params, costs))
    return len(engine.graphs) - before


STEADY = frozenset({"costs"})  # graph inputs a step only reads: copied when they change (graphs.StepGraphs.run)


def run_graph(engine, key, step, args: dict, stateful: bool):
    """``graphs.run``; a hybrid target's graph, and a ``stateful`` round's (a controller's: its deferred drafter
    entries, the calibration's evidence), are captured on idle inputs (every row invalid), so the warm-up runs
    commit no state (``graphs.py``)."""
    idle = stateful or engine.caches.recurrent is not None
    return engine.graphs.run(key, step, args, capture_inputs=_all_rows_invalid if idle else None, steady=STEADY)


def _all_rows_invalid(args: dict) -> dict:
    """A step's inputs with every row invalid: running it writes nothing (CUDA-graph warm-ups)."""
    idle = dict(args)
    if "valid" in idle:
        idle["valid"] = torch.zeros_like(args["valid"])
    else:
        idle["inp"] = dataclasses.replace(args["inp"], row_valid=torch.zeros_like(args["inp"].row_valid))
    return idle
