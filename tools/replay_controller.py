"""The draft controller against fixed shapes in modeled time: serve anywhere (the CPU), price every round with a
measured cost table (the GPU's), so policy changes are judged without the GPU.

The engine decodes the same prompts plainly, with each fixed shape and with the controller (``--tree``'s bounds,
ahead mode); greedy outputs must equal plain decoding. Each round is priced from the table at the run's batch
and ``--ctx``: a plain round ``verify_ms[0] + overhead_ms``; a speculating round ``round_ms - verify_ms[0]``
(depth 0 and the round's fixed work) + a drafter depth per later depth (at its frontier width, linear between
the measured widths) + ``verify_ms[nodes] + overhead_ms``. The modeled speedup is tokens per modeled ms against
plain decoding's. ``--overhead`` sets the table's host time a round (``b=ms,...``; the table's own by default).
Acceptance comes from this machine's forward (fp32 on the CPU, which may differ from bf16 on the GPU), and the
model leaves out what the table does not hold (the controller's deciding kernels are in ``round_ms``, so fixed
shapes are priced a little high). A planning aid, not a measurement.

    python tools/replay_controller.py --target smollm2 --drafter <export> --costs costs_h200.json \\
        --overhead 1=0.52,8=0.43,64=1.04 --concurrency 1 --out replay.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_controller import bench_prompts, parse_tree  # noqa: E402

from torchspec.cli import check_at_least, user_errors  # noqa: E402
from torchspec.io import atomic_write_text  # noqa: E402
from torchspec.runtime.cost_table import CostTable, cost_key  # noqa: E402
from torchspec.runtime.drafting import SpecConfig  # noqa: E402

PLAIN = (0, 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="dir | .gguf | alias")
    p.add_argument("--drafter", required=True, help="an exported drafter")
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
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cache-dir", default="~/.cache/torchspec")
    p.add_argument("--out")
    return p


def load_table(args, engine) -> CostTable:
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
    table = CostTable.from_dict(raw, source=f"cost table {args.costs}")
    return dataclasses.replace(table, key=cost_key(engine.decoder, engine.runner))


class Pricer:
    """A round's modeled ms at one batch and context (module docstring)."""

    def __init__(self, table: CostTable, batch: int, ctx: int):
        self.verify = table.verify_ms(batch, ctx).tolist()
        self.widths, self.depth = table.widths, table.depth_ms(batch, ctx).tolist()
        self.extra = float(table.round_ms(batch, ctx)) - self.verify[0]
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

    def round(self, depths: int, k: int, nodes: int) -> float:
        if (depths, nodes) == PLAIN:
            return self.plain()
        return self.extra + max(0, depths - 1) * self.depth_ms(k) + self.verify[nodes] + self.host


def replay(args) -> dict:
    for flag, v in (("--num-prompts", args.num_prompts), ("--concurrency", args.concurrency),
                    ("--max-new-tokens", args.max_new_tokens), ("--prompt-len", args.prompt_len)):
        check_at_least(flag, v, 1)
    chains = [SpecConfig(shape="chain", depth=int(d)) for d in args.chains.split(",") if d]
    trees = [parse_tree(t) for t in args.trees.split(",")]
    if not pathlib.Path(args.costs).is_file():
        raise ValueError(f"--costs {args.costs} does not exist; give a torchspec-profile table.")
    from torchspec.runtime.loading import load_engine

    engine = load_engine(args.target, args.drafter, device=args.device, dtype=args.dtype,
                         max_batch=args.concurrency, max_context=args.prompt_len + args.max_new_tokens + 64,
                         cache_dir=str(pathlib.Path(args.cache_dir).expanduser()))
    table = load_table(args, engine)
    price = Pricer(table, args.concurrency, args.ctx)
    prompts = bench_prompts(args, engine, args.num_prompts, None)  # a prompt set: no random draws

    def run(**kw):
        out = engine.generate(prompts, max_new_tokens=args.max_new_tokens, concurrency=args.concurrency, **kw)
        return [r.token_ids for r in out], [a for r in out for a in r.accept_lengths]

    plain, _ = run()
    rows = []
    for spec in [*chains, *trees]:
        tokens, acc = run(spec=spec)
        if tokens != plain:
            raise AssertionError(f"{spec}: greedy output differs from plain decoding")
        k, n = (1, spec.depth) if spec.shape == "chain" else (spec.topk, spec.num_nodes)
        a = sum(acc) / len(acc)
        rows.append({"mode": label(spec), "acceptance": a, "speedup": a * price.plain() / price.round(spec.depth, k, n)})
    tokens, acc = run(spec=trees[-1], controller=table)
    if tokens != plain:
        raise AssertionError("the controller's greedy output differs from plain decoding")
    trace = engine.controller.trace
    cost = sum(price.round(d, trees[-1].topk, w) for d, w in trace)
    a = sum(acc) / len(acc)  # committed tokens a row-round; the trace has one entry a batched round
    rows.append({"mode": "controller", "acceptance": a,
                 "speedup": (sum(acc) / cost) / (args.concurrency / price.plain()) if len(trace) else 0.0,
                 "plans": [[d, w, n] for (d, w), n in collections.Counter(trace).most_common()]})
    out = {"args": vars(args), "device": str(engine.device), "plain_round_ms": price.plain(),
           "host_ms": price.host, "rows": rows}
    for r in rows:
        print(f"{r['mode']:<16} acceptance {r['acceptance']:.2f}  modeled x{r['speedup']:.2f}"
              + (f"  plans {r['plans'][:6]}" if "plans" in r else ""))
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(out, indent=1))
    return out


def label(spec: SpecConfig) -> str:
    return f"chain{spec.depth}" if spec.shape == "chain" else f"tree{spec.depth}x{spec.topk}x{spec.num_nodes}"


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    with user_errors("replay_controller"):
        return replay(args)


if __name__ == "__main__":
    main()
