"""``torchspec-bench``: decode throughput with and without speculation, side by side in one run.

    torchspec-bench --target smollm2 --drafter runs/x/export --prompt-set mtbench,humaneval \\
        --concurrency 1,8 --temperature 0,1 --num-prompts 16 --max-new-tokens 256 --out bench.json

For every prompt set, temperature and concurrency c, the same prompts are decoded by the plain
decoder (one target forward per token) and by each speculative shape (``--shapes tree,chain``)
of the same engine, c sequences at a time (continuous batching over c slots). Each shape is timed
in ``--repeats`` pairs with a plain run, the order alternating (``paired_timings``). Reported per
row: decode tokens/s (generated tokens after the first, over wall time minus prefill time), speedup
over plain decoding (the median pair's, with every pair's in ``speedup_repeats``; the plain row is
the median of the group's plain runs), and mean acceptance length (tokens committed per
verification round, bonus included). A warm-up generate runs first. Prints a table; writes JSON
(atomically) with every number and the exact arguments. Every option and prompt set is checked
before a model loads; user errors print one line and exit 2 (``--debug``: the traceback).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from torchspec.cli import ArgumentParser, check_at_least, user_errors
from torchspec.runtime.cli import (
    add_engine_args,
    add_spec_args,
    check_engine_args,
    check_output_file,
    controller_from_args,
    engine_kwargs,
    read_prompt_set,
    spec_from_args,
)
from torchspec.runtime.costs import bytes_per_plain_step, copy_rate_bytes_per_s, step_costs
from torchspec.runtime.sampling import SamplingParams
from torchspec.runtime.tp import is_rank0


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="torchspec-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-set", default="mtbench", help="comma-separated: mtbench, humaneval or files")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per set (at least the concurrency)")
    p.add_argument("--concurrency", default="1,8", help="comma-separated slot counts")
    p.add_argument("--temperature", default="0", help="comma-separated temperatures (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--shapes", default="tree,chain", help="speculative shapes to compare with plain decoding")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="timed pairs of plain and speculative runs per shape, the order alternating; a row's "
                        "speedup is the median pair's (speedup_repeats: every pair's). Use 3+ for a claim")
    p.add_argument("--out", default="bench_runtime.json", help="JSON output path")
    add_engine_args(p)
    add_spec_args(p)
    return p


def csv_values(flag: str, text: str, kind=str) -> list:
    """A comma-separated option value -> [kind]; empty or unparsable is a ValueError naming the flag."""
    try:
        values = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be a comma-separated list of {kind.__name__}") from None
    if not values:
        raise ValueError(f"{flag}={text!r} is empty; give at least one value")
    return values


def check_args(args) -> dict:
    """Every option, and the prompt sets, before a model loads: a typo must not cost a target load."""
    base_spec = spec_from_args(args)
    if base_spec is None or args.drafter is None:
        raise ValueError("torchspec-bench compares against speculation: give --drafter PATH (no --no-spec).")
    levels, temps, shapes = (csv_values("--concurrency", args.concurrency, int), csv_values("--temperature", args.temperature, float),
                             csv_values("--shapes", args.shapes))
    for c in levels:
        check_at_least("--concurrency", c, 1)
    for temp in temps:
        SamplingParams(temperature=temp, top_p=args.top_p).validate()
    for shape in shapes:
        dataclasses.replace(base_spec, shape=shape).validate()
    check_at_least("--num-prompts", args.num_prompts, 1)
    check_at_least("--max-new-tokens", args.max_new_tokens, 1)
    check_at_least("--repeats", args.repeats, 1)
    check_engine_args(args, base_spec)
    if args.chain_from_batch is not None:
        raise ValueError("torchspec-bench times one shape a row: for the controller's chains pass --chain "
                         "(--chain-from-batch is torchspec-generate's).")
    check_output_file("--out", args.out)
    prompt_sets = {name: read_prompt_set(name) for name in csv_values("--prompt-set", args.prompt_set)}
    return {"spec": base_spec, "levels": levels, "temps": temps, "shapes": shapes, "prompt_sets": prompt_sets}


def measure(engine, prompts, spec, params, max_new, seed, concurrency, controller=None, controller_mode="ahead",
            chain_from_batch=None) -> dict:
    """One timed ``generate``; ``round_ms``: decode time per batched engine round (a plain step for
    plain decoding); ``round_kinds``: count and mean ms of each kind of round (``round_kinds``); ``mean_ctx``:
    the rows' mean committed length over their decode; ``steady_tokens_per_s``: committed tokens a second over the
    rounds with every slot live (``full_rounds`` of them; None if none was), the rate of a server with a queue,
    which a closed run's ramp and stragglers leave out. ``controller``: a cost table, the draft controller
    choosing each greedy round's shape within ``spec`` (``controller_mode``; a chain from ``chain_from_batch``
    rows on, None: the table's rule)."""
    rounds_before = engine.decode_rounds
    kinds_before = {k: list(v) for k, v in engine.round_kinds.items()}
    full_before = list(engine.full_rounds)
    t0 = time.perf_counter()
    results = engine.generate(prompts, max_new_tokens=max_new, sampling=params, spec=spec, seed=seed,
                              concurrency=concurrency, controller=controller, controller_mode=controller_mode,
                              chain_from_batch=chain_from_batch)
    wall = time.perf_counter() - t0
    engine_rounds = engine.decode_rounds - rounds_before
    prefill = sum(r.prefill_s for r in results)
    decode_tokens = sum(max(0, len(r.token_ids) - 1) for r in results)
    rounds = sum(len(r.accept_lengths) for r in results)
    decode_s = max(wall - prefill, 1e-9)
    mean_ctx = sum(len(p) + len(r.token_ids) / 2 for p, r in zip(prompts, results)) / max(len(results), 1)
    full_rounds, full_s, full_tokens = (now - was for now, was in zip(engine.full_rounds, full_before))
    return {"full_rounds": int(full_rounds), "steady_tokens_per_s": full_tokens / full_s if full_s > 0 else None,
            "decode_tokens": decode_tokens, "decode_s": decode_s, "tokens_per_s": decode_tokens / decode_s,
            "rounds": rounds, "mean_acceptance": sum(sum(r.accept_lengths) for r in results) / max(rounds, 1),
            "prefill_s": prefill, "wall_s": wall, "engine_rounds": engine_rounds,
            "round_ms": 1e3 * decode_s / max(engine_rounds, 1), "mean_ctx": mean_ctx,
            "round_kinds": round_kinds(kinds_before, engine.round_kinds)}


def round_kinds(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, dict]:
    """The engine's rounds of each kind between two ``engine.round_kinds`` snapshots: their count and mean wall
    time (ms, the host's sync included; a controller's kinds are its plans, "d<depth>w<width>")."""
    out = {}
    for kind, (n, s) in sorted(after.items()):
        n0, s0 = before.get(kind, (0, 0.0))
        if n > n0:
            out[kind] = {"rounds": int(n - n0), "ms": 1e3 * (s - s0) / (n - n0)}
    return out


def paired_timings(time_plain: Callable[[], dict], time_spec: Callable[[], dict], repeats: int) -> dict:
    """``repeats`` pairs of timed runs, plain decoding and speculation, the order alternating (plain first, then
    speculation first, ...), so a drift of the machine's speed over the pairs falls on both sides: on an H200 one
    run against a plain run timed minutes before read x1.81 and x1.67 for the same row (docs/results.md, twelfth
    session). Each ``time_*`` returns ``measure``'s dict (``tokens_per_s`` at least). Returns the median pair,
    the lower middle one for an even count (``plain``, ``spec``; its ``speedup`` is exactly their tokens/s
    ratio), every pair's ratio (``speedup_repeats``, ``speedup_min``, ``speedup_max``), and the median pair's ratio
    of ``steady_tokens_per_s`` (``steady_speedup``; None where a run had no round with every slot live)."""
    check_at_least("repeats", repeats, 1)
    pairs = []
    for i in range(repeats):
        if i % 2 == 0:
            plain = time_plain()
            spec = time_spec()
        else:
            spec = time_spec()
            plain = time_plain()
        pairs.append((plain, spec))
    ratios = [spec["tokens_per_s"] / plain["tokens_per_s"] for plain, spec in pairs]
    plain, spec = pairs[sorted(range(repeats), key=ratios.__getitem__)[(repeats - 1) // 2]]
    return {"plain": plain, "spec": spec, "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
            "speedup_repeats": ratios, "speedup_min": min(ratios), "speedup_max": max(ratios),
            "steady_speedup": _ratio(spec.get("steady_tokens_per_s"), plain.get("steady_tokens_per_s"))}


def steady_ratio(one: dict, other: dict) -> float | None:
    """One ``paired_timings`` result over another at steady state (each one's ``steady_speedup``: rounds with every
    slot live), or None where either lacks it."""
    return _ratio(one["steady_speedup"], other["steady_speedup"])


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None where either is missing (a run with no round of every slot live) or zero."""
    return num / den if num and den else None


def paired_fields(paired: dict) -> dict:
    """A row's speedup fields from ``paired_timings``: the median pair's speedup and plain run, every pair's ratio."""
    return {"speedup": paired["speedup"], "speedup_repeats": paired["speedup_repeats"],
            "speedup_min": paired["speedup_min"], "speedup_max": paired["speedup_max"],
            "steady_speedup": paired["steady_speedup"],
            "plain_tokens_per_s": paired["plain"]["tokens_per_s"], "plain_step_ms": paired["plain"]["round_ms"]}


def run(args) -> dict:
    from torchspec.runtime.loading import load_engine
    from torchspec.runtime.prompts import render_prompts
    from torchspec.runtime.tp import init_tp_from_env

    checked = check_args(args)
    base_spec, levels, temps, shapes = checked["spec"], checked["levels"], checked["temps"], checked["shapes"]
    kwargs = engine_kwargs(args)
    kwargs["max_batch"] = max(levels)
    tp_group, device = init_tp_from_env()  # under torchrun: the target is tensor-parallel over all ranks
    kwargs["device"] = args.device or device
    engine = load_engine(args.target, args.drafter, tp_group=tp_group, **kwargs)
    controller = controller_from_args(args, engine)  # --controller: every speculative row under it
    copy_rate = copy_rate_bytes_per_s(engine.device)  # CUDA: the HBM ceiling of hbm_fraction; None on CPU
    rows = []
    for set_name, raw_prompts in checked["prompt_sets"].items():
        prompts = render_prompts(engine.tokenizer, raw_prompts)
        for temp in temps:
            params = SamplingParams(temperature=temp, top_p=args.top_p)
            for c in levels:
                chosen = (prompts * (1 + max(c, args.num_prompts) // len(prompts)))[: max(c, args.num_prompts)]
                measure(engine, chosen[:c], None, params, 16, args.seed, c)  # warm-up
                group, plains = [], []
                for shape in shapes:  # every shape paired with plain runs of its own (--repeats)
                    spec = dataclasses.replace(base_spec, shape=shape)
                    mode = args.controller_mode
                    measure(engine, chosen[:c], spec, params, 16, args.seed, c, controller, mode)
                    paired = paired_timings(partial(measure, engine, chosen, None, params, args.max_new_tokens, args.seed, c),
                                            partial(measure, engine, chosen, spec, params, args.max_new_tokens, args.seed, c,
                                                    controller, mode), args.repeats)
                    plains.append(paired["plain"])
                    group.append({"prompt_set": set_name, "temperature": temp, "concurrency": c, "mode": shape,
                                  **paired["spec"], **paired_fields(paired)})
                # the plain row: the median of the group's plain runs (by tokens/s)
                plain = sorted(plains, key=lambda r: r["tokens_per_s"])[(len(plains) - 1) // 2]
                step_bytes = bytes_per_plain_step(engine, c, plain["mean_ctx"])
                rows.append({"prompt_set": set_name, "temperature": temp, "concurrency": c, "mode": "plain",
                             **plain, **step_costs(plain["round_ms"], plain["round_ms"], step_bytes, copy_rate),
                             "speedup": 1.0})
                for row in group:
                    rows.append({**row, **step_costs(row["round_ms"], row["plain_step_ms"], step_bytes, copy_rate)})
                    if is_rank0():
                        print(format_row(rows[-1]), flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and engine.device.type == "cuda" else \
        platform.processor() or "cpu"
    tp = engine.decoder.tp_size
    return {"device": device, "tp": tp, "copy_rate_gb_per_s": copy_rate / 1e9 if copy_rate else None,
            "args": vars(args), "spec": dataclasses.asdict(base_spec), "controller": args.controller,
            "cuda_graphs": engine.graphs is not None, "rows": rows}


def format_row(r: dict) -> str:
    return (f"{r['prompt_set']:<10} T={r['temperature']:<4} c={r['concurrency']:<3} {r['mode']:<6} "
            f"{r['tokens_per_s']:9.1f} tok/s  x{r['speedup']:.2f}  accept {r['mean_acceptance']:.2f}  "
            f"round {r['round_cost_plain_steps']:.2f} plain steps")


def print_table(out: dict) -> None:
    print(f"\ndevice: {out['device']}")
    print(f"{'set':<10} {'T':<6} {'conc':<6} {'mode':<6} {'tok/s':>9} {'speedup':>8} {'accept':>7} "
          f"{'round ms':>9} {'plain steps':>11} {'hbm':>5}")
    for r in out["rows"]:
        hbm = f"{r['hbm_fraction']:5.2f}" if r["hbm_fraction"] is not None else f"{'-':>5}"
        print(f"{r['prompt_set']:<10} {r['temperature']:<6} {r['concurrency']:<6} {r['mode']:<6} "
              f"{r['tokens_per_s']:9.1f} {r['speedup']:8.2f} {r['mean_acceptance']:7.2f} {r['round_ms']:9.3f} "
              f"{r['round_cost_plain_steps']:11.2f} {hbm}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    with user_errors("torchspec-bench", args.debug):
        out = run(args)
    if not is_rank0():
        return
    print_table(out)
    from torchspec.io import atomic_write_text

    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
