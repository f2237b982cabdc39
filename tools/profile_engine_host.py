"""Host (Python) time per engine step under a continuous-batching workload like regeneration.

The engine's step is host bookkeeping (scheduler, block tables, prefix cache, stop rules, the
host<->device traffic of a round) around its forwards (prefill, plain step, speculation round). With
a tiny random target (``tests/runtime_pair.py``: a mostly-bigram target and an EAGLE-4 drafter that
imitates it, so speculative rounds accept spans) the forwards cost little and the host part shows.
The workload keeps ``c`` requests in flight like ``data_pipelines/regenerate.py``: random prompt
lengths, random ``max_new_tokens`` and stop tokens, and a finished request is followed at once by a
new one -- half of them the next turn of its conversation (its prompt, its reply and a new user turn:
the prefix cache matches the earlier turns), the others a fresh prompt.

Every forward the engine runs is timed (``FORWARDS``: the step functions the engine calls and the
CUDA-graph replay); on CUDA a ``torch.cuda.synchronize()`` before and after each one makes GPU work
land inside it, so host = wall - forward is the time the host spends between forwards. A second,
shorter pass runs the same workload under cProfile with the profiler paused inside the forwards, so
its top functions by own time are host code only; on CUDA it also counts the synchronizing CUDA
calls (``torch.cuda.set_sync_debug_mode``) per step.

    python tools/profile_engine_host.py --out docs/bench/engine_host_cpu.json          # CPU
    python tools/profile_engine_host.py --device cuda --out engine_host_h200.json      # GPU, < 60 s
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pathlib
import pstats
import random
import sys
import tempfile
import time
import warnings

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchspec.runtime import engine_forwards as forwards_module  # noqa: E402
from torchspec.runtime.drafting import SpecConfig  # noqa: E402

FORWARDS = ("prefill", "plain_step", "plain_step_deferring_drafter", "speculate")  # the step functions engine_forwards.py calls, by name
MODES = {"plain": None, "chain": SpecConfig(shape="chain", depth=4),
         "tree": SpecConfig(shape="tree", depth=4, topk=4, num_nodes=16),
         "controller": SpecConfig(shape="tree", depth=4, topk=4, num_nodes=16)}  # ahead mode, within the tree
# controller: a hand-built table where drafting pays (a depth 5% of a plain step, a verified node 1%), so its
# rounds mostly draft: host time of the controller's rounds against the fixed tree's
CONTROLLER_TABLE = {"depth": 0.05, "verify_per_node": 0.01}


class ForwardTimer:
    """Wraps the engine's forwards (``FORWARDS`` and ``engine_forwards.run_graph``) to time them;
    the outermost call only (a graph capture runs the step function inside ``run_graph``)."""

    def __init__(self, cuda: bool):
        self.cuda, self.depth = cuda, 0
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.calls = {"prefill": 0, "decode": 0}
        self.profiler: cProfile.Profile | None = None  # paused inside forwards

    def wrap(self, fn, kind: str):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            if self.profiler is not None:
                self.profiler.disable()
            self._sync()
            self.depth += 1
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                self._sync()
            finally:
                self.seconds[kind] += time.perf_counter() - t0
                self.calls[kind] += 1
                self.depth -= 1
                if self.profiler is not None:
                    self.profiler.enable()
            return out
        return timed

    def _sync(self) -> None:
        if self.cuda:
            with sync_debug(0):  # our own syncs are not the engine's
                torch.cuda.synchronize()

    @contextlib.contextmanager
    def installed(self):
        saved = {name: getattr(forwards_module, name) for name in (*FORWARDS, "run_graph")}
        for name in FORWARDS:
            setattr(forwards_module, name, self.wrap(saved[name], "prefill" if name == "prefill" else "decode"))
        forwards_module.run_graph = self.wrap(saved["run_graph"], "decode")
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(forwards_module, name, fn)


@contextlib.contextmanager
def sync_debug(mode: int):
    if not torch.cuda.is_available():
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def build_engine(device: str, dtype: str, max_batch: int, max_context: int, num_layers: int, workdir: str,
                 prefill_wait: int = 0):
    """The tiny pair of the runtime tests (``tests/runtime_pair.py``), loaded like any checkpoint."""
    from tests.runtime_pair import build_pair
    from torchspec.runtime.loading import load_engine

    root = pathlib.Path(workdir)
    if not (root / "target_llama").is_dir():
        build_pair(root, num_layers=num_layers)
    options = {"prefill_wait": prefill_wait} if prefill_wait else {}
    return load_engine(str(root / "target_llama"), str(root / "drafter_llama_0"), device=device, dtype=dtype,
                       max_batch=max_batch, max_context=max_context, page_size=16, **options)


class Workload:
    """Keeps ``concurrency`` requests in flight (module docstring); draws from one seeded RNG."""

    def __init__(self, engine, concurrency: int, args, seed: int):
        self.engine, self.c, self.args = engine, concurrency, args
        self.rng = random.Random(seed)
        self.vocab = engine.decoder.vocab_size
        self.prompts: dict[int, list[int]] = {}
        self.finished_tokens = 0
        self.profiler: cProfile.Profile | None = None  # on around engine.step only

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def submit(self, follow: tuple[list[int], list[int]] | None = None) -> None:
        lo, hi = self.args.prompt_len
        prompt = self._tokens(self.rng.randint(lo, hi))
        if follow is not None and self.rng.random() < 0.5:  # the conversation's next turn
            turn = follow[0] + follow[1] + self._tokens(self.rng.randint(8, 32))
            if len(turn) + self.args.max_new[1] + 8 < self.engine.max_context:
                prompt = turn
        rid = self.engine.submit(prompt, max_new_tokens=self.rng.randint(*self.args.max_new),
                                 stop_token_ids=self._tokens(self.args.stop_tokens), ignore_eos=True)
        self.prompts[rid] = prompt

    def start(self) -> None:
        for _ in range(self.c):
            self.submit()

    @property
    def tokens(self) -> int:
        """Tokens committed so far (finished requests and the running ones)."""
        slots = self.engine.scheduler.slots
        return self.finished_tokens + sum(len(s.request.result.token_ids) for s in slots if s is not None)

    def step(self) -> tuple[float, float]:
        """One engine step, then a new request per finished one -> (step seconds, submit seconds)."""
        if self.profiler is not None:
            self.profiler.enable()
        t0 = time.perf_counter()
        done = self.engine.step()
        t1 = time.perf_counter()
        if self.profiler is not None:
            self.profiler.disable()
        for r in done:
            self.finished_tokens += len(r.token_ids)
            self.submit((self.prompts.pop(r.request_id), r.token_ids))
        return t1 - t0, time.perf_counter() - t1

    def stop(self) -> None:
        for rid in list(self.prompts):
            self.engine.cancel(rid)
        while self.engine.has_work:
            self.engine.step()


def run_config(engine, mode: str, concurrency: int, args) -> dict:
    """Warm up, time ``args.steps`` steps, then profile ``args.profile_steps`` more under cProfile."""
    cuda = engine.device.type == "cuda"
    controller = None
    if mode == "controller":
        from tests.cost_tables import linear_table

        controller = linear_table(engine, **CONTROLLER_TABLE, widths=[1, 4], nodes=list(range(17)))
    engine.configure(spec=MODES[mode], seed=args.seed, concurrency=concurrency, controller=controller)
    work = Workload(engine, concurrency, args, args.seed + concurrency)
    work.start()
    for _ in range(args.warmup):
        work.step()
    timer = ForwardTimer(cuda)
    steps, submit_s, tokens_before, rounds_before = [], 0.0, work.tokens, engine.decode_rounds
    with timer.installed():
        loop_t0 = time.perf_counter()
        for _ in range(args.steps):
            step_s, sub_s = work.step()
            steps.append(step_s)
            submit_s += sub_s
        loop_s = time.perf_counter() - loop_t0
    n = len(steps)
    wall, fwd = sum(steps), sum(timer.seconds.values())
    row = {"mode": mode, "concurrency": concurrency, "steps": n, "wall_ms": 1e3 * wall / n,
           "forward_ms": 1e3 * fwd / n, "prefill_ms": 1e3 * timer.seconds["prefill"] / n,
           "decode_ms": 1e3 * timer.seconds["decode"] / n, "host_ms": 1e3 * (wall - fwd) / n,
           "submit_ms": 1e3 * submit_s / n, "loop_ms": 1e3 * loop_s / n,
           "prefill_forwards": timer.calls["prefill"] / n, "decode_rounds": (engine.decode_rounds - rounds_before) / n,
           "tokens_per_step": (work.tokens - tokens_before) / n, "step_ms_p50": 1e3 * sorted(steps)[n // 2],
           "step_ms_max": 1e3 * max(steps)}
    row["tokens_per_s"] = row["tokens_per_step"] / (row["wall_ms"] / 1e3)
    row.update(profile_host(work, cuda, args))
    work.stop()
    row["leaked_pages"] = engine.total_pages - engine.free_pages
    return row


def profile_host(work: Workload, cuda: bool, args) -> dict:
    """cProfile over ``args.profile_steps`` steps, paused inside the forwards: the host's top functions."""
    timer, prof, syncs = ForwardTimer(cuda), cProfile.Profile(), 0
    timer.profiler = work.profiler = prof
    with timer.installed(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sync_debug(1 if cuda else 0):
            for _ in range(args.profile_steps):
                work.step()
        syncs = sum("synchronizing" in str(w.message) for w in caught)
    work.profiler = None
    stats = pstats.Stats(prof).stats
    n = args.profile_steps
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[: args.top]
    return {"syncs_per_step": syncs / n if cuda else None,
            "top": [{"function": _name(fn), "own_ms": 1e3 * tt / n, "cum_ms": 1e3 * ct / n, "calls": nc / n}
                    for fn, (_, nc, tt, ct, _) in top]}


def _name(fn: tuple) -> str:
    file, line, name = fn
    if file == "~":
        return name
    path = pathlib.Path(file)
    try:
        path = path.relative_to(REPO)
    except ValueError:
        path = pathlib.Path(path.name)
    return f"{path}:{line}({name})"


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16")
    p.add_argument("--concurrency", default="1,8,64,256")
    p.add_argument("--modes", default="plain,chain,tree", help=f"comma-separated, of {sorted(MODES)}")
    p.add_argument("--prompt-len", type=_pair, default=(16, 160), help="lo,hi (uniform)")
    p.add_argument("--max-new", type=_pair, default=(8, 96), help="lo,hi of max_new_tokens (uniform)")
    p.add_argument("--stop-tokens", type=int, default=2, help="random stop token ids per request")
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4, help="the tiny target's layers (>= 4: the drafter reads 1..3)")
    p.add_argument("--prefill-wait", type=int, default=0, help="the engine's prefill_wait (0 = its default)")
    p.add_argument("--warmup", type=int, default=8, help="steps before timing (graph captures, first prefills)")
    p.add_argument("--steps", type=int, default=32, help="timed steps per (mode, concurrency)")
    p.add_argument("--profile-steps", type=int, default=8, help="steps under cProfile per (mode, concurrency)")
    p.add_argument("--top", type=int, default=12, help="host functions reported, by own time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        p.error(f"--modes: {bad} not among {sorted(MODES)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible here")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.concurrency.split(",")]
    rows = []
    print(f"{'mode':<6} {'c':>4} {'wall ms':>9} {'forward':>9} {'host ms':>9} {'submit':>7} {'tok/step':>9} "
          f"{'tok/s':>9} {'syncs':>6}  top host function (own ms/step)", flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    out = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "args": dict(vars(args)), "rows": rows}
    with tempfile.TemporaryDirectory() as workdir:
        for c in levels:
            engine = build_engine(args.device, args.dtype, c, args.max_context, args.num_layers, workdir,
                                  args.prefill_wait)
            for mode in args.modes.split(","):
                row = run_config(engine, mode, c, args)
                rows.append(row)
                if args.out:  # after every row: a run cut short keeps what it measured
                    write_json(pathlib.Path(args.out), out)
                syncs = "-" if row["syncs_per_step"] is None else f"{row['syncs_per_step']:.1f}"
                top = row["top"][0] if row["top"] else {"function": "", "own_ms": 0.0}
                print(f"{mode:<6} {c:>4} {row['wall_ms']:9.2f} {row['forward_ms']:9.2f} {row['host_ms']:9.2f} "
                      f"{row['submit_ms']:7.2f} {row['tokens_per_step']:9.1f} {row['tokens_per_s']:9.0f} {syncs:>6}  "
                      f"{top['function']} ({top['own_ms']:.2f})", flush=True)
            del engine
    if args.out:
        print(f"wrote {args.out}")
    return out


def write_json(path: pathlib.Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    main()
