"""Where a decode round's host time goes: a fixed shape against the draft controller, by Python function.

Every round ends in one host sync, so the host work before a round's launch and after its sync adds to the
round's wall time. On an H100 (twentieth session) a controlled (5, 32) round took ~2.31 ms of wall time where
the fixed 5x8x32 tree's took ~2.06 ms, though its graph is only ~0.08 ms longer (``tools/profile_round.py``).
This decodes the same prompts with the fixed tree, with the controller within it, and with the fixed tree again
(the order's own effect: a later run on the same engine), after warm runs that capture every graph each needs,
first plainly, for each kind of round's wall ms (``engine.round_kinds``), then
under ``cProfile``, and prints per function the host microseconds a decode round spends in it (its own time,
and with its callees) for both, largest difference first; JSON to ``--out``::

    python tools/profile_round_host.py --shape smollm2-135m --noise 0.0 --concurrency 1 --tree 5x8x32 \\
        --costs docs/bench/controller_pair_smollm2_h100_s20.costs.json --out docs/bench/round_host_smollm2.json

cProfile slows the Python it traces, so its microseconds are larger than the plain run's; read the
differences, not the totals. Without ``--costs`` the table is measured here first (a tiny shape on the CPU:
a smoke run).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pathlib
import platform
import pstats
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from recipes.bench import measure  # noqa: E402
from torchspec.cli import check_at_least, user_errors  # noqa: E402
from torchspec.io import atomic_write_text  # noqa: E402
from torchspec.runtime.sampling import SamplingParams  # noqa: E402

WARM_RUNS = 2  # whole runs before timing (the first round of a run captures every shape the controller may plan)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="smollm2-135m", help="controlled pair shape (tools/bench_runtime_efficiency.py)")
    p.add_argument("--noise", type=float, default=0.0, help="the controlled drafter's eh_proj noise")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--tree", default="5x8x32", help="the fixed tree (DxKxN), and the controller's bounds")
    p.add_argument("--costs", help="a torchspec-profile table of this setup (default: measured here)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--top", type=int, default=25, help="functions printed (the JSON keeps 200)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--debug", action="store_true")
    return p


def host_profile(engine, run) -> dict[str, dict]:
    """``run()`` under cProfile -> per function: its own and cumulative host microseconds per decode round."""
    rounds_before, prof = engine.decode_rounds, cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    rounds = max(engine.decode_rounds - rounds_before, 1)
    out = {}
    for (file, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        where = f"{pathlib.Path(file).name}:{line}({name})" if line else name
        out[where] = {"own_us": 1e6 * own / rounds, "cum_us": 1e6 * cum / rounds, "calls": calls / rounds}
    return out


def table_for(args, engine, spec):
    from torchspec.runtime.cost_profile import profile_costs
    from torchspec.runtime.cost_table import CostTable, cost_key

    if args.costs:
        return CostTable.load(args.costs, cost_key(engine.decoder, engine.runner))
    return profile_costs(engine, batches=[args.concurrency], contexts=[args.prompt_len + args.max_new_tokens // 2],
                         widths=sorted({1, spec.topk}), nodes=sorted({0, 1, spec.num_nodes}), repeats=1,
                         timing="graph" if engine.graphs is not None else "eager")


def bench(args) -> dict:
    from bench_controller import parse_tree
    from bench_runtime_efficiency import build_engine, set_noise

    for flag in ("concurrency", "max_new_tokens", "prompt_len", "num_prompts", "top"):
        check_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    spec = parse_tree(args.tree, "--tree")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = build_engine(args.shape, 0.3, args.concurrency, args.prompt_len + args.max_new_tokens + 160, args.seed,
                          device=device, cuda_graphs=torch.device(device).type == "cuda")
    set_noise(engine, args.noise, args.seed)
    table = table_for(args, engine, spec)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, engine.decoder.vocab_size, (max(args.num_prompts, args.concurrency), args.prompt_len),
                            generator=g).tolist()
    # the fixed tree once more after the controller: a later run on the same engine (more graphs captured, a warmer
    # or busier host) is not the controller's cost; "fixed again" against "fixed" says how much of it is the order
    runs = {"fixed": dict(spec=spec), "controller": dict(spec=spec, controller=table), "fixed again": dict(spec=spec)}
    out = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
           "args": {k: v for k, v in vars(args).items() if k not in ("out", "debug")}, "runs": {}}
    for name, kw in runs.items():
        def run(kw=kw):
            return measure(engine, prompts, params=SamplingParams(), max_new=args.max_new_tokens, seed=args.seed,
                           concurrency=args.concurrency, **kw)
        for _ in range(WARM_RUNS if engine.graphs is not None else 1):
            run()
        timed = run()
        host = host_profile(engine, run)
        out["runs"][name] = {"round_ms": timed["round_ms"], "round_kinds": timed["round_kinds"],
                             "acceptance": timed["mean_acceptance"], "round_host_us": round_host_us(host), "host": host}
    fixed, ctl = out["runs"]["fixed"]["host"], out["runs"]["controller"]["host"]
    diff = sorted(((k, ctl.get(k, {}).get("own_us", 0.0) - fixed.get(k, {}).get("own_us", 0.0)) for k in {*fixed, *ctl}),
                  key=lambda kv: -abs(kv[1]))
    out["own_us_difference"] = [{"function": k, "controller_minus_fixed_us": d,
                                 "fixed": fixed.get(k), "controller": ctl.get(k)} for k, d in diff[:200]]
    for name in runs:  # the JSON keeps each run's 200 largest functions by own time
        host = out["runs"][name]["host"]
        out["runs"][name]["host"] = dict(sorted(host.items(), key=lambda kv: -kv[1]["own_us"])[:200])
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(out, indent=1))
    print_report(out, args.top)
    return out


def round_host_us(host: dict[str, dict]) -> float:
    """A profile's host microseconds a decode round (``decode_round`` with its callees, under cProfile): the same
    code profiled in two runs should give the same; "fixed again" against "fixed" shows what the order alone adds."""
    return next((v["cum_us"] for k, v in host.items() if k.endswith("(decode_round)")), 0.0)


def print_report(out: dict, top: int) -> None:
    for name, r in out["runs"].items():
        kinds = ", ".join(f"{k} {v['rounds']}x{v['ms']:.3f} ms" for k, v in r["round_kinds"].items())
        print(f"{name:<11} {r['round_ms']:.3f} ms a round, acceptance {r['acceptance']:.2f}, "
              f"{r['round_host_us']:.0f} us a round in decode_round under cProfile  [{kinds}]")
    print(f"{'function':<70} {'fixed us':>9} {'ctl us':>9} {'diff us':>9}  (own host time a round, under cProfile)")
    for row in out["own_us_difference"][:top]:
        f, c = (row[k] or {} for k in ("fixed", "controller"))
        print(f"{row['function'][:70]:<70} {f.get('own_us', 0.0):9.1f} {c.get('own_us', 0.0):9.1f} "
              f"{row['controller_minus_fixed_us']:9.1f}")


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    with user_errors("profile_round_host", args.debug):
        return bench(args)


if __name__ == "__main__":
    main()
