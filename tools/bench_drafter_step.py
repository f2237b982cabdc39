"""One drafter training step at production shapes, timed, with analytic FLOPs and MFU.

    python tools/bench_drafter_step.py --shape qwen3-8b --drafter eagle3 eagle4 --head full efficient \\
        --seq 2048 4096 --out docs/bench/drafter_step_h200.json
    python tools/bench_drafter_step.py --shape flagship --drafter eagle4 --head efficient --seq 4096 --profile \\
        --out docs/bench/drafter_step_h200.json
    CPU smoke:  python tools/bench_drafter_step.py --shape tiny --drafter eagle4 --head full --seq 64 --out /tmp/s.json

A **step** is what training does per optimizer step at batch 1 and no gradient accumulation: the
TTT unroll of K=7 steps with the fused head loss (``TrainingEngine.unroll``), backward, and the optimizer
step (clip, AdamW, LR schedule), through the "none" engine of ``torchspec/train/engine.py`` at the
production precision (``--precision auto``: bf16 parameters with fp32 master weights on CUDA, fp32
on the CPU). Inputs are random: token ids, the three captured target states 3 x [1, T, H], the
target's post-norm last hidden [1, T, H] and a target LM head [V, H] (bf16 on CUDA) as the
``TeacherHead``. The drafter is the ``torchspec/conf/drafter/{eagle3,eagle4}.yaml`` preset (the recipe's
``build_drafter``) sized for the shape; ``--head full`` is EAGLE-4 with ``lm_head_rank=0``,
``efficient`` the preset's rank-128 head (EAGLE-3 has only its dense draft-vocabulary head; the
eagle3 x efficient case is skipped).

**FLOPs** (analytic, per step): 6 T (N_fc + K N_step) + K * 3 * 2 * 2 * P * heads * head_dim, with
N_fc the fc weight (3H x H, once per sequence), N_step the trainable matmul weights used by every
TTT step (every trainable 2-D weight but fc: eh_proj, q/k/v/o, MLP, the LM head [V or Vd, H] and,
for the efficient head, its scorer r (H + V)), and P = sum_t min(t + 1, window) the causal query-key
pairs (T (T + 1) / 2 without a sliding window). Not counted: the teacher's logits (frozen, 2 T V H)
and the TTT diagonal keys. MFU = FLOPs / step time / ``PEAK_BF16_FLOPS`` (the H200's dense bf16
rate measured on the lent machines; the row's ``device`` names the GPU it ran on). On the CPU no
rate claim is made: ``mfu`` is null.

**Timing**: each case builds its drafter, engine and inputs in a fresh CUDA memory state, runs
``--warmup`` steps (flex attention and Triton compile there), then ``--iters`` steps each between a
pair of CUDA events; ``step_ms`` is the median, ``peak_gib`` ``torch.cuda.max_memory_allocated``
from the warm-up on (parameters, fp32 masters, AdamW state and activations included).
``--profile`` then runs ``torch.profiler`` over ``--profile-steps`` steps and prints the top 15
kernels by CUDA time and the share of kernel time inside the ``head_loss`` range that ``ttt.py``
puts around the fused head loss (its forward computes the gradients too), also stored in the row.

Rows (one per measured case) are merged into ``--out`` (a JSON list; a row with the same shape,
drafter, head, seq, batch, ttt_steps, precision and device is replaced) through a temporary file
and ``os.replace``; a markdown table of this run's rows is printed at the end. A case that fails
(out of memory, a compile error) is reported and tabled, never written, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from omegaconf import OmegaConf  # noqa: E402

from torchspec.config import DrafterConfig  # noqa: E402
from torchspec.data.vocab import build_vocab_mapping  # noqa: E402
from torchspec.models import build_drafter  # noqa: E402
from torchspec.train.engine import OptimConfig, build_engine  # noqa: E402
from torchspec.train.loss import TeacherHead  # noqa: E402
from torchspec.train.optim import resolve_precision  # noqa: E402
from torchspec.train.ttt import HeadLossConfig, valid_counts  # noqa: E402

PEAK_BF16_FLOPS = 790e12  # H200 dense bf16 matmul rate, measured on the lent H200s: the MFU denominator
TTT_STEPS, DECAY = 7, 0.8

# The target's config.json fields the drafter is sized from (and the EAGLE-3 draft vocabulary).
SHAPES: dict[str, dict] = {
    "qwen3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=12288, vocab_size=151_936, num_hidden_layers=36, rope_theta=1e6,
                     draft_vocab_size=32_000),
    "flagship": dict(hidden_size=5120, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                     intermediate_size=17408, vocab_size=248_320, num_hidden_layers=64, rope_theta=1e7,
                     draft_vocab_size=32_000),
    "smollm2": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49_152, num_hidden_layers=30, rope_theta=1e5,
                    draft_vocab_size=32_000),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=512, num_hidden_layers=4, rope_theta=1e4, draft_vocab_size=128,
                 lm_head_rank=16, lm_head_topk=16),  # rank 128 needs H >= 128
}
ROW_KEY = ("shape", "drafter", "head", "seq", "batch", "ttt_steps", "precision", "device", "compile")


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"  # e.g. a copy of the tree without .git: pass --git
    return sha + ("+dirty" if dirty else "")


def drafter_config(drafter: str, head: str, shape: dict) -> DrafterConfig:
    """The torchspec/conf/drafter preset as the recipe composes it, with the head choice applied."""
    preset = OmegaConf.load(REPO / "torchspec" / "conf" / "drafter" / f"{drafter}.yaml")
    cfg: DrafterConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DrafterConfig), preset))
    if drafter == "eagle3":
        cfg.draft_vocab_size = shape["draft_vocab_size"]
    elif head == "full":
        cfg.lm_head_rank = 0
    elif "lm_head_rank" in shape:
        cfg.lm_head_rank, cfg.lm_head_topk = shape["lm_head_rank"], shape["lm_head_topk"]
    return cfg


def build_case(drafter_name: str, head: str, shape: dict, device: torch.device, dtype: torch.dtype):
    """(drafter on ``device``, fp32, initialised like the recipe does; the target's embedding and head)."""
    target = SimpleNamespace(**{k: v for k, v in shape.items() if k not in ("draft_vocab_size", "lm_head_rank",
                                                                          "lm_head_topk")},
                             rms_norm_eps=1e-6, max_position_embeddings=32768)
    layers = target.num_hidden_layers
    aux_ids = [1, layers // 2 - 1, layers - 4]
    g = torch.Generator(device=device).manual_seed(0)
    embed = torch.randn(target.vocab_size, target.hidden_size, generator=g, device=device).to(dtype)
    head_w = (torch.randn(target.vocab_size, target.hidden_size, generator=g, device=device) * 0.02).to(dtype)
    with torch.device(device):
        drafter = build_drafter(drafter_config(drafter_name, head, shape), target, aux_ids).to(device)
    if hasattr(drafter, "set_vocab_mapping"):  # EAGLE-3: a pruned vocabulary from (random) frequencies
        freqs = torch.randint(0, 1000, (target.vocab_size,), generator=torch.Generator().manual_seed(0))
        drafter.set_vocab_mapping(*(t.to(device) for t in build_vocab_mapping(freqs, shape["draft_vocab_size"])))
    drafter.init_from_target(embed, head_w, True)
    del embed
    return drafter.float().train(), head_w


def analytic_flops(drafter, seq: int, steps: int) -> tuple[float, int]:
    """(FLOPs of one step, trainable matmul weights per TTT step N_step): see the module docstring."""
    n_fc = drafter.fc.weight.numel()
    n_step = sum(p.numel() for n, p in drafter.named_parameters()
                 if p.requires_grad and p.dim() == 2 and not n.startswith("fc."))
    window = getattr(drafter.config, "sliding_window", None) or seq
    pairs = sum(min(t + 1, window) for t in range(seq))
    attn = steps * 3 * 2 * 2 * pairs * drafter.config.num_attention_heads * drafter.config.head_dim
    return 6 * seq * (n_fc + steps * n_step) + attn, n_step


def make_inputs(shape: dict, seq: int, device: torch.device, dtype: torch.dtype, head_w: torch.Tensor) -> dict:
    g = torch.Generator(device=device).manual_seed(1)
    h, v = shape["hidden_size"], shape["vocab_size"]
    ids = torch.randint(0, v, (1, seq), generator=g, device=device)
    mask = torch.ones(1, seq, dtype=torch.long, device=device)  # every position scored
    aux = [torch.randn(1, seq, h, generator=g, device=device).to(dtype) for _ in range(3)]
    last = torch.randn(1, seq, h, generator=g, device=device).to(dtype)  # post-norm: unit RMS
    return {"ids": ids, "mask": mask, "aux": aux, "teacher": TeacherHead(last, head_w),
            "denominators": valid_counts(mask, TTT_STEPS)}


def train_step(engine, x: dict, head_loss: HeadLossConfig) -> None:
    result = engine.unroll(x["ids"], x["mask"], x["aux"], x["teacher"], x["denominators"], TTT_STEPS, DECAY,
                           head_loss=head_loss)
    engine.backward(result.loss)
    engine.step()


def timed_steps(fn, iters: int, cuda: bool) -> list[float]:
    """Milliseconds of each of ``iters`` calls: CUDA event pairs (one sync at the end) or wall clock."""
    if not cuda:
        out = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - start))
        return out
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def profile_steps(fn, steps: int, cuda: bool) -> dict:
    """torch.profiler over ``steps`` calls: the top 15 kernels and the share inside ``head_loss``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function("drafter_step"):
                fn()
        if cuda:
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    head = [e for e in events if e.name == "head_loss"]
    if not cuda:  # no kernels: CPU time of the range over the steps' CPU time
        step_us = sum(e.cpu_time_total for e in events if e.name == "drafter_step")
        share = sum(e.cpu_time_total for e in head) / step_us if head and step_us else None
        print(f"head_loss share of the step's CPU time: {share if share is None else f'{100 * share:.1f}%'} (CPU run)")
        return {"head_loss_share": share, "head_loss_ms": sum(e.cpu_time_total for e in head) / 1e3 / steps}
    kernels: dict[str, float] = defaultdict(float)  # device-side kernel events only (each counted once)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and e.name not in ("drafter_step", "head_loss"):
            kernels[e.name] += e.device_time_total
    total = sum(kernels.values())
    if head:
        in_head = sum(getattr(e, "device_time_total", None) or e.cuda_time_total for e in head)
        how = "kernels launched inside record_function('head_loss')"
    else:  # fallback: the Triton row pass of the fused loss, by name (its GEMMs are not separable)
        in_head = sum(t for name, t in kernels.items() if "head_rows" in name)
        how = "kernel names containing 'head_rows' only (no head_loss range found)"
    print(f"\ntop 15 kernels by CUDA time over {steps} steps ({total / 1e3 / steps:.1f} ms of kernels per step):")
    print("| kernel | ms/step | share |\n|---|---|---|")
    for name, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:15]:
        print(f"| {name[:100]} | {t / 1e3 / steps:.2f} | {100 * t / total:.1f}% |")
    share = in_head / total if total else None
    print(f"head + loss: {in_head / 1e3 / steps:.1f} ms/step = {100 * share:.1f}% of kernel time ({how})")
    return {"head_loss_share": share, "head_loss_ms": in_head / 1e3 / steps}


def run_case(args, shape_name: str, drafter_name: str, head: str, seq: int, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    shape = SHAPES[shape_name]
    amp = resolve_precision(args.precision, device)
    precision = "bf16" if amp is not None else "fp32"
    dtype = torch.bfloat16 if amp is not None else torch.float32  # the target's tensors
    drafter, head_w = build_case(drafter_name, head, shape, device, dtype)
    attn_backend = drafter_config(drafter_name, head, shape).attn_backend
    if attn_backend == "auto":  # torchspec.models.attention.ttt_attention_auto
        attn_backend = "flex" if cuda else "chunked"
    flops, n_step = analytic_flops(drafter, seq, TTT_STEPS)
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    engine = build_engine("none", drafter, OptimConfig(lr=1e-5, max_grad_norm=0.5), lambda s: 1.0, precision=precision,
                          compile_layer=args.compile)
    x = make_inputs(shape, seq, device, dtype, head_w)
    head_loss = HeadLossConfig(chunk_gib=args.loss_chunk_gib)

    def step() -> None:
        train_step(engine, x, head_loss)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step()
    ms = statistics.median(timed_steps(step, args.iters, cuda))
    tflops = flops / (ms / 1e3) / 1e12
    row = {"shape": shape_name, "drafter": drafter_name, "head": head, "seq": seq, "batch": 1,
           "ttt_steps": TTT_STEPS, "precision": precision, "step_ms": round(ms, 3),
           "tokens_per_s": round(seq / (ms / 1e3), 1), "tflops": round(tflops, 2),
           "mfu": round(tflops * 1e12 / PEAK_BF16_FLOPS, 4) if cuda else None,
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
           "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "flops": flops, "n_step": n_step, "trainable_params": trainable,
           "attn_backend": attn_backend, "compile": args.compile, "loss_chunk_gib": args.loss_chunk_gib,
           "warmup": args.warmup, "iters": args.iters, "git": args.git or git_commit(), "torch": torch.__version__}
    if args.profile:
        row.update(profile_steps(step, args.profile_steps, cuda))
    return row


def merge_rows(path: Path, rows: list[dict]) -> None:
    """Rows of ``path`` (a JSON list) updated with ``rows`` by ``ROW_KEY``; written atomically."""
    old = json.loads(path.read_text()) if path.is_file() and path.stat().st_size else []
    if not isinstance(old, list):
        raise ValueError(f"--out {path}: expected a JSON list of rows, found {type(old).__name__}.")
    new_keys = {tuple(r.get(k) for k in ROW_KEY) for r in rows}
    merged = [r for r in old if tuple(r.get(k) for k in ROW_KEY) not in new_keys] + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | drafter | head | seq | step ms | tokens/s | TFLOP/s | MFU | peak GiB | head+loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['drafter']} | {r['head']} | {r['seq']} | {r['error']} | | | | | |")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        share = r.get("head_loss_share")
        lines.append(f"| {r['shape']} | {r['drafter']} | {r['head']} | {r['seq']} | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['tflops']:.1f} | {mfu} | {peak} | "
                     f"{'' if share is None else f'{100 * share:.0f}%'} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", required=True, choices=sorted(SHAPES))
    p.add_argument("--drafter", nargs="+", required=True, choices=["eagle3", "eagle4"])
    p.add_argument("--head", nargs="+", required=True, choices=["full", "efficient"])
    p.add_argument("--seq", nargs="+", required=True, type=int, help="tokens T of the one sequence")
    p.add_argument("--out", required=True, type=Path, help="JSON list of rows, merged (see module docstring)")
    p.add_argument("--profile", action="store_true", help="torch.profiler after timing: top kernels, head+loss share")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 parameters + fp32 masters on CUDA, fp32 on the CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the drafter's decoder layer")
    p.add_argument("--loss-chunk-gib", type=float, default=HeadLossConfig().chunk_gib)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--git", default=None, help="commit to record (default: git rev-parse HEAD of this tree)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows, failed = [], False
    for shape, drafter, head, seq in itertools.product(args.shape, args.drafter, args.head, args.seq):
        if drafter == "eagle3" and head == "efficient":
            print(f"skip {shape} eagle3 efficient: EAGLE-3 has only its dense draft-vocabulary head")
            continue
        try:
            row = run_case(args, shape, drafter, head, seq, device)
        except Exception as err:  # one failing case (OOM, a compile error) must not cost the others
            traceback.print_exc()
            failed = True
            row = {"shape": shape, "drafter": drafter, "head": head, "seq": seq, "batch": 1, "ttt_steps": TTT_STEPS,
                   "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "error": "out of memory" if isinstance(err, torch.OutOfMemoryError) else type(err).__name__,
                   "detail": (str(err).splitlines() or [""])[0][:300], "git": args.git or git_commit(),
                   "torch": torch.__version__}
        gc.collect()  # the next case starts from a fresh CUDA memory state
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        print(json.dumps(row), flush=True)
        rows.append(row)
    measured = [r for r in rows if "error" not in r]  # a failed case never replaces a measurement
    if measured:
        merge_rows(args.out, measured)
    print(f"\n# drafter step: TTT K={TTT_STEPS} + loss + backward + AdamW, batch 1, "
          f"MFU against {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s (H200 bf16 dense)\n")
    print(markdown(rows))
    if failed:
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
