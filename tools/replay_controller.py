"""The draft controller against fixed shapes in modeled time: serve anywhere (the CPU), price every round with a
measured cost table (the GPU's), so policy changes are judged without the GPU.

The engine decodes the same prompts plainly, with each fixed shape and with the controller (``--tree``'s bounds,
ahead mode); greedy outputs must equal plain decoding. Each round is priced from the table at the run's batch
and ``--ctx``: a plain round ``verify_ms[0] + overhead_ms``; a speculating round ``round_ms - verify_ms[0]``
(depth 0 and the round's fixed work) + a drafter depth per later depth (at its frontier width, linear between
the measured widths) + ``verify_ms[nodes] + overhead_ms``. The modeled speedup is plain decoding's modeled time
over the run's, each the sum of its own rounds (the same greedy tokens either way): a batch that drains at the end
of a run pays for its idle rows in every run alike. (Before the thirty-second session a fixed shape was priced as
if every round ran full -- its acceptance a row-round over its round's cost -- and the controller on its rounds,
which at c = 8 over two waves of prompts made a fixed tree look 25% faster than its runs were: x1.68 against
x1.34.) ``--overhead`` sets the table's host time a round (``b=ms,...``; the table's own by default). Acceptance
comes from this machine's forward (fp32 on the CPU, which may differ from bf16 on the GPU). The controller's
deciding kernels are in ``round_ms``: ``--decide-ms`` is what a deciding round pays that a fixed shape does not,
taken off every fixed shape's round and every held round (``--plans held``; 0 by default, which prices fixed shapes
and holds a little high); a table with ``round_extra_ms`` prices depth 0 as a served fixed round's
(``CostTable.spec_extra_ms``), so there a deciding round adds ``--decide-ms`` instead. At ``chain_from_batch``
rows or more the controller drafts chains, priced at width 1. A planning aid, not a measurement.

``--plans`` replays the controller once per way of planning (``plan_averages.PLANS``): the runtime's default
(``plan_averages.DEFAULT_PLANS``, "held") is the row ``controller``, any other ``controller (<plans>)``.

The controller's row also holds ``calibration_by_depth``: at each draft depth, the verified nodes' expected
tokens as the calibration read them, as the drafter's own path probabilities gave them, and the tokens
accepted there (``DepthEvidence``) -- where one exponent and scale for all depths misjudge a depth.
``--shape`` replays the controlled pair of ``tools/bench_runtime_efficiency.py`` instead of a real target.

    python tools/replay_controller.py --target smollm2 --drafter <export> --costs costs_h200.json \\
        --overhead 1=0.52,8=0.43,64=1.04 --concurrency 1 --out replay.json
    python tools/replay_controller.py --shape smollm2-135m --noise 0.0 --trees 5x8x32 \\
        --costs docs/bench/controller_pair_smollm2_h200_s17.costs.json     # the controlled pair, random prompts
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_controller import bench_prompts, calibration_state, parse_tree, plans_env  # noqa: E402

from torchspec.cli import check_at_least, user_errors  # noqa: E402
from torchspec.io import atomic_write_text  # noqa: E402
from torchspec.runtime.controller_policy import SCALE_ONE, rank_buckets  # noqa: E402
from torchspec.runtime.cost_table import CostTable, cost_key  # noqa: E402
from torchspec.runtime.drafting import SpecConfig, pool_steps  # noqa: E402
from torchspec.runtime.plan_averages import DEFAULT_PLANS, PLANS  # noqa: E402

PLAIN = (0, 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="dir | .gguf | alias (else the controlled pair of --shape)")
    p.add_argument("--drafter", help="an exported drafter (with --target)")
    p.add_argument("--shape", help="instead of --target: the controlled pair of this shape "
                                   "(tools/bench_runtime_efficiency.py), random prompts")
    p.add_argument("--noise", type=float, default=0.0, help="the controlled drafter's eh_proj noise (with --shape)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--costs", required=True, help="a cost table (any setup's: its key is not checked)")
    p.add_argument("--overhead", help="the host's ms a round per batch, b=ms,... (default: the table's)")
    p.add_argument("--prompt-set", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--ctx", type=int, default=320, help="the context the rounds are priced at")
    p.add_argument("--chains", default="1,2,3")
    p.add_argument("--trees", default="3x4x8,4x4x16,5x8x32", help="fixed trees; the last bounds the controller")
    p.add_argument("--plans", default=DEFAULT_PLANS, help=f"ways of planning, comma-separated, of {PLANS} "
                                                          f"(default: the runtime's, {DEFAULT_PLANS!r})")
    p.add_argument("--decide-ms", type=float, default=0.0,
                   help="what a deciding round pays that a fixed shape's does not (ms; thirtieth session, H100: "
                        "~0.11 at batch 64): off fixed shapes' and held rounds' prices")
    p.add_argument("--runs", type=int, default=1, help="serve the prompts this many times with the controller, each "
                   "run going on from the last one's plans and calibration (as the bench's repeats and a server do); "
                   "its row is the last run's, speedup_by_run every run's")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cache-dir", default="~/.cache/torchspec")
    p.add_argument("--out")
    return p


def read_table(args) -> CostTable:
    """``--costs`` with ``--overhead``'s host times a round in place of its own, under the file's key."""
    raw = json.loads(pathlib.Path(args.costs).read_text())
    if args.overhead:
        given = {}
        for item in args.overhead.split(","):
            b, _, ms = item.partition("=")
            try:
                given[int(b)] = float(ms)
            except ValueError:
                raise ValueError(f"--overhead entry {item!r} must read BATCH=MS, e.g. 1=0.52") from None
        missing = [b for b in raw.get("batches", []) if b not in given]
        if missing:
            raise ValueError(f"--overhead {args.overhead!r} lacks the table's batches {missing}.")
        raw["overhead_ms"] = [given[b] for b in raw["batches"]]
    return CostTable.from_dict(raw, source=f"cost table {args.costs}")


def load_table(args, engine) -> CostTable:
    """``read_table`` under the engine's key (any setup's table serves: its key is not checked)."""
    return dataclasses.replace(read_table(args), key=cost_key(engine.decoder, engine.runner))


class Pricer:
    """A round's modeled ms at one batch and context (module docstring)."""

    def __init__(self, table: CostTable, batch: int, ctx: int, decide_ms: float = 0.0):
        self.verify = table.verify_ms(batch, ctx).tolist()
        self.decide = decide_ms
        self.widths, self.depth = table.widths, table.depth_ms(batch, ctx).tolist()
        # depth 0 (CostTable.spec_extra_ms): with the served round_extra_ms a fixed round's, so a deciding round
        # adds --decide-ms; without it the standalone width-0 round's, the decision in it
        self.extra = float(table.spec_extra_ms(batch, ctx)) + (decide_ms if table.round_extra is not None else 0.0)
        self.host = table.overhead_ms(batch)

    def depth_ms(self, k: int) -> float:
        ws = self.widths
        if k <= ws[0] or len(ws) == 1:
            return self.depth[0]
        if k >= ws[-1]:
            return self.depth[-1]
        i = next(i for i, w in enumerate(ws) if w >= k)
        lo, hi = ws[i - 1], ws[i]
        return self.depth[i - 1] + (self.depth[i] - self.depth[i - 1]) * (k - lo) / (hi - lo)

    def plain(self) -> float:
        return self.verify[0] + self.host

    def round(self, depths: int, k: int, nodes: int, decided: bool = True) -> float:
        """A round drafting ``depths`` depths ``k`` wide and verifying ``nodes``; a fixed shape's or a held
        round (``decided=False``) without the decision (``--decide-ms``)."""
        if (depths, nodes) == PLAIN:
            return self.plain()
        decide = 0.0 if decided else self.decide
        return self.extra - decide + max(0, depths - 1) * self.depth_ms(k) + self.verify[nodes] + self.host


def replay(args) -> dict:
    for flag, v in (("--num-prompts", args.num_prompts), ("--concurrency", args.concurrency),
                    ("--max-new-tokens", args.max_new_tokens), ("--prompt-len", args.prompt_len), ("--runs", args.runs)):
        check_at_least(flag, v, 1)
    for plans in args.plans.split(","):
        if plans not in PLANS:
            raise ValueError(f"--plans entry {plans!r} is not a way to plan; use some of {PLANS}.")
    if args.decide_ms < 0:
        raise ValueError(f"--decide-ms {args.decide_ms} must be >= 0 (ms a deciding round pays beyond a fixed one).")
    chains = [SpecConfig(shape="chain", depth=int(d)) for d in args.chains.split(",") if d]
    trees = [parse_tree(t) for t in args.trees.split(",")]
    if not pathlib.Path(args.costs).is_file():
        raise ValueError(f"--costs {args.costs} does not exist; give a torchspec-profile table.")
    engine = build(args)
    table = load_table(args, engine)
    price = Pricer(table, args.concurrency, args.ctx, args.decide_ms)
    prompts = bench_prompts(args, engine, args.num_prompts, torch.Generator().manual_seed(args.seed))

    def run(**kw):
        """-> (each prompt's tokens, every row-round's accepted count, the batched rounds the run took)"""
        before = engine.decode_rounds
        out = engine.generate(prompts, max_new_tokens=args.max_new_tokens, concurrency=args.concurrency, **kw)
        return [r.token_ids for r in out], [a for r in out for a in r.accept_lengths], engine.decode_rounds - before

    plain, _, plain_rounds = run()
    plain_ms = plain_rounds * price.plain()  # plain decoding's modeled time: what every speedup is over
    rows = []
    for spec in [*chains, *trees]:
        tokens, acc, rounds = run(spec=spec)
        if tokens != plain:
            raise AssertionError(f"{spec}: greedy output differs from plain decoding")
        k, n = (1, spec.depth) if spec.shape == "chain" else (spec.topk, spec.num_nodes)
        ms = rounds * price.round(spec.depth, k, n, decided=False)
        rows.append({"mode": label(spec), "acceptance": sum(acc) / len(acc), "rounds": rounds, "modeled_ms": ms,
                     "speedup": plain_ms / ms})
    for plans in args.plans.split(","):
        rows.append(replay_plans(engine, args, trees[-1], plans, price, run, plain, plain_ms))
    out = {"args": vars(args), "device": str(engine.device), "plain_round_ms": price.plain(),
           "plain_rounds": plain_rounds, "host_ms": price.host, "rows": rows}
    for r in rows:
        print(f"{r['mode']:<16} acceptance {r['acceptance']:.2f}  modeled x{r['speedup']:.2f}"
              + (f"  plans {r['plans'][:6]}  plain rounds {r['plain_rounds']}  by run "
                 f"{[round(x, 3) for x in r['speedup_by_run']]}" if "plans" in r else ""))
    print("the controller's verified nodes by depth: expected tokens as the calibration read them / the drafter's "
          "own path probabilities / accepted")
    for r in rows[-1]["calibration_by_depth"]:
        print(f"  depth {r['depth']}: {r['expected']:8.2f} / {r['expected_raw']:8.2f} / {r['accepted']:6d}")
    end = rows[-1]["calibration_at_end"]
    print(f"the calibration at the end: exponent {end['exponent']}, by rank bucket (1, 2-3, 4-7, ...) ratio "
          f"{[round(x, 2) for x in end['ratio_by_rank']]}, scale {[round(x, 2) for x in end['scale_by_rank']]}, "
          f"evidence accepted {[round(x, 1) for x in end['accepted_by_rank']]} / expected "
          f"{[round(x, 1) for x in end['expected_by_rank']]}")
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(out, indent=1))
    return out


def replay_plans(engine, args, bound: SpecConfig, plans: str, price: Pricer, run, plain: list,
                 plain_ms: float) -> dict:
    """The controller within ``bound`` planning as ``plans`` says, from a fresh calibration (a table object of its
    own): its row, each round priced (held rounds without the decision; chains at width 1), its speedup
    ``plain_ms`` (plain decoding's modeled time) over the sum."""
    table = load_table(args, engine)
    speedups = []
    for _ in range(args.runs):  # later runs go on from the last one's plans and calibration (``continue_from``)
        engine.round_kinds.clear()
        with plans_env(plans), DepthEvidence(bound.topk) as by_depth:
            tokens, acc, rounds = run(spec=bound, controller=table)
        if tokens != plain:
            raise AssertionError(f"the controller's greedy output ({plans} plans) differs from plain decoding")
        ctl = engine.controller
        k = 1 if ctl._base(args.concurrency).shape == "chain" else bound.topk
        held = sum(n for kind, (n, _) in engine.round_kinds.items() if kind.startswith("held"))
        plain_rounds = sum(n for kind, (n, _) in engine.round_kinds.items() if kind.startswith("plain"))
        cost = sum(price.round(d, k, w) for d, w in ctl.trace) - held * price.decide
        assert len(ctl.trace) == rounds, (len(ctl.trace), rounds)  # the trace has one entry a batched round
        speedups.append(plain_ms / cost if rounds else 0.0)
    return {"mode": "controller" if plans == DEFAULT_PLANS else f"controller ({plans})", "plans_how": plans,
            "acceptance": sum(acc) / len(acc), "rounds": rounds, "modeled_ms": cost, "held_rounds": held,
            "plain_rounds": plain_rounds, "drafts": "chain" if k == 1 else "tree", "speedup": speedups[-1],
            "speedup_by_run": speedups,
            "plans": [[d, w, n] for (d, w), n in collections.Counter(ctl.trace).most_common()],
            "calibration_by_depth": by_depth.rows(), "calibration_at_end": calibration_state(engine)}


class DepthEvidence:
    """While open, records by draft depth what each controlled round's verified nodes were expected to yield
    (their path probabilities as the calibration read them, ``Calibration.choice``, and as the drafter gave
    them) and what was accepted (a row that accepted ``a`` drafted tokens accepted one at each depth 1..a):
    where the calibration's one exponent and scale misjudge a depth. The dynamic tree's pool holds ``topk``
    nodes at depth 1 and ``topk``^2 at each later one, in depth order. Host reads every round: a diagnosis, not a
    way to serve."""

    def __init__(self, topk: int):
        self.topk = topk
        self.expected, self.raw, self.accepted = (collections.Counter() for _ in range(3))

    def __enter__(self):
        from torchspec.runtime.calibration import Calibration

        self._originals = Calibration.evidence, Calibration.observe
        evidence, observe = self._originals
        me = self

        def recording_evidence(cal, pool_logp, verified, row_valid):
            if verified:
                alpha, scales = cal.choice()  # a scale per rank bucket
                top, at = pool_logp.double().topk(verified, dim=1)
                first, step = pool_steps(me.topk)  # the pool's layout: k nodes at depth 1, then k * k a depth
                depth = torch.where(at < first, 1, 2 + (at - first) // step).tolist()
                live = row_valid.tolist()
                scale = scales.gather(0, rank_buckets(verified, top.device)).double() / SCALE_ONE  # [m] by rank
                read = (torch.exp(top * alpha) * scale).tolist()
                for r, ok in enumerate(live):
                    for d, x, y in zip(depth[r], read[r], torch.exp(top[r]).tolist()):
                        me.expected[d] += x * ok
                        me.raw[d] += y * ok
            return evidence(cal, pool_logp, verified, row_valid)

        def recording_observe(cal, accepted, ranks, row_valid):
            for a, ok in zip(accepted.tolist(), row_valid.tolist()):
                for d in range(1, int(a) + 1) if ok else ():
                    me.accepted[d] += 1
            return observe(cal, accepted, ranks, row_valid)

        Calibration.evidence, Calibration.observe = recording_evidence, recording_observe
        return self

    def __exit__(self, *exc):
        from torchspec.runtime.calibration import Calibration

        Calibration.evidence, Calibration.observe = self._originals

    def rows(self) -> list[dict]:
        depths = sorted(set(self.expected) | set(self.accepted))
        return [{"depth": d, "expected": self.expected[d], "expected_raw": self.raw[d], "accepted": self.accepted[d]}
                for d in depths]


def build(args):
    """The engine: a real target and drafter, or the controlled pair (``--shape``, ``--noise``; fp32)."""
    if (args.target is None) == (args.shape is None):
        raise ValueError("give --target (with --drafter) or --shape (the controlled pair), not both or neither.")
    if args.target is None:
        from bench_runtime_efficiency import build_engine, set_noise

        args.prompt_set = None  # the controlled pair has no tokenizer: random prompts
        engine = build_engine(args.shape, 0.3, args.concurrency, args.prompt_len + args.max_new_tokens + 64,
                              args.seed, device=args.device, cuda_graphs=False)
        set_noise(engine, args.noise, args.seed)
        return engine
    if not args.drafter:
        raise ValueError("--target needs --drafter <export dir>.")
    from torchspec.runtime.loading import load_engine

    return load_engine(args.target, args.drafter, device=args.device, dtype=args.dtype, max_batch=args.concurrency,
                       max_context=args.prompt_len + args.max_new_tokens + 64,
                       cache_dir=str(pathlib.Path(args.cache_dir).expanduser()))


def label(spec: SpecConfig) -> str:
    return f"chain{spec.depth}" if spec.shape == "chain" else f"tree{spec.depth}x{spec.topk}x{spec.num_nodes}"


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    with user_errors("replay_controller"):
        return replay(args)


if __name__ == "__main__":
    main()
