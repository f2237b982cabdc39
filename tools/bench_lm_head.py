"""LM-head share of one drafting step: EAGLE-3 pruned head vs EAGLE-4 full head vs EAGLE-4
efficient head (rank-r scorer over V + top-k + exact re-score of the k candidates).

A cost model, not the trainer's code: one drafter decode step at batch 1 over a KV cache,

    x = eh_proj(cat(norm(embed(token)), norm(hidden)))          2H -> H
    x = x + o_proj(attn(q_proj, k_proj, v_proj of norm(x), RoPE, KV cache of `context` tokens))
    x = x + down(silu(gate(norm(x))) * up(norm(x)))             SwiGLU
    y = norm(x);  draft = head(y)

with n new tokens per step: 1 (chain drafting) or 16 (tree drafting; the new tokens attend to the
whole cache and to each other under a mask, lower-triangular here, which costs what a tree mask
costs). Heads: (a) ``eagle3_pruned``: dense [32000, H] matmul + argmax (chain) / top-`branch`
(tree) + d2t offset; (b) ``eagle4_full``: the same over all V rows; (c) ``eagle4_efficient``:
``EfficientLMHead.candidates`` (the real inference path) + argmax / top-`branch` of the k exact
logits. Defaults are the flagship shapes: H 5120, V 248,320, 24 query / 4 KV heads of dim 256,
MLP 17,408, context 2048, rank 128, top-128, bf16.

Timing (CUDA): warm-up, then per iteration the L2 is flushed (a read of 4x its size, outside the
timed region: in a real round the body's ~0.8 GB of weights evict the head's), a CUDA event pair
around one call, a sync; the median of ``--iters`` samples over ``--rounds`` interleaved rounds
(the per-round medians show the spread). Eager always; with ``--graphs`` also one CUDA graph per
measured function, since a batch-1 decode step is launch-bound in eager mode. Reported per
(mode, head, eager|graph): step = body + head, body alone, head alone, head share = head / step
and the marginal share (step - body) / step, and the head's memory floor (bytes it must read /
measured copy bandwidth).

    GPU:        python3 -m tools.bench_lm_head --graphs --out $OUT/bench_lm_head.json
    CPU smoke:  python -m tools.bench_lm_head --cpu --small
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from torchspec.models.lm_head import EfficientLMHead


@dataclass(frozen=True)
class Shape:
    hidden: int = 5120
    vocab: int = 248_320
    heads: int = 24
    kv_heads: int = 4
    head_dim: int = 256
    intermediate: int = 17_408
    context: int = 2048
    pruned_vocab: int = 32_000
    rank: int = 128
    topk: int = 128
    tree_tokens: int = 16
    branch: int = 8  # tree drafting: children kept per node


SMALL = Shape(hidden=64, vocab=1000, heads=4, kv_heads=2, head_dim=16, intermediate=128, context=32,
              pruned_vocab=200, rank=8, topk=16, tree_tokens=4, branch=4)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class DraftStep(nn.Module):
    """The drafter body for one decode step of ``n`` new tokens at batch 1 (see module docstring)."""

    def __init__(self, s: Shape, n: int, device, dtype):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        h, qd, kvd = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.s, self.n = s, n
        self.embed = nn.Embedding(s.vocab, h, **f)  # the target's embedding (one row read per token)
        self.embed_norm, self.hidden_norm = RMSNorm(h, device, dtype), RMSNorm(h, device, dtype)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, **f)
        self.input_norm, self.post_attn_norm = RMSNorm(h, device, dtype), RMSNorm(h, device, dtype)
        self.q_proj = nn.Linear(h, qd, bias=False, **f)
        self.k_proj = nn.Linear(h, kvd, bias=False, **f)
        self.v_proj = nn.Linear(h, kvd, bias=False, **f)
        self.o_proj = nn.Linear(qd, h, bias=False, **f)
        self.gate = nn.Linear(h, s.intermediate, bias=False, **f)
        self.up = nn.Linear(h, s.intermediate, bias=False, **f)
        self.down = nn.Linear(s.intermediate, h, bias=False, **f)
        self.norm = RMSNorm(h, device, dtype)
        for lin in (self.eh_proj, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate, self.up, self.down):
            nn.init.normal_(lin.weight, std=lin.in_features**-0.5)
        total = s.context + n
        cache = (1, s.kv_heads, total, s.head_dim)
        self.register_buffer("k_cache", torch.randn(cache, **f))
        self.register_buffer("v_cache", torch.randn(cache, **f))
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, s.head_dim, 2, device=device).float() / s.head_dim))
        freqs = torch.arange(s.context, total, device=device).float()[:, None] * inv_freq
        emb = torch.cat([freqs, freqs], -1)  # [n, D]
        self.register_buffer("cos", emb.cos().to(dtype))
        self.register_buffer("sin", emb.sin().to(dtype))
        # GQA as plain MHA over the KV heads: the `groups` query heads sharing a KV head become
        # extra query rows, so every SDPA backend applies and no K/V is repeated.
        self.groups = s.heads // s.kv_heads
        if n > 1:
            mask = torch.ones(n, total, dtype=torch.bool, device=device)
            mask[:, s.context :] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            self.register_buffer("mask", mask.repeat(self.groups, 1))  # [groups * n, total]
        else:
            self.mask = None

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat([-x2, x1], dim=-1) * self.sin

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """tokens [1, n], hidden [1, n, H] -> normed [1, n, H]."""
        s, n = self.s, self.n
        x = self.eh_proj(torch.cat([self.embed_norm(self.embed(tokens)), self.hidden_norm(hidden)], -1))
        a = self.input_norm(x)
        q = self.rope(self.q_proj(a).view(1, n, s.heads, s.head_dim).transpose(1, 2))  # [1, h, n, D]
        k = self.rope(self.k_proj(a).view(1, n, s.kv_heads, s.head_dim).transpose(1, 2))
        v = self.v_proj(a).view(1, n, s.kv_heads, s.head_dim).transpose(1, 2)
        self.k_cache[:, :, s.context :] = k
        self.v_cache[:, :, s.context :] = v
        q = q.reshape(1, s.kv_heads, self.groups * n, s.head_dim)  # [1, kv_h, groups * n, D]
        o = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=self.mask)
        o = o.reshape(1, s.heads, n, s.head_dim).transpose(1, 2).reshape(1, n, -1)
        x = x + self.o_proj(o)
        b = self.post_attn_norm(x)
        x = x + self.down(F.silu(self.gate(b)) * self.up(b))
        return self.norm(x)

    def bytes_read(self) -> int:
        """Weights read per step (the embedding contributes n rows) plus the KV cache."""
        weights = sum(p.numel() * p.element_size() for name, p in self.named_parameters() if name != "embed.weight")
        rows = self.n * self.embed.weight.shape[1] * self.embed.weight.element_size()
        return weights + rows + 2 * self.k_cache.numel() * self.k_cache.element_size()


def build_heads(s: Shape, n: int, device, dtype, gen: torch.Generator
                ) -> tuple[dict[str, Callable[[torch.Tensor], torch.Tensor]], dict[str, int], EfficientLMHead]:
    """The three heads as functions normed [1, n, H] -> draft ids [1, n] (chain) / [1, n, branch]."""
    eff = EfficientLMHead(s.hidden, s.vocab, rank=s.rank, topk=s.topk, device=device, dtype=dtype)
    pruned = torch.randn(s.pruned_vocab, s.hidden, device=device, dtype=dtype, generator=gen) * 0.02
    d2t = torch.randint(0, s.vocab - s.pruned_vocab, (s.pruned_vocab,), device=device, generator=gen)
    el = torch.finfo(dtype).bits // 8

    def pick(logits: torch.Tensor) -> torch.Tensor:  # [.., m] -> positions in the last dim
        return logits.argmax(-1, keepdim=True) if n == 1 else logits.topk(s.branch, dim=-1).indices

    def eagle3_pruned(y):
        ids = pick(F.linear(y, pruned))
        return ids + d2t[ids]

    def eagle4_full(y):
        return pick(eff.full_logits(y))

    def eagle4_efficient(y):
        ids, logits = eff.candidates(y)
        return ids.gather(-1, pick(logits))

    heads = {"eagle3_pruned": eagle3_pruned, "eagle4_full": eagle4_full, "eagle4_efficient": eagle4_efficient}
    head_bytes = {"eagle3_pruned": s.pruned_vocab * s.hidden * el,
                  "eagle4_full": s.vocab * s.hidden * el,
                  "eagle4_efficient": (s.rank * s.hidden + s.vocab * s.rank + n * s.topk * s.hidden) * el}
    return heads, head_bytes, eff


class Timer:
    """Median-of-samples timer: CUDA events with a cold L2 (or perf_counter on CPU); optional graph."""

    def __init__(self, device: torch.device, warmup: int):
        self.device, self.warmup = device, warmup
        self.cuda = device.type == "cuda"
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
            self.flush_buf = torch.empty(max(4 * l2, 256 << 20) // 4, dtype=torch.float32, device=device).normal_()

    def prepare(self, fn: Callable[[], object], graph: bool) -> Callable[[], object]:
        if not graph:
            for _ in range(self.warmup):
                fn()
            return fn
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(max(self.warmup, 3)):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        for _ in range(self.warmup):
            g.replay()
        return g.replay

    def samples(self, run: Callable[[], object], iters: int) -> list[float]:
        """Milliseconds per call."""
        out = []
        for _ in range(iters):
            if self.cuda:
                self.flush_buf.sum()  # evict the L2, outside the timed region
                torch.cuda.synchronize(self.device)  # start with an idle GPU: launch gaps count
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                run()
                out.append((time.perf_counter() - t0) * 1e3)
        return out


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy, bytes read + written per second (the memory ceiling)."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 28, dtype=torch.float32, device=device).normal_()  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * 2 * src.numel() * 4 / (start.elapsed_time(end) / 1e3)


@torch.inference_mode()
def check(body: DraftStep, heads: dict, eff: EfficientLMHead, tokens, hidden) -> dict[str, float]:
    """Correct first: finite body output, candidate logits equal the full logits at those ids,
    draft ids in range."""
    y = body(tokens, hidden)
    assert torch.isfinite(y).all(), "body output is not finite"
    ids, logits = eff.candidates(y)
    ref = eff.full_logits(y).float().gather(-1, ids)
    rel = float((logits.float() - ref).norm() / ref.norm())
    assert rel < 2e-2, f"re-scored candidate logits differ from the full head's: rel err {rel:.3g}"
    for name, head in heads.items():
        out = head(y)
        assert out.min() >= 0 and out.max() < eff.vocab_size, f"{name}: draft ids out of range"
    return {"rescore_rel_err": rel}


def run_mode(s: Shape, n: int, device, dtype, args, timer: Timer, bw: float | None) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        body = DraftStep(s, n, device, dtype)
        heads, head_bytes, eff = build_heads(s, n, device, dtype, gen)
        tokens = torch.randint(0, s.vocab, (1, n), device=device, generator=gen)
        hidden = torch.randn(1, n, s.hidden, device=device, dtype=dtype, generator=gen)
        y = body(tokens, hidden)
    checks = check(body, heads, eff, tokens, hidden)
    fns = {("body", None): lambda: body(tokens, hidden)}
    for name, head in heads.items():
        fns[("head", name)] = lambda head=head: head(y)
        fns[("step", name)] = lambda head=head: head(body(tokens, hidden))
    fns[("part", "lowrank_scores")] = lambda: eff.lowrank_scores(y)
    fns[("part", "lowrank_scores+topk")] = lambda: eff.lowrank_scores(y).topk(s.topk, dim=-1, sorted=False)
    fns[("part", "candidates")] = lambda: eff.candidates(y)

    variants = ["eager"] + (["graph"] if args.graphs and device.type == "cuda" else [])
    times: dict[tuple, list[list[float]]] = {}
    errors: dict[str, str] = {}
    with torch.inference_mode():
        prepared = {}
        for variant in variants:
            for key, fn in fns.items():
                try:
                    prepared[(variant, *key)] = timer.prepare(fn, graph=variant == "graph")
                except Exception as e:  # a failed capture costs one entry, not the whole run
                    if variant == "eager":
                        raise
                    errors[f"{variant}/{key}"] = repr(e)
                    print(f"warning: graph capture of {key} failed: {e!r}")
        for _ in range(args.rounds):  # interleaved rounds: the per-round medians show the spread
            for key, run in prepared.items():
                times.setdefault(key, []).append(timer.samples(run, args.iters))

    def med(key):
        rounds = times.get(key)
        return None if rounds is None else statistics.median([t for r in rounds for t in r])

    def round_meds(key):
        return [statistics.median(r) for r in times.get(key, [])]

    rows = []
    body_bytes = body.bytes_read()
    for variant in variants:
        body_ms = med((variant, "body", None))
        for name in heads:
            step_ms, head_ms = med((variant, "step", name)), med((variant, "head", name))
            row = {
                "mode": "chain" if n == 1 else "tree", "tokens": n, "head": name, "variant": variant,
                "step_ms": step_ms, "body_ms": body_ms, "head_ms": head_ms,
                "head_share": None if step_ms is None or head_ms is None else head_ms / step_ms,
                "marginal_share": None if step_ms is None or body_ms is None else (step_ms - body_ms) / step_ms,
                "head_bytes": head_bytes[name], "body_bytes": body_bytes,
                "head_floor_ms": None if bw is None else head_bytes[name] / bw * 1e3,
                "body_floor_ms": None if bw is None else body_bytes / bw * 1e3,
                "round_medians_ms": {"step": round_meds((variant, "step", name)),
                                     "body": round_meds((variant, "body", None)),
                                     "head": round_meds((variant, "head", name))},
                "checks": checks,
            }
            if name == "eagle4_efficient":
                row["parts_ms"] = {p: med((variant, "part", p))
                                   for p in ("lowrank_scores", "lowrank_scores+topk", "candidates")}
            rows.append(row)
    if errors:
        rows.append({"mode": "chain" if n == 1 else "tree", "errors": errors})
    return rows


def fmt(x: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * scale:.{digits}f}"


def markdown(rows: list[dict]) -> str:
    lines = ["| mode | tokens | head | variant | step ms | body ms | head ms | head share | marginal share "
             "| head floor ms |", "|" + "---|" * 10]
    for r in rows:
        if "errors" in r:
            continue
        lines.append(f"| {r['mode']} | {r['tokens']} | {r['head']} | {r['variant']} | {fmt(r['step_ms'])} "
                     f"| {fmt(r['body_ms'])} | {fmt(r['head_ms'])} | {fmt(r['head_share'], 100, 1)}% "
                     f"| {fmt(r['marginal_share'], 100, 1)}% | {fmt(r['head_floor_ms'])} |")
    parts = [r for r in rows if "parts_ms" in r]
    if parts:
        lines += ["", "efficient head, cumulative parts (ms):", "",
                  "| mode | variant | lowrank scores | + top-k | + gather/re-score (candidates) |", "|---|---|---|---|---|"]
        for r in parts:
            p = r["parts_ms"]
            lines.append(f"| {r['mode']} | {r['variant']} | {fmt(p['lowrank_scores'])} "
                         f"| {fmt(p['lowrank_scores+topk'])} | {fmt(p['candidates'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test; use with --small)")
    p.add_argument("--small", action="store_true", help="tiny shapes")
    p.add_argument("--graphs", action="store_true", help="also time CUDA-graph replays")
    p.add_argument("--context", type=int, default=None, help="KV-cache length (default 2048; small: 32)")
    p.add_argument("--tree-tokens", type=int, default=None, help="new tokens per tree step (default 16)")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--topk", type=int, default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--iters", type=int, default=50, help="timed samples per round (>= 20)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="write the full results as JSON here")
    args = p.parse_args(argv)
    if args.iters < 20 and not args.cpu:
        raise ValueError(f"--iters={args.iters}: take the median of at least 20 samples.")

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --cpu --small for the CPU smoke run")
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = getattr(torch, args.dtype or ("float32" if args.cpu else "bfloat16"))
    shape = SMALL if args.small else Shape()
    overrides = {k: v for k, v in {"context": args.context, "tree_tokens": args.tree_tokens,
                                   "rank": args.rank, "topk": args.topk}.items() if v is not None}
    shape = replace(shape, **overrides)

    timer = Timer(device, args.warmup)
    bw = copy_bandwidth(device)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "dtype": str(dtype), "copy_bandwidth_GBps": None if bw is None else bw / 1e9, "shape": asdict(shape),
           "iters": args.iters, "rounds": args.rounds, "warmup": args.warmup}
    print(json.dumps({k: v for k, v in env.items() if k != "shape"}))
    rows = []
    for n in (1, shape.tree_tokens):
        rows += run_mode(shape, n, device, dtype, args, timer, bw)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
