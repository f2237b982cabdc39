"""Throughput of online-capture training on GPUs: TP target + data-parallel drafter, one launch.

    torchrun --nproc_per_node=2 tools/bench_train_parallel.py --tp 2 --out bench.json

Builds a random-weight target of realistic depth (default: Qwen3-8B shape: 36 layers, hidden
4096, 32/8 heads of dim 128, intermediate 12288, vocabulary 151,936), shards it with the
project's TP plan (``TargetDecoder`` over the mesh's tp group), builds the EAGLE-4 drafter at the matching shape (efficient
head included) under the FSDP2 engine over every rank, and times per micro-batch size:

* target: the tp group's union forward + capture + scatter + fp32 target logits,
* drafter: TTT unroll (K steps) + backward + optimizer step on precomputed target outputs,
* combined: the recipe's ``train_step`` (both, as in training),

reporting tokens/s per GPU, the combined step's overhead over target + drafter, and peak memory.
Micro-batch sizes double until one runs out of memory (the largest that fits is reported).
Random weights: throughput only, no quality claims. Prints a markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
import torch.distributed as dist
from transformers import Qwen3Config

from torchspec.config import DrafterConfig
from torchspec.distributed import build_mesh, init_distributed
from torchspec.models import build_drafter
from torchspec.targets import TargetDecoder, default_aux_layer_ids
from torchspec.train.engine import OptimConfig, build_engine
from torchspec.train.loss import TeacherHead
from torchspec.train.optim import warmup_cosine
from torchspec.train.step import StepStats, TTTOptions, global_denominators, target_forward, train_step


def build_target(args, mesh, device) -> TargetDecoder:
    """Random weights, built directly at this rank's shard sizes (each rank of a tp group draws its own shard)."""
    cfg = Qwen3Config(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=args.intermediate,
                      vocab_size=args.vocab, tie_word_embeddings=False, max_position_embeddings=32768)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = TargetDecoder(cfg, default_aux_layer_ids(args.layers),
                              tp_group=mesh["tp"].get_group() if args.tp > 1 else None)
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    torch.set_default_dtype(torch.float32)
    model.rope.to(device)
    torch.cuda.empty_cache()
    return model


def timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_one(args, target, engine, mb: int, tp_group, device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    ids = torch.randint(0, args.vocab, (mb, args.seq), generator=g).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    opts = TTTOptions(args.ttt_steps, 0.8, lowrank_coef=1.0, lowrank_teacher="target")

    def target_only():
        with torch.no_grad():
            aux, last = target_forward(target, batch, tp_group)
            return aux, last, TeacherHead(last, target.lm_head_weight, target.lm_head_bias)

    held = dict(zip(("aux", "last", "teacher"), target_only()))
    denominators = global_denominators([batch], opts.num_steps)

    def drafter_only():
        r = engine.unroll(ids, batch["loss_mask"], held["aux"], held["teacher"], denominators, opts.num_steps, opts.decay,
                          attention_mask=batch["attention_mask"], lowrank_coef=1.0, lowrank_teacher="target")
        engine.backward(r.loss)
        engine.step()

    def combined():
        train_step(target, engine, [batch], opts, StepStats(), tp_group)

    torch.cuda.reset_peak_memory_stats()
    t_target = timed(target_only, args.warmup, args.iters)
    t_drafter = timed(drafter_only, args.warmup, args.iters)
    held.clear()
    t_combined = timed(combined, args.warmup, args.iters)
    tokens = mb * args.seq
    return {"micro_batch": mb, "tokens_per_rank": tokens,
            "target_ms": 1e3 * t_target, "drafter_ms": 1e3 * t_drafter, "combined_ms": 1e3 * t_combined,
            "target_tok_s": tokens / t_target, "drafter_tok_s": tokens / t_drafter, "combined_tok_s": tokens / t_combined,
            "overhead_pct": 100 * (t_combined / (t_target + t_drafter) - 1),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--lm-head-rank", type=int, default=128)
    p.add_argument("--attn-backend", default="chunked", choices=("chunked", "flex", "eager"))
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    info = init_distributed(timeout_minutes=4)  # an OOM on one rank must not hang the others for long
    device = info.device
    mesh = build_mesh(info.world_size, args.tp, device.type)
    tp_group = mesh["tp"].get_group() if args.tp > 1 else None
    target = build_target(args, mesh, device)
    dcfg = DrafterConfig(lm_head_rank=args.lm_head_rank, attn_backend=args.attn_backend)
    drafter = build_drafter(dcfg, target.config, target.aux_layer_ids)
    drafter.to(device)
    drafter.init_from_target(target.embed_tokens_weight, target.lm_head_weight, True, svd_device=str(device))
    schedule = functools.partial(warmup_cosine, warmup_steps=1, max_steps=10**6, min_lr_ratio=0.1)
    engine = build_engine("fsdp2", drafter, OptimConfig(lr=1e-5, max_grad_norm=0.5), schedule, precision="bf16")
    rows, largest = [], None
    for mb in args.micro_batches:
        try:
            row = bench_one(args, target, engine, mb, tp_group, device)
        except torch.OutOfMemoryError:
            ok = torch.zeros(1, device=device)
        else:
            ok = torch.ones(1, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() == 0:
            torch.cuda.empty_cache()
            break
        largest = mb
        rows.append(row)
        if info.rank == 0:
            print(json.dumps(row), flush=True)
    if info.rank == 0:
        env = {"gpus": info.world_size, "tp": args.tp, "dp_drafter": info.world_size, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "shape": vars(args), "largest_micro_batch_that_fits": largest}
        print(f"\n# online capture training, {env['device']} x{info.world_size}, target TP{args.tp}, "
              f"drafter FSDP2 over {info.world_size}, seq {args.seq}, K={args.ttt_steps}, bf16, "
              f"attention {args.attn_backend}, lm_head_rank {args.lm_head_rank}\n")
        print("| micro-batch/rank | target tok/s/GPU | drafter tok/s/GPU | combined tok/s/GPU | overhead vs sum | peak GiB |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['micro_batch']} | {r['target_tok_s']:.0f} | {r['drafter_tok_s']:.0f} | {r['combined_tok_s']:.0f} "
                  f"| {r['overhead_pct']:+.1f}% | {r['peak_gib']:.1f} |")
        print(f"\nlargest micro-batch per rank that fits: {largest}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"env": env, "rows": rows}, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

