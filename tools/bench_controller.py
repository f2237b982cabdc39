"""The draft controller against the best fixed shape a sweep finds, and against no speculation (issue 14).

For each drafter and concurrency the same engine decodes the same prompts plainly, with every fixed
shape of the sweep (``--chains`` depths, ``--trees`` depth x topk x nodes), and with the controller
(``engine.generate(..., controller=table)``) choosing each greedy round's depth and width within the
sweep's largest tree. The best fixed shape and the controller are then timed again in ``--repeats``
pairs with plain decoding (``recipes.bench.paired_timings``: the speedups quoted are those medians).
The cost table comes from ``--costs`` (``torchspec-profile``; refused if its key is another setup's) or,
without it, is measured here first on the same engine (``torchspec.runtime.cost_profile``) and written
to ``--costs-out``.

Drafters: the controlled-acceptance pair of ``tools/bench_runtime_efficiency.py`` at ``--shape``, one
drafter per ``--noise`` value (``untrained``: a drafter that agrees with nothing, ~0 acceptance), or a
real target with exported drafters (``--target``, ``--drafter name=path``; ``untrained`` there too).

``--controller-mode ahead`` (the default) plans each round's shape in the round before, on the GPU, so
every run here (plain, fixed, controller) serves with CUDA graphs on CUDA, and the table measured here is
graph-timed; ``within`` decides after every depth on the host, so every run goes without graphs and the
table is eager-timed (``"cuda_graphs"`` in the JSON says which): compare rows of one file. Rows (``--out``,
JSON, atomic, rewritten after each row) hold ``drafter, target, mode, concurrency, requests, temperature, speedup,
acceptance``, the best fixed shape and its speedup beside the controller's, the controller's (depth, width)
decisions, the graphs its timed runs still had to capture (planned shapes the warm-up runs never saw: each
capture is in the timing), the same controller drafting a chain (k = 1), and with ``--also-plans`` the controller
planning its rounds another way too (``also_plans_speedup``: "average", from recent rounds' ratings,
``torchspec/runtime/plan_averages.py``; "held", averaged and a repeated plan held undecided for a few rounds; or
"last", the last round's alone; ``plans``: the runtime's default), and
``priced``: every run's speedup priced per round, without the run's tail or prefill (``price_controller_rounds.py``;
an upper bound on the measured speedup at c > 1); ``chain_from_batch`` per drafter is the
concurrency from which the chain wins -- priced a round in a closed batch, measured where slots were refilled
(``chain_from_batch_basis``) -- the engine's ``chain_from_batch``, the table the issue asks to measure per setup.

    python tools/bench_controller.py --shape smollm2-135m --noise 0.0,0.3,untrained --concurrency 1,8,64 \\
        --out docs/bench/controller_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
from collections import Counter
from functools import partial

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from price_controller_rounds import priced_fields  # noqa: E402

from recipes.bench import csv_values, measure, paired_fields, paired_timings, steady_ratio  # noqa: E402
from torchspec.cli import check_at_least, user_errors  # noqa: E402
from torchspec.io import atomic_write_text  # noqa: E402
from torchspec.runtime.controller_policy import SCALE_ONE  # noqa: E402
from torchspec.runtime.drafting import SpecConfig  # noqa: E402
from torchspec.runtime.plan_averages import PLANS, PLANS_ENV, plans_how  # noqa: E402
from torchspec.runtime.sampling import SamplingParams  # noqa: E402

UNTRAINED_NOISE = 50.0  # eh_proj noise that leaves the controlled drafter agreeing with nothing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", help="controlled pair shape (tools/bench_runtime_efficiency.py)")
    p.add_argument("--noise", default="0.0,untrained", help="controlled drafters: eh_proj noise values or 'untrained'")
    p.add_argument("--target", help="a real target instead of the controlled pair (dir | .gguf | alias)")
    p.add_argument("--drafter", action="append", default=[],
                   help="name=export (repeatable); untrained=export: that architecture re-initialised (training's step 0)")
    p.add_argument("--prompt-set", help="with --target: prompts of a set (mtbench, humaneval, a file), chat-rendered; "
                                        "default: random tokens (the controlled pair's only choice)")
    p.add_argument("--cache-dir", default="~/.cache/torchspec", help="where a .gguf target is converted once")
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--chains", default="1,2,3,4,5,6", help="fixed chain depths of the sweep")
    p.add_argument("--trees", default="3x4x8,4x4x16,5x8x32", help="fixed greedy trees of the sweep: DxKxN")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=16,
                   help="prompts a timed run decodes (at least the concurrency): c = 1 is not one prompt's luck")
    p.add_argument("--requests-per-slot", type=int, default=1, metavar="R",
                   help="a timed run at concurrency c decodes max(R * c, --num-prompts) requests: with 1 every slot "
                        "runs one request and the run lasts as long as its slowest rows (a closed batch); with 4 "
                        "each slot is refilled, as a serving engine's are, and that tail is amortised")
    p.add_argument("--repeats", type=int, default=3, help="paired re-timings of the best fixed shape and the controller")
    p.add_argument("--costs", help="a torchspec-profile table of this setup (default: measure it here)")
    p.add_argument("--costs-out", help="where a table measured here is written (default: beside --out)")
    p.add_argument("--chain-from-batch", type=int, default=None, metavar="N",
                   help="the controller's rows draft a chain at concurrency N or more (default: the cost table's "
                        "chain_from_batch; the tree throughout if it has none); the 'as a chain' rows always do")
    p.add_argument("--controller-mode", default="ahead", choices=["ahead", "within"],
                   help="ahead: planned a round before, with CUDA graphs; within: per depth on the host, no graphs")
    p.add_argument("--also-plans", choices=PLANS, default=None,
                   help="ahead mode: also time the controller with these plans (TORCHSPEC_CONTROLLER_PLANS: "
                        "'average', from recent rounds' ratings, plan_averages.py; 'held', averaged and a repeated "
                        "plan held undecided for a few rounds, the default; 'last', the last round's alone) beside "
                        "the runtime's default")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--debug", action="store_true")
    return p


def parse_tree(text: str, flag: str = "--trees entry") -> SpecConfig:
    try:
        d, k, n = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"{flag} {text!r} must read DEPTHxTOPKxNODES, e.g. 5x8x32") from None
    spec = SpecConfig(shape="tree", depth=d, topk=k, num_nodes=n)
    spec.validate()
    return spec


def check_args(args) -> dict:
    """Every option before a model loads."""
    for flag, v in (("--max-new-tokens", args.max_new_tokens), ("--repeats", args.repeats),
                    ("--prompt-len", args.prompt_len), ("--num-prompts", args.num_prompts),
                    ("--requests-per-slot", args.requests_per_slot)):
        check_at_least(flag, v, 1)
    chains = [SpecConfig(shape="chain", depth=d) for d in csv_values("--chains", args.chains, int)]
    for c in chains:
        c.validate()
    trees = [parse_tree(t) for t in csv_values("--trees", args.trees)]
    levels = csv_values("--concurrency", args.concurrency, int)
    if min(levels) < 1:
        raise ValueError(f"--concurrency={args.concurrency!r}: every level must be >= 1.")
    controlled = SpecConfig(shape="tree", depth=max(s.depth for s in trees), topk=max(s.topk for s in trees),
                            num_nodes=max(s.num_nodes for s in trees))
    controlled.validate()
    if args.prompt_set and not args.target:
        raise ValueError("--prompt-set needs --target (the controlled pair has no tokenizer: random tokens).")
    if args.target and not args.drafter:
        raise ValueError("--target needs at least one --drafter name=export (untrained=export for an untrained one).")
    for pair in args.drafter:
        if "=" not in pair or not pathlib.Path(pair.partition("=")[2]).is_dir():
            raise ValueError(f"--drafter {pair!r} must read name=<export dir> with an existing export dir.")
    if args.chain_from_batch is not None:
        check_at_least("--chain-from-batch", args.chain_from_batch, 1)
    if args.costs and not pathlib.Path(args.costs).is_file():
        raise ValueError(f"--costs {args.costs} does not exist; run torchspec-profile first or leave --costs out.")
    if args.costs:
        check_costs_cover(args.costs, levels)
    if args.also_plans is not None and args.also_plans == plans_how():
        raise ValueError(f"--also-plans {args.also_plans} is how the runtime plans already "
                         f"({PLANS_ENV}={plans_how()!r}); choose one of {[p for p in PLANS if p != plans_how()]}.")
    return {"shapes": chains + trees, "levels": levels, "controlled": controlled,
            "noise": [] if args.target else csv_values("--noise", args.noise)}


def check_costs_cover(path: str, levels: list[int]) -> None:
    """A ``--costs`` table must have measured every ``--concurrency``: a level between or below its batches is
    priced from other batches' costs (``cost_table``'s lookups), and the controller's row would then measure
    that pricing, not the controller (a table of batches 8 and 64 priced c = 1's 32-node verify ~40% dear on an
    H200 and the controller verified 16 nodes in a third of its rounds: docs/results.md, thirty-first session).
    A file that does not parse is left to ``CostTable.load``, which names what is wrong with it."""
    try:
        batches = json.loads(pathlib.Path(path).read_text()).get("batches")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(batches, list):
        missing = [c for c in levels if c not in batches]
        if missing:
            raise ValueError(f"--costs {path} measured batches {batches}, not --concurrency {missing}; profile them "
                             f"(torchspec-profile --batches {','.join(map(str, sorted({*batches, *missing})))}) or "
                             f"leave --costs out to measure this run's.")


def engines(args, checked: dict, max_batch: int, max_context: int):
    """(drafter name, engine) pairs, built one at a time (graphs as the controller mode serves: module docstring)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    graphs = torch.device(device).type == "cuda" and args.controller_mode == "ahead"
    if args.target is None:
        from bench_runtime_efficiency import build_engine, set_noise

        engine = build_engine(args.shape, 0.3, max_batch, max_context, args.seed, device=device, cuda_graphs=graphs)
        for noise in checked["noise"]:
            set_noise(engine, UNTRAINED_NOISE if noise == "untrained" else float(noise), args.seed)
            engine.drafter_changed()  # a new drafter: the last one's calibration would misread this one
            yield ("untrained" if noise == "untrained" else f"controlled_noise{noise}"), engine
        return
    from torchspec.runtime.loading import load_engine

    for pair in args.drafter:
        name, _, path = pair.partition("=")
        untrained = name == "untrained"
        engine = load_engine(args.target, path, device=device, max_batch=max_batch, max_context=max_context,
                             cuda_graphs=graphs, fuse=not untrained, cache_dir=str(pathlib.Path(args.cache_dir).expanduser()))
        if untrained:  # the export's architecture at training step 0 (fused for serving after the re-init)
            untrain(engine.runner.model, args.seed)
            engine.decoder.fuse_for_serving()
            engine.runner.fuse_for_serving()
        yield name, engine


@torch.no_grad()
def untrain(model, seed: int) -> None:
    """A drafter as training starts it: every module re-initialised by the model's own rule, except the
    embedding and LM head, which training copies from the target (``init_from_target``) and keeps."""
    torch.manual_seed(seed)
    for name, module in model.named_modules():
        if module is not model and not name.startswith(("lm_head", "embed_tokens")):
            model._init_weights(module)


def bench_prompts(args, engine, n: int, g: torch.Generator) -> list[list[int]]:
    """``n`` prompts: a chat-rendered set (repeated to ``n``, cut to ``--prompt-len`` tokens from the end, so
    every row starts alike) or random tokens."""
    if args.prompt_set:
        from torchspec.runtime.prompts import load_prompt_set, render_prompts

        ids = render_prompts(engine.tokenizer, load_prompt_set(args.prompt_set))
        return [p[-args.prompt_len:] for p in (ids * (1 + n // len(ids)))[:n]]
    return torch.randint(0, engine.decoder.vocab_size, (n, args.prompt_len), generator=g).tolist()


def cost_table(args, engine, controlled: SpecConfig, measured: dict | None = None):
    """``--costs``, else the table measured in this run for the same key (drafters of one architecture: a
    profile takes minutes of a GPU lease), else measured now and written beside ``--out``."""
    from torchspec.runtime.cost_profile import profile_costs
    from torchspec.runtime.cost_table import CostTable, cost_key

    key = cost_key(engine.decoder, engine.runner)
    if args.costs:
        return CostTable.load(args.costs, key)
    measured = {} if measured is None else measured
    if key in measured:
        return measured[key]
    n = controlled.num_nodes
    table = profile_costs(engine, batches=sorted(set(csv_values("--concurrency", args.concurrency, int))),
                          contexts=[args.prompt_len + args.max_new_tokens // 2], widths=sorted({1, controlled.topk}),
                          nodes=[m for m in (0, 1, 2, 4, 8, 16, 32, 48, 64) if m < n] + [n],
                          repeats=max(3, args.repeats), timing="graph" if engine.graphs is not None else "eager")
    table.save(args.costs_out or pathlib.Path(args.out).with_suffix(".costs.json"))
    measured[key] = table
    return table


def bench(args) -> dict:
    checked = check_args(args)
    levels, shapes, controlled = checked["levels"], checked["shapes"], checked["controlled"]
    g = torch.Generator().manual_seed(args.seed)
    mode = args.controller_mode
    chain = SpecConfig(shape="chain", depth=controlled.depth)  # the controller's k = 1 (chain_from_batch)
    rows, out, measured = [], {"controller_mode": mode, "args": vars(args), "rows": []}, {}
    for name, engine in engines(args, checked, max(levels), args.prompt_len + args.max_new_tokens + 160):
        prompts = bench_prompts(args, engine, max(max(levels) * args.requests_per_slot, args.num_prompts), g)
        table = cost_table(args, engine, controlled, measured)
        out["device"] = table.key.device
        out["costs_timing"] = table.meta.get("timing")
        out["cuda_graphs"] = engine.graphs is not None
        target = args.target or args.shape
        for c in levels:
            requests = max(c * args.requests_per_slot, args.num_prompts)
            run = partial(measure, engine, prompts[:requests], params=SamplingParams(),
                          max_new=args.max_new_tokens, seed=args.seed, concurrency=c)
            for spec in [None, *shapes]:  # compiles, captures the graphs
                engine.generate(prompts[:c], max_new_tokens=8, spec=spec, concurrency=c)
            warm_ups = [(controlled, None), (chain, None)] + ([(controlled, args.also_plans)] if args.also_plans else [])
            for spec, plans in warm_ups:  # each way of planning has its own graphs (the decision kernel's variant)
                if engine.graphs is not None:  # a whole run each, so no timed repeat captures a graph
                    print(f"warm-up c={c} {'chain' if spec is chain else 'tree'} plans={plans}", flush=True)
                    with plans_env(plans):  # its first round captures every shape it may plan (capture_round_shapes)
                        run(spec=spec, controller=table, controller_mode=mode,
                            chain_from_batch=args.chain_from_batch if spec is controlled else None)
            graphs_before = len(engine.graphs) if engine.graphs is not None else 0
            plain = run(spec=None)
            fixed = {_label(s): run(spec=s) for s in shapes}
            best = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
            best_spec = next(s for s in shapes if _label(s) == best)
            decisions, chain_decisions = Counter(), Counter()
            paired_best = paired_timings(partial(run, spec=None), partial(run, spec=best_spec), args.repeats)
            ctl_run = partial(run, chain_from_batch=args.chain_from_batch)  # None: the table's rule
            paired_ctl = paired_timings(partial(run, spec=None),
                                        partial(controller_run, ctl_run, engine, controlled, table, mode, decisions),
                                        args.repeats)
            paired_chain = paired_timings(partial(run, spec=None),
                                          partial(controller_run, run, engine, chain, table, mode, chain_decisions),
                                          args.repeats)
            also = Counter()
            if args.also_plans:
                with plans_env(args.also_plans):
                    paired_also = paired_timings(partial(run, spec=None), partial(controller_run, ctl_run, engine,
                                                 controlled, table, mode, also), args.repeats)
            rule = table.chain_from_batch if args.chain_from_batch is None else args.chain_from_batch
            rows.append({"drafter": name, "target": target, "mode": "controller", "concurrency": c, "requests": requests,
                         "temperature": 0.0,
                         **paired_fields(paired_ctl), "acceptance": paired_ctl["spec"]["mean_acceptance"],
                         "within": _label(controlled), "controller_chain_from_batch": rule,
                         "controller_drafts": "chain" if rule is not None and c >= rule else "tree",
                         "best_fixed": best,
                         "best_fixed_speedup": paired_best["speedup"],
                         "best_fixed_acceptance": paired_best["spec"]["mean_acceptance"],
                         "best_fixed_round_kinds": paired_best["spec"]["round_kinds"],
                         "controller_vs_best_fixed": paired_ctl["speedup"] / paired_best["speedup"],
                         "best_fixed_steady_speedup": paired_best["steady_speedup"],
                         "controller_vs_best_fixed_steady": steady_ratio(paired_ctl, paired_best),
                         "decisions": [[d, w, n] for (d, w), n in sorted(decisions.items())],
                         "calibration_at_end": paired_ctl["spec"]["calibration"],
                         "chain_controller_speedup": paired_chain["speedup"],
                         "chain_controller_acceptance": paired_chain["spec"]["mean_acceptance"],
                         "chain_decisions": [[d, w, n] for (d, w), n in sorted(chain_decisions.items())],
                         "plain_round_kinds": paired_ctl["plain"]["round_kinds"],
                         "round_kinds": paired_ctl["spec"]["round_kinds"],
                         "chain_round_kinds": paired_chain["spec"]["round_kinds"],
                         "plans": plans_how(),
                         **({"also_plans": args.also_plans, "also_plans_speedup": paired_also["speedup"],
                             "also_plans_speedup_repeats": paired_also["speedup_repeats"],
                             "also_plans_acceptance": paired_also["spec"]["mean_acceptance"],
                             "also_plans_decisions": [[d, w, n] for (d, w), n in sorted(also.items())],
                             "also_plans_round_kinds": paired_also["spec"]["round_kinds"]} if args.also_plans else {}),
                         "graphs_failed": sorted(map(str, engine.graphs.failed)) if engine.graphs is not None else [],
                         "graphs_captured_while_timed": (len(engine.graphs) - graphs_before
                                                         if engine.graphs is not None else 0),
                         "sweep": {k: {"speedup": v["tokens_per_s"] / plain["tokens_per_s"],
                                       "acceptance": v["mean_acceptance"]} for k, v in fixed.items()}})
            rows[-1]["priced"] = priced_fields(rows[-1])  # per round, as refilled slots see it (its module)
            print(format_row(rows[-1]), flush=True)
            print(format_kinds(rows[-1]), flush=True)
            out["rows"] = rows
            if all(r["controller_drafts"] == "tree" for r in rows):
                out["chain_from_batch"] = chain_from_batch(rows)
                out["chain_from_batch_basis"] = CHAIN_RULE_BASIS
            else:  # a rule in effect at some level: the tree controller was not timed there
                out.pop("chain_from_batch", None)
                out.pop("chain_from_batch_basis", None)
                out["chain_from_batch_note"] = "not measured: a chain rule was in effect (run without one to measure it)"
            write(args.out, out)
    return out


@contextlib.contextmanager
def plans_env(plans: str | None):
    """Ahead mode's plans (``plan_averages.PLANS``, through ``PLANS_ENV``; None: as set) for the runs inside."""
    before = os.environ.get(PLANS_ENV)
    if plans is None:
        yield
        return
    os.environ[PLANS_ENV] = plans
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PLANS_ENV)
        else:
            os.environ[PLANS_ENV] = before


CHAIN_RULE_BASIS = ("measured speedups where slots were refilled (requests >= 2 x concurrency) or at c = 1; "
                    "in a closed batch, speedups priced a round (price_controller_rounds.py)")


def chain_wins(row: dict) -> bool:
    """Whether the chain controller is at least as fast as the tree controller at ``row``'s level, as serving
    would see it (``CHAIN_RULE_BASIS``): a closed batch's measured speedups carry its tail, which a chain's
    deeper plans pay the most of, so there the rounds' priced speedups decide."""
    closed = row["concurrency"] > 1 and row.get("requests", row["concurrency"]) < 2 * row["concurrency"]
    if closed and "priced" in row:
        return row["priced"]["chain_controller"] >= row["priced"]["controller"]
    return row["chain_controller_speedup"] >= row["speedup"]


def chain_from_batch(rows: list[dict]) -> dict[str, int | None]:
    """Per drafter, the smallest concurrency from which the chain controller is at least as fast as the tree
    controller at every larger measured level (``chain_wins``; the engine's ``chain_from_batch``); None: the
    tree throughout."""
    out = {}
    for name in dict.fromkeys(r["drafter"] for r in rows):
        mine = sorted((r for r in rows if r["drafter"] == name), key=lambda r: r["concurrency"])
        wins = [chain_wins(r) for r in mine]
        first = next((i for i in range(len(mine)) if all(wins[i:])), None)
        out[name] = None if first is None else mine[first]["concurrency"]
    return out


def controller_run(run, engine, spec: SpecConfig, table, mode: str, decisions: Counter) -> dict:
    """``run`` with the controller; every generate starts its own trace, so each run's decisions are counted, and
    its calibration as the run left it (``calibration``: a plain run after it drops the engine's controller)."""
    result = run(spec=spec, controller=table, controller_mode=mode)
    decisions.update(engine.controller.trace)
    result["calibration"] = calibration_state(engine)
    return result


def calibration_state(engine) -> dict:
    """The engine's controller's calibration now: its exponent, each rank bucket's ratio (accepted / expected,
    before the cap) and the scale it applies -- how the widths it chose were rated -- and the decayed evidence
    behind each ratio (the accepted path's nodes and the verified nodes' expectation under that exponent, per
    bucket): a bucket the chosen widths seldom verify has little, and its ratio leans on the overall one."""
    cal = engine.controller.calibration
    alpha, scales = cal.choice()
    at, ratios = cal.ratios()
    return {"exponent": float(alpha), "ratio_by_rank": ratios.tolist(), "scale_by_rank": (scales / SCALE_ONE).tolist(),
            "accepted_by_rank": cal.accepted_by_rank.double().tolist(),
            "expected_by_rank": cal.expected_by_rank.index_select(0, at)[0].double().tolist()}


def _label(spec: SpecConfig) -> str:
    return f"chain{spec.depth}" if spec.shape == "chain" else f"tree{spec.depth}x{spec.topk}x{spec.num_nodes}"


def format_row(r: dict) -> str:
    return (f"{r['drafter']:<22} c={r['concurrency']:<3} controller x{r['speedup']:.2f} (acceptance "
            f"{r['acceptance']:.2f}), as a chain x{r['chain_controller_speedup']:.2f}  best fixed {r['best_fixed']} "
            f"x{r['best_fixed_speedup']:.2f}  ratio {r['controller_vs_best_fixed']:.2f}"
            + (f" (steady state {r['controller_vs_best_fixed_steady']:.2f})"
               if r.get("controller_vs_best_fixed_steady") is not None else "")
            + "  graphs captured while timed "
            f"{r['graphs_captured_while_timed']}  priced a round: ratio {r['priced']['controller_vs_best_fixed']:.2f}"
            + (f"  EAGER (capture failed): {r['graphs_failed']}" if r["graphs_failed"] else "")
            + (f"  plans {r['also_plans']} x{r['also_plans_speedup']:.2f} (acceptance {r['also_plans_acceptance']:.2f})"
               if "also_plans_speedup" in r else ""))


def format_kinds(r: dict) -> str:
    """Where the controller's time goes: each kind of round, its count and mean wall ms (plain's beside it)."""
    def kinds(name: str) -> str:
        return ", ".join(f"{k} {v['rounds']}x{v['ms']:.3f}" for k, v in r[name].items())
    return f"    rounds (count x ms): plain [{kinds('plain_round_kinds')}]  best fixed [{kinds('best_fixed_round_kinds')}]  " \
           f"controller [{kinds('round_kinds')}]  as a chain [{kinds('chain_round_kinds')}]"


def write(path: str, out: dict) -> None:
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(out, indent=1))


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    with user_errors("bench_controller", args.debug):
        return bench(args)


if __name__ == "__main__":
    main()
