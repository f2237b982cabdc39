"""Where a speculation round's time goes (GPU): each phase as its own CUDA graph, against a plain step.

Builds the controlled-acceptance pair of ``tools/bench_runtime_efficiency.py`` at a shape, gives
``--batch`` rows ``--ctx`` committed tokens, and captures one CUDA graph per phase of
``runtime.steps.speculate`` on the same inputs:

    plain      one plain decode step (the unit)
    round      the whole round (draft + verify + accept/compact + catch-up), as the engine runs it
    draft      ``drafting.draft_round``: every drafter forward, head and top-k, the tree bookkeeping
    verify     the target forward over the drafted tree + the argmax of every node
    catch_up   the drafter's step-0 forward over the D + 1 committed positions
    head       one depth's head inside ``draft``: the greedy chain's scoreless argmax, the tree's log-softmax + top-k

``--spec controller`` adds the draft controller's ahead-mode round of the tree's own shape (planned depth
``--depth``, width ``--num-nodes``; issue 14; ``--controller-shape chain``: a chain's, against ``chain.round``),
planning as the runtime does by default (``plan_averages``): ``controller.round`` against ``tree.round`` is
what controlling costs a round, split into ``controller.draft`` (the tree drafted with every depth's frontier, and the next
round's decision: one Triton kernel) and ``controller.observe`` (the calibration's update after verification).

Each graph is replayed 50 times (median, CUDA events) and its eager run is profiled once for the
kernel count and the top kernels by time (in the JSON). ``--timeline`` also traces one replay of each
graph: the time its kernels run against the idle time between them, and the largest gaps. Every phase
also reports ``device_ms`` (its replay with the launch hidden behind a queued sleep: the graph's own
execution) and ``graph_nodes`` (its nodes by type, through cuda-bindings).
``round - (draft + verify + catch_up)`` is the acceptance, compaction and glue.

    python tools/profile_round.py --shape qwen3-8b --batch 1 --ctx 512 --spec chain --depth 5 \\
        --json docs/bench/round_profile_qwen3_8b_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))


def graph_ms(fn, replays: int = 50) -> tuple[float, torch.cuda.CUDAGraph]:
    """(Median replay time of ``fn`` captured in a CUDA graph, the graph with its cudaGraph_t kept:
    ``graph_nodes`` reads it); the profiler's own timing (``torchspec.runtime.cost_profile``)."""
    from torchspec.runtime.cost_profile import graph_replay

    return graph_replay(fn, replays, keep_graph=True)


def device_ms(graph: torch.cuda.CUDAGraph, replays: int = 50, sleep_us: float = 2000.0) -> float:
    """Median replay time with the launch hidden: a sleep kernel queued first keeps the GPU busy while
    the host launches, so the events bracket the graph's own execution only. ``graph_ms`` minus this
    is what launching costs an idle GPU (host launch time, graph upload, first-kernel delay)."""
    cycles = int(sleep_us * 2000)  # ~2 GHz SM clock; the sleep only has to outlast the launch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        torch.cuda._sleep(cycles)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


GRAPH_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child_graph", 5: "empty",
                    6: "wait_event", 7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait",
                    10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}


def graph_nodes(graph: torch.cuda.CUDAGraph) -> dict[str, int]:
    """Node count of a captured graph by node type (kernel, memcpy, memset, ...), read from its
    cudaGraph_t through cuda-bindings; {} where cuda-bindings is not installed. Memcpy and memset
    nodes run outside the kernel stream order's fast path (copy engine, driver work), so a graph whose
    event time exceeds its kernels' span is checked here first."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return {}
    handle = cudart.cudaGraph_t(init_value=graph.raw_cuda_graph())
    err, _, count = cudart.cudaGraphGetNodes(handle, 0)
    assert err == cudart.cudaError_t.cudaSuccess, err
    err, nodes, count = cudart.cudaGraphGetNodes(handle, count)
    assert err == cudart.cudaError_t.cudaSuccess, err
    kinds: dict[str, int] = {}
    for node in nodes[:count]:
        err, kind = cudart.cudaGraphNodeGetType(node)
        assert err == cudart.cudaError_t.cudaSuccess, err
        name = GRAPH_NODE_TYPES.get(int(kind), str(int(kind)))
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


def replay_timeline(graph: torch.cuda.CUDAGraph, top: int = 8) -> dict:
    """One replay of ``graph`` traced kernel by kernel (CUPTI sees the kernels a graph launches): its span,
    the time kernels run, the idle time between them, and the ``top`` largest gaps with their neighbours;
    and the host time of the launch call alone. A replay timed by events much longer than its span spends
    the difference before its first kernel or after its last (launch, upload), not between kernels.
    Graphs with memset nodes read long idle gaps under the profiler (CUPTI's own cost): trust their events."""
    from torch.profiler import ProfilerActivity, profile

    launch = []  # host time of the launch call alone (the GPU waits for it when the stream is idle)
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        launch.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return {"kernels": 0}
    gaps, end = [], spans[0][1]  # end: the latest end so far (kernels may overlap)
    for (_, _, prev), (start, stop, name) in zip(spans, spans[1:]):
        gaps.append((max(0.0, start - end), prev, name))
        end = max(end, stop)
    busy = sum(stop - start for start, stop, _ in spans)
    gaps.sort(key=lambda g: -g[0])
    return {"kernels": len(spans), "span_us": end - spans[0][0], "busy_us": busy,
            "launch_us": sorted(launch)[len(launch) // 2],
            "idle_us": sum(g[0] for g in gaps), "mean_gap_us": sum(g[0] for g in gaps) / max(1, len(gaps)),
            "top_gaps": [{"us": g, "after": a[:80], "before": b[:80]} for g, a, b in gaps[:top]]}


def kernel_profile(fn, top: int = 12) -> tuple[int, list[dict]]:
    """(CUDA kernels one eager call of ``fn`` launches, its ``top`` kernels by time: name, ms, count)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name, [0.0, 0])
        entry[0] += e.device_time / 1e3
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return len(kernels), [{"name": k, "ms": v[0], "count": v[1]} for k, v in ranked]


def batch_phases(engine, args, b: int, params) -> dict:
    """The phases of a round at batch ``b`` (plain step, then per shape: round, draft, verify, catch-up,
    head), each a no-argument callable over the same live-looking inputs."""
    from torchspec.runtime.drafting import DraftInputs, SpecConfig, _top, draft_round
    from torchspec.runtime.paged_kv import build_attention_meta
    from torchspec.runtime.steps import catch_up_drafter, plain_step, speculate, target_attend

    dev, vocab = torch.device("cuda"), engine.decoder.vocab_size
    runner, caches = engine.runner, engine.caches
    aux_ids = tuple(runner.config.aux_layer_ids)
    bt = engine.block_table[:b, :engine.table_columns_for(args.ctx + 64)]  # the columns the engine's round reads
    ctx = torch.full((b,), args.ctx, dtype=torch.long, device=dev)
    valid = torch.ones(b, dtype=torch.bool, device=dev)
    root = torch.randint(0, vocab, (b,), device=dev)
    inp = DraftInputs(root=root, normed=engine.normed[:b], feedback=engine.feedback[:b], ctx_len=ctx,
                      block_table=bt, row_valid=valid)
    phases = {"plain": lambda: plain_step(engine.decoder, caches, bt, ctx, root, valid, params, None)}
    for shape in args.spec.split(","):
        if shape == "controller":
            phases.update(controller_phases(engine, args, inp, params))
            continue
        spec = SpecConfig(shape=shape, depth=args.depth, topk=args.topk, num_nodes=args.num_nodes)
        tree = draft_round(runner, caches.drafter, inp, spec, params, None)

        def verify(tree=tree, spec=spec):
            meta = build_attention_meta(bt, ctx, tree.attention_mask(spec.depth), caches.page_size, row_valid=valid)
            out = engine.decoder(tree.tokens, ctx[:, None] + tree.depths, target_attend(caches, meta, None, valid),
                                 capture_layers=aux_ids)
            return engine.decoder.argmax(out.hidden), out.aux

        _, aux = verify()
        width = spec.depth + 1
        emitted = torch.randint(0, vocab, (b, width), device=dev)
        aux_path = [a[:, :width].contiguous() for a in aux]
        last = torch.full((b,), spec.depth, dtype=torch.long, device=dev)
        k = 1 if shape == "chain" else spec.topk
        frontier = engine.normed[:b, None].expand(b, k, -1).contiguous()
        # the head one depth runs: the greedy chain's scoreless argmax, the tree's top-k with scores
        head = ((lambda frontier=frontier: runner.best_candidate(frontier)) if shape == "chain" else
                (lambda frontier=frontier, k=k: _top(runner, frontier, k, params)))
        phases.update({
            f"{shape}.round": lambda spec=spec: speculate(engine.decoder, runner, caches, inp, spec, params, None),
            f"{shape}.draft": lambda spec=spec: draft_round(runner, caches.drafter, inp, spec, params, None),
            f"{shape}.verify": verify,
            f"{shape}.catch_up": lambda aux_path=aux_path, emitted=emitted, last=last: catch_up_drafter(
                runner, caches, bt, ctx, emitted, aux_path, last, valid),
            f"{shape}.head": head,
        })
    return phases


def controller_phases(engine, args, inp, params) -> dict:
    """The controller's ahead-mode round of the tree's shape and its two added parts (module docstring); its
    costs are synthetic (a depth 0.1 ms, verifying n nodes 1 + 0.01 n ms): the decision's work does not depend
    on them."""
    from torchspec.runtime.calibration import Calibration
    from torchspec.runtime.controlled_rounds import draft_ahead_tree
    from torchspec.runtime.drafting import SpecConfig
    from torchspec.runtime.plan_averages import AVERAGED, plans_how
    from torchspec.runtime.round_costs import RoundCosts
    from torchspec.runtime.steps import speculate

    dev, b = inp.root.device, inp.root.shape[0]
    spec = SpecConfig(shape=args.controller_shape, depth=args.depth, topk=args.topk, num_nodes=args.num_nodes)
    cal = Calibration(dev)
    costs = RoundCosts(torch.full((args.depth,), 0.1, device=dev),
                       1 + 0.01 * torch.arange(args.num_nodes + 1.0, device=dev), cal, plan=(args.depth, args.num_nodes))
    if plans_how() in AVERAGED:  # the runtime's default: plans from the averaged table, folded by the kernel
        costs.averages_key = (spec.shape, args.depth, args.num_nodes + 1)
    draft_ahead_tree(engine.runner, engine.caches.drafter, inp, spec, costs)
    pending = cal.pending.clone()
    accepted = torch.full((b,), 2, dtype=torch.long, device=dev)
    ranks = torch.arange(args.depth, device=dev).expand(b, args.depth).contiguous()

    def observe():
        cal.pending = pending
        cal.observe(accepted, ranks, inp.row_valid)

    return {"controller.round": lambda: speculate(engine.decoder, engine.runner, engine.caches, inp, spec, params,
                                                  None, costs=costs),
            "controller.draft": lambda: draft_ahead_tree(engine.runner, engine.caches.drafter, inp, spec, costs),
            "controller.observe": observe}


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--spec", default="chain,tree", help="chain, tree and/or controller")
    p.add_argument("--controller-shape", choices=["tree", "chain"], default="tree",
                   help="what --spec controller drafts: the tree's shape, or a chain (high concurrency's)")
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--num-nodes", type=int, default=16)
    p.add_argument("--head-rank", type=int, default=128, help="drafter scorer rank; 0 = full head")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--top-kernels", type=int, default=12, help="kernels by time kept per phase in the JSON")
    p.add_argument("--attn-chunk-rule", choices=["auto", "bandwidth"], default="auto",
                   help="bandwidth: plan attention splits as if no partials fit in L2 (the rule before one-tile "
                        "splits for small grids), to compare both in one call")
    p.add_argument("--timeline", action="store_true",
                   help="trace one replay of every phase's graph: busy vs idle time and the largest gaps (JSON)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from torchspec.runtime.attention_plan import bandwidth_split_rule

    rule = bandwidth_split_rule() if args.attn_chunk_rule == "bandwidth" else contextlib.nullcontext()
    with rule:  # for the whole run: every graph is captured under it
        profile(args)


def profile(args) -> None:
    """Build the pair, profile every phase at every batch size, print the table, write ``--json``."""
    from bench_runtime_efficiency import build_engine, set_noise

    from torchspec.runtime.sampling import SamplingParams

    batches = [int(x) for x in args.batch.split(",")]
    engine = build_engine(args.shape, 0.1, max(batches), args.ctx + 256, 0, "cuda", head_rank=args.head_rank,
                          layers=args.layers)
    set_noise(engine, 0.0)
    params = SamplingParams()
    vocab = engine.decoder.vocab_size
    prompts = torch.randint(0, vocab, (max(batches), 16)).tolist()
    engine.generate(prompts, max_new_tokens=4, ignore_eos=True)  # loads kernels, compiles the fused ops
    for i in range(max(batches)):  # live-looking rows: pages for ctx + a round
        pages = engine.allocator.alloc(-(-(args.ctx + 64) // engine.page_size))
        engine.block_table[i, : len(pages)] = torch.tensor(pages)
    rows = []
    print(f"{torch.cuda.get_device_name()}  shape {args.shape}  ctx {args.ctx}  head rank {args.head_rank}")
    for b in batches:
        phases = batch_phases(engine, args, b, params)
        plain_ms = None
        for name, fn in phases.items():
            (ms, graph), (kernels, top) = graph_ms(fn), kernel_profile(fn, args.top_kernels)
            dev_ms, nodes = device_ms(graph), graph_nodes(graph)
            plain_ms = plain_ms or ms
            row = {"batch": b, "phase": name, "ms": ms, "plain_steps": ms / plain_ms, "kernels": kernels,
                   "device_ms": dev_ms, "graph_nodes": nodes, "top_kernels": top}
            line = (f"b={b:<3} {name:<16} {ms:8.3f} ms  {ms / plain_ms:5.2f} plain steps  {kernels:6d} kernels  "
                    f"launch hidden {dev_ms:7.3f} ms  nodes {nodes}")
            if args.timeline:
                row["timeline"] = t = replay_timeline(graph)
                if t["kernels"]:
                    line += (f"  replay: {t['kernels']} kernels, busy {t['busy_us'] / 1e3:.3f} ms, idle "
                             f"{t['idle_us'] / 1e3:.3f} ms ({t['mean_gap_us']:.2f} us a gap), span {t['span_us'] / 1e3:.3f} ms, "
                             f"launch call {t['launch_us']:.0f} us")
            rows.append(row)
            print(line, flush=True)
    if args.json:
        out = {"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)


if __name__ == "__main__":
    main()
