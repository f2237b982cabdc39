"""Host time of the draft controller's per-round planning (``Controller.plan``), with and without its lookup cache.

Every greedy round asks the controller for its shape and costs before the round's graph replays, with the GPU
idle after the previous round's sync, so this host time adds to every round. The cached plan reuses the device
tensors of each (shape, batch, 64-token context step) lookup; the uncached one is ``RoundCosts.lookup`` every
round (what the fourteenth session's first H200 run paid). Times on this machine's CPU (the costs' device is
``--device``), the median of ``--repeats`` loops of ``--plans`` plans at contexts moving as decoding does.

    python tools/bench_controller_plan.py --out docs/bench/controller_plan_cpu.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchspec.io import atomic_write_text  # noqa: E402
from torchspec.runtime.calibration import Calibration  # noqa: E402
from torchspec.runtime.controlled_drafting import Controller  # noqa: E402
from torchspec.runtime.cost_table import CostKey, CostTable  # noqa: E402
from torchspec.runtime.drafting import SpecConfig  # noqa: E402
from torchspec.runtime.round_costs import RoundCosts  # noqa: E402
from torchspec.runtime.sampling import SamplingParams  # noqa: E402


def table(device: str) -> CostTable:
    """A table of the shape torchspec-profile writes by default (times are irrelevant to the host's work)."""
    g = torch.Generator().manual_seed(0)
    contexts, batches, widths, nodes = [512, 2048, 8192], [1, 8, 64], [1, 2, 4, 8], [0, 1, 2, 4, 8, 16, 32, 48, 64]
    verify = (1 + torch.rand(3, 3, len(nodes), generator=g, dtype=torch.float64)).cumsum(-1)
    return CostTable(key=CostKey(device, 1, "t", "d", "bfloat16"), widths=widths, nodes=nodes, batches=batches,
                     contexts=contexts, depth=0.1 + torch.rand(3, 3, 4, generator=g, dtype=torch.float64),
                     verify=verify, round=verify[..., 0] + 0.3, meta={})


def plan_us(cached: bool, device: str, plans: int, repeats: int, batch: int) -> float:
    costs = table(device)
    ctl = Controller(costs, SpecConfig(), Calibration(torch.device(device)))
    greedy = SamplingParams()
    if not cached:  # every round looks the table up again
        ctl._lookup = lambda spec, b, ctx, sampled: RoundCosts.lookup(costs, spec, b, ctx, ctl.calibration,
                                                                      ctl.trace, measured_only=True)
    times = []
    for _ in range(repeats + 1):  # the first loop warms up
        ctl.next_plan, ctl.trace[:] = (3, 8), []
        t0 = time.perf_counter()
        for i in range(plans):
            ctl.plan(greedy, batch, 300 + i)  # one token more each round
            ctl.next_plan = (3, 8)  # a drafting plan (not a plain streak)
        times.append((time.perf_counter() - t0) / plans * 1e6)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="cpu", help="where the costs live (cuda: the lookup's copies are real H2D)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [{"lookup": name, "plan_us": plan_us(name == "cached", args.device, args.plans, args.repeats, args.batch)}
            for name in ("every round", "cached")]
    print(f"{'lookup':<12} {'us a plan':>10}")
    for r in rows:
        print(f"{r['lookup']:<12} {r['plan_us']:>10.1f}")
    out = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "args": vars(args),
           "rows": rows}
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
