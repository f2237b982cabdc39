"""Where the host waits in a decode round: a profiler timeline of plain decoding, a fixed tree and the draft
controller (issue 14: "host never waits inside a round").

Each mode decodes the same prompts once under ``torch.profiler`` (CPU + CUDA activity) with the engine's
decode round (``engine_forwards.decode_round``) wrapped in a ``decode_round`` annotation. From the trace
every round gets: its launches (``cudaGraphLaunch`` / kernel launches), its host syncs
(``cudaStreamSynchronize`` and the like) and how long the host sat in them, the GPU time of the kernels it
started, and the GPU's idle gap from the round's last kernel to the next round's first (the time from the
end of a round to the next: the host's bookkeeping and the controller's plan lookup). Rounds that captured a
CUDA graph (a shape first seen) are counted apart and left out of the medians. A sync that comes
before the round's last launch is a wait *inside* the round (the host-chained design reads a score after
every depth); the controller's ahead mode should show none: one sync a round, after its one launch,
which carries the committed tokens and the next round's plan.

The controller's rounds are also summarised by kind (``controller_by_kind``: each label of
``engine.round_kinds`` with 3 replayed rounds or more, e.g. ``d2w16`` deciding beside ``held d2w16``): what deciding
costs on the GPU (``gpu_ms``: kernel time, without the gaps between kernels) and on the host (``round_ms``).

Prints a table, writes ``--out`` (JSON, atomic) and ``--plot`` (PNG: host and GPU lanes of a few rounds a
mode). Engines as ``tools/bench_controller.py`` builds them (the controlled pair at ``--shape``, or a real
``--target`` with one ``--drafter name=export``); the controller's cost table from ``--costs``
(``torchspec-profile`` or bench_controller's ``.costs.json``), else measured here first.

    python tools/controller_timeline.py --target smollm2 --drafter eagle4=outputs/eagle4/drafter \\
        --prompt-set mtbench --concurrency 1 --costs costs.json --out docs/bench/controller_timeline_h200.json \\
        --plot docs/img/controller_timeline_h200.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import sys
import tempfile

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_controller import bench_prompts, cost_table, engines, parse_tree  # noqa: E402

from torchspec.cli import check_at_least, user_errors  # noqa: E402
from torchspec.io import atomic_write_text  # noqa: E402
from torchspec.runtime import engine_forwards  # noqa: E402
from torchspec.runtime.drafting import SpecConfig  # noqa: E402

ROUND = "decode_round"  # the annotation around each decode round
LAUNCH = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cuStreamSynchronize")
CAPTURE = ("cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphInstantiate")  # a round that captured a graph
GPU = ("kernel", "gpu_memcpy", "gpu_memset")
FIELDS = ("rounds", "captured_rounds", "launches_per_round", "syncs_per_round", "syncs_before_last_launch", "host_wait_ms", "gpu_ms",
          "gap_ms", "round_ms")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", help="controlled pair shape (without --target)")
    p.add_argument("--noise", default="0.0", help="the controlled drafter's eh_proj noise, or 'untrained'")
    p.add_argument("--target", help="a real target (dir | .gguf | alias)")
    p.add_argument("--drafter", action="append", default=[], help="name=export, once (untrained=export: re-initialised)")
    p.add_argument("--prompt-set", help="with --target: prompts of a set (mtbench, humaneval, a file)")
    p.add_argument("--cache-dir", default="~/.cache/torchspec")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--tree", default="5x8x32", help="the fixed tree, and the controller's bounds: DxKxN")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--costs", help="the controller's cost table (default: measured here)")
    p.add_argument("--show-rounds", type=int, default=6, help="rounds a mode's panel of the plot shows")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    return p


def check_args(args) -> SpecConfig:
    for flag, v in (("--concurrency", args.concurrency), ("--max-new-tokens", args.max_new_tokens),
                    ("--prompt-len", args.prompt_len), ("--show-rounds", args.show_rounds)):
        check_at_least(flag, v, 1)
    if len(args.drafter) > 1:
        raise ValueError(f"--drafter given {len(args.drafter)} times; the timeline shows one drafter.")
    if args.target and not args.drafter:
        raise ValueError("--target needs --drafter name=export.")
    return parse_tree(args.tree, "--tree")


# --- the trace ------------------------------------------------------------------------------------------

def _union_ms(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def round_stats(events: list[dict]) -> list[dict]:
    """Per decode round (chrome-trace events, microseconds): launches, syncs, syncs before the round's
    last launch, host wait, GPU busy time and the GPU's idle gap to the next round's first kernel (ms)."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    rounds = sorted((e for e in xs if e.get("cat") == "user_annotation" and e["name"] == ROUND), key=lambda e: e["ts"])
    runtime = [e for e in xs if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if e.get("cat") in GPU)
    out = []
    for i, r in enumerate(rounds):
        start, end = r["ts"], r["ts"] + r["dur"]
        upto = rounds[i + 1]["ts"] if i + 1 < len(rounds) else float("inf")
        mine = [e for e in runtime if start <= e["ts"] <= end]
        launches = [e["ts"] for e in mine if e["name"].startswith(LAUNCH)]
        syncs = [e for e in mine if e["name"] in SYNC]
        kernels = [k for k in gpu if start <= k[0] < upto]
        out.append({"launches": len(launches), "syncs": len(syncs),
                    "captured": any(e["name"].startswith(CAPTURE) for e in mine),
                    "syncs_before_last_launch": sum(s["ts"] < max(launches) for s in syncs) if launches else 0,
                    "host_wait_ms": sum(s["dur"] for s in syncs) / 1e3, "gpu_ms": _union_ms(kernels),
                    "round_ms": r["dur"] / 1e3, "start": start, "end": end, "kernels": kernels,
                    "sync_spans": [(s["ts"], s["ts"] + s["dur"]) for s in syncs], "launch_ts": launches})
    for a, b in zip(out, out[1:]):
        a["gap_ms"] = (b["kernels"][0][0] - max(k[1] for k in a["kernels"])) / 1e3 if a["kernels"] and b["kernels"] else None
    if out:
        out[-1]["gap_ms"] = None
    return out


def summarize(mode: str, rounds: list[dict]) -> dict:
    """One table row: medians over the rounds that replayed graphs (a round that captured one, a shape first
    seen, syncs while capturing: counted in ``captured_rounds`` only); ``syncs_before_last_launch``: the total,
    which must be 0."""
    captured = sum(r["captured"] for r in rounds)
    rounds = [r for r in rounds if not r["captured"]]

    def med(key):
        values = [r[key] for r in rounds if r.get(key) is not None]
        return statistics.median(values) if values else None
    return {"mode": mode, "rounds": len(rounds), "captured_rounds": captured, "launches_per_round": med("launches"), "syncs_per_round": med("syncs"),
            "syncs_before_last_launch": sum(r["syncs_before_last_launch"] for r in rounds),
            "host_wait_ms": med("host_wait_ms"), "gpu_ms": med("gpu_ms"), "gap_ms": med("gap_ms"),
            "round_ms": med("round_ms")}


def by_kind(mode: str, rounds: list[dict], least: int = 3) -> list[dict]:
    """``summarize`` per round kind (``engine.round_kinds``' labels: a deciding round's plan ``d2w16``, a held
    one's ``held d2w16``, ``plain-deferring``...), rows named "<mode> <kind>", kinds of ``least`` replayed
    rounds or more, most rounds first: what a deciding round costs beside the held round of the same plan, on
    the GPU (``gpu_ms``) and on the host (``gap_ms``, ``round_ms``)."""
    kinds: dict[str, list[dict]] = {}
    for r in rounds:
        if r.get("kind") is not None:
            kinds.setdefault(r["kind"], []).append(r)
    rows = [summarize(f"{mode} {kind}", rs) for kind, rs in kinds.items()]
    return sorted((r for r in rows if r["rounds"] >= least), key=lambda r: -r["rounds"])


def label_rounds(rounds: list[dict], kinds: list[str]) -> list[dict]:
    """Each traced round given its kind (``kinds``: the labels ``annotated_rounds`` recorded, in order)."""
    if len(kinds) != len(rounds):  # a round the trace lost: labels would shift, so none is given
        return rounds
    for r, kind in zip(rounds, kinds):
        r["kind"] = kind
    return rounds


@contextlib.contextmanager
def annotated_rounds(kinds: list[str] | None = None):
    """``engine_forwards.decode_round`` inside a ``decode_round`` profiler annotation (restored after); each
    round's label (the key of ``engine.round_kinds`` its call counted in) appended to ``kinds``."""
    original = engine_forwards.decode_round

    def decode_round(engine, *args, **kwargs):
        before = {k: v[0] for k, v in engine.round_kinds.items()}
        with torch.profiler.record_function(ROUND):
            out = original(engine, *args, **kwargs)
        if kinds is not None:
            kinds.append(next((k for k, v in engine.round_kinds.items() if v[0] != before.get(k, 0)), "?"))
        return out
    engine_forwards.decode_round = decode_round
    import torchspec.runtime.engine as engine_module
    engine_module.decode_round = decode_round
    try:
        yield
    finally:
        engine_forwards.decode_round = original
        engine_module.decode_round = original


def profile_run(run, cuda: bool, kinds: list[str] | None = None) -> list[dict]:
    """The chrome-trace events of ``run()`` under the profiler (its rounds' labels appended to ``kinds``)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with annotated_rounds(kinds), torch.profiler.profile(activities=activities) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


# --- the figure -----------------------------------------------------------------------------------------

def plot(panels: list[tuple[str, list[dict]]], show: int, path: str) -> None:
    """One panel a mode: ``show`` rounds from the middle of its run; lanes host (round, launches, waits) and GPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.9 * len(panels)), squeeze=False)
    for ax, (mode, rounds) in zip(axes[:, 0], panels):
        mid = max(0, len(rounds) // 2 - show // 2)
        window = rounds[mid:mid + show]
        if not window:
            continue
        t0 = window[0]["start"]
        ms = lambda t, t0=t0: (t - t0) / 1e3  # noqa: E731
        for r in window:
            ax.broken_barh([(ms(r["start"]), r["round_ms"])], (2.1, 0.8), color="#c8d7ea")
            ax.broken_barh([(ms(a), (b - a) / 1e3) for a, b in r["sync_spans"]], (2.1, 0.8), color="#d62728")
            ax.vlines([ms(t) for t in r["launch_ts"]], 1.9, 3.1, color="black", linewidth=0.8)
            ax.broken_barh([(ms(a), (b - a) / 1e3) for a, b in r["kernels"]], (0.6, 0.8), color="#1f77b4")
        ax.set_yticks([1.0, 2.5], ["GPU", "host"])
        ax.set_ylim(0.3, 3.3)
        ax.set_title(f"{mode}: host round (light), launches (ticks), host waiting on the GPU (red); GPU kernels (blue)",
                     fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms")
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the run --------------------------------------------------------------------------------------------

def timeline(args) -> dict:
    tree = check_args(args)
    args.controller_mode = "ahead"
    name, engine = next(engines(args, {"noise": [args.noise]}, args.concurrency,
                                args.prompt_len + args.max_new_tokens + 160))
    prompts = bench_prompts(args, engine, args.concurrency, torch.Generator().manual_seed(args.seed))
    table = cost_table(argparse.Namespace(costs=args.costs, concurrency=str(args.concurrency), prompt_len=args.prompt_len,
                                          max_new_tokens=args.max_new_tokens, repeats=3, costs_out=None,
                                          out=args.out), engine, tree)
    cuda = engine.device.type == "cuda"
    modes = {"plain": {"spec": None}, f"fixed tree{args.tree}": {"spec": tree},
             "controller": {"spec": tree, "controller": table}}
    rows, panels, kind_rows = [], [], []
    for mode, kw in modes.items():
        def run(max_new=args.max_new_tokens, kw=kw):
            engine.generate(prompts, max_new_tokens=max_new, concurrency=args.concurrency, seed=args.seed, **kw)
        run()  # graph captures and the controller's plans settle outside the trace
        kinds: list[str] = []
        rounds = label_rounds(round_stats(profile_run(run, cuda, kinds)), kinds)
        rows.append(summarize(mode, rounds))
        panels.append((mode, rounds))
        print(format_row(rows[-1]), flush=True)
        if "controller" in kw:  # a deciding round beside the held round of its plan
            kind_rows.extend(by_kind(mode, rounds))
            for r in kind_rows:
                print("  " + format_row(r), flush=True)
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "drafter": name,
           "target": args.target or args.shape, "concurrency": args.concurrency, "cuda_graphs": engine.graphs is not None,
           "args": vars(args), "rows": rows, "controller_by_kind": kind_rows}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(out, indent=1))
    if args.plot:
        plot(panels, args.show_rounds, args.plot)
    return out


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def format_row(r: dict) -> str:
    return "  ".join(f"{k}={_fmt(r[k])}" for k in ("mode", *FIELDS))


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    with user_errors("controller_timeline"):
        return timeline(args)


if __name__ == "__main__":
    main()
