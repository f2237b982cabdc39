"""Count the device operations of one plain decode step and one speculation round (CPU, no GPU).

Inside a CUDA graph a small target's step costs roughly (kernels x a few microseconds), so the ratio
"ops per speculation round / ops per plain step" is the round's cost in plain steps, and thus the
acceptance length speculation needs to break even. Counted: every aten op that is not a pure
view / metadata op (a proxy for kernels), by phase of the round.

    python tools/count_round_ops.py --target smollm2 --drafter outputs/default/export --out ops.json
    python tools/count_round_ops.py --tiny    # a 30-layer tiny target + pair drafter, no files needed
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VIEW_OPS = {"view", "_unsafe_view", "expand", "transpose", "t", "unsqueeze", "squeeze", "slice", "select",
            "permute", "reshape", "alias", "as_strided", "detach", "unbind", "split", "chunk", "lift_fresh",
            "_reshape_alias", "split_with_sizes", "diagonal"}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.paused = False  # ops inside a region that is a few kernels on the GPU (``as_launches``)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS and not self.paused:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


_ACTIVE: list[OpCounter] = []  # the counter in use (as_launches pauses it)
# decide_triton.decide_every_depth_fused on CUDA: the zeroed rank sums, the sorting grid, the plan
DECISION_LAUNCHES = 3


def as_launches(fn, launches: int):
    """``fn`` counted as ``launches`` ops by the counter in use (the Triton launches that replace its tensor ops
    on CUDA)."""
    def wrapped(*args, **kwargs):
        if not _ACTIVE:
            return fn(*args, **kwargs)
        c = _ACTIVE[-1]
        c.counts["decision_launches"] += launches
        c.paused = True
        try:
            return fn(*args, **kwargs)
        finally:
            c.paused = False
    return wrapped


def count(fn) -> tuple[int, collections.Counter]:
    with OpCounter() as c:
        _ACTIVE.append(c)
        try:
            fn()
        finally:
            _ACTIVE.pop()
    return sum(c.counts.values()), c.counts


def main() -> None:
    from torchspec.runtime.drafting import DraftInputs, SpecConfig, draft_round
    from torchspec.runtime.loading import load_engine
    from torchspec.runtime.sampling import SamplingParams
    from torchspec.runtime.steps import plain_step, speculate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--tiny", action="store_true", help="build a 30-layer tiny pair instead")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.tiny:
        from tests.runtime_pair import build_pair
        from torchspec.data import build_tiny_tokenizer

        root = pathlib.Path(tempfile.mkdtemp())
        args.target, args.drafter = build_pair(root, build_tiny_tokenizer(384), num_layers=30)
    engine = load_engine(args.target, args.drafter, device="cpu", dtype="float32", max_batch=1, max_context=256,
                         page_size=16)
    prompt = [list(range(1, 40))]
    engine.generate(prompt, max_new_tokens=2)  # warm up
    b = 1
    bt = engine.block_table[:1].clone()
    bt[0, :4] = torch.arange(1, 5)
    ctx = torch.tensor([40])
    valid = torch.ones(b, dtype=torch.bool)
    root = torch.tensor([5])
    h = engine.runner.hidden_size
    inp = DraftInputs(root=root, normed=torch.zeros(b, h), feedback=torch.zeros(b, h), ctx_len=ctx, block_table=bt,
                      row_valid=valid)
    rows = []
    plain, _ = count(lambda: plain_step(engine.decoder, engine.caches, bt, ctx, root, valid, SamplingParams(), None))
    rows.append({"step": "plain decode", "ops": plain, "in_plain_steps": 1.0})
    cases = [("greedy tree d5 k8 n32", SpecConfig(shape="tree", depth=5, topk=8, num_nodes=32), SamplingParams()),
             ("greedy chain d5", SpecConfig(shape="chain", depth=5), SamplingParams()),
             ("T=1 sampled tree 4,2,1,1,1", SpecConfig(shape="tree", depth=5), SamplingParams(temperature=1.0)),
             ("T=1 sampled chain d5", SpecConfig(shape="chain", depth=5), SamplingParams(temperature=1.0))]
    gen = torch.Generator().manual_seed(0)
    for name, spec, params in cases:
        total, counts = count(lambda s=spec, q=params: speculate(engine.decoder, engine.runner, engine.caches, inp, s, q, gen))
        drafting, _ = count(lambda s=spec, q=params: draft_round(engine.runner, engine.caches.drafter, inp, s, q, gen))
        rows.append({"step": name, "ops": total, "drafting_ops": drafting, "in_plain_steps": total / plain,
                     "top_ops": counts.most_common(6)})
    rows += controlled_rows(engine, inp, plain, bt, ctx, root, valid)
    print(f"{'step':<28} {'ops':>6} {'drafting (controller: deciding)':>9} {'x plain':>8} {'as on CUDA: extra':>18}")
    for r in rows:
        print(f"{r['step']:<28} {r['ops']:>6} {r.get('drafting_ops', r.get('decision_ops', '')):>9} "
              f"{r['in_plain_steps']:8.2f} {r.get('gpu_extra_ops', ''):>18}")
    for r in rows:
        if "gpu_extra_by_op" in r:
            print(f"{r['step']}: extra ops as on CUDA {r['gpu_extra_by_op']}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"target": args.target, "rows": rows}, indent=1))


def controlled_rows(engine, inp, plain: int, bt, ctx, root, valid) -> list[dict]:
    """The draft controller's ahead-mode rounds against the fixed tree of the same (depth, width): what deciding
    adds (the criterion at every depth, the next round's plan, the calibration's evidence), as tensor ops (the
    CPU's path) and as CUDA runs it (the decision its ``DECISION_LAUNCHES`` Triton launches: ``gpu_ops``), and
    its plain round (a plain step that defers the drafter's entry)."""
    from torchspec.runtime import controlled_rounds
    from torchspec.runtime.calibration import Calibration
    from torchspec.runtime.drafting import SpecConfig
    from torchspec.runtime.round_costs import RoundCosts
    from torchspec.runtime.sampling import SamplingParams
    from torchspec.runtime.steps import plain_step_deferring_drafter, speculate

    greedy, rows = SamplingParams(), []
    ops, _ = count(lambda: plain_step_deferring_drafter(engine.decoder, engine.runner, engine.caches, bt, ctx, root,
                                                        valid, None))
    rows.append({"step": "controller plain round", "ops": ops, "in_plain_steps": ops / plain})
    for shape, depth, width in (("tree", 1, 8), ("tree", 3, 8), ("tree", 5, 32), ("chain", 1, 1), ("chain", 3, 3)):
        spec = SpecConfig(shape=shape, depth=depth, topk=8, num_nodes=width)
        costs = RoundCosts(torch.full((5,), 0.1), 1 + 0.01 * torch.arange(33.0), Calibration(torch.device("cpu")),
                           plan=(depth, width))
        fixed, fixed_counts = count(lambda s=spec: speculate(engine.decoder, engine.runner, engine.caches, inp, s,
                                                             greedy, None))
        ctl, counts = count(lambda s=spec, c=costs: speculate(engine.decoder, engine.runner, engine.caches, inp, s,
                                                              greedy, None, costs=c))
        tensor_decide = controlled_rounds.decide_every_depth_calibrated
        controlled_rounds.decide_every_depth_calibrated = as_launches(tensor_decide, DECISION_LAUNCHES)
        try:
            gpu, gpu_counts = count(lambda s=spec, c=costs: speculate(engine.decoder, engine.runner, engine.caches,
                                                                      inp, s, greedy, None, costs=c))
        finally:
            controlled_rounds.decide_every_depth_calibrated = tensor_decide
        fixed_name = f"fixed tree d{depth} k8 n{width}" if shape == "tree" else f"fixed chain d{depth}"
        rows.append({"step": fixed_name, "ops": fixed, "in_plain_steps": fixed / plain})
        rows.append({"step": f"controller {shape} ({depth}, {width})", "ops": ctl, "in_plain_steps": ctl / plain,
                     "decision_ops": ctl - fixed, "gpu_ops": gpu, "gpu_extra_ops": gpu - fixed,
                     "gpu_extra_by_op": dict((gpu_counts - fixed_counts).most_common()),
                     "top_ops": counts.most_common(6)})
    return rows


if __name__ == "__main__":
    main()
