"""Runtime efficiency with a drafter of controlled acceptance, at realistic target shapes (GPU).

The speedup speculation delivers is (acceptance length) x (plain step time / round time); a drafter's
quality moves the first factor, the runtime the second. To see the runtime alone this tool builds,
from configs and random weights (no files, nothing to download), a target that is *mostly bigram*
(unit-scale embedding, o_proj and down_proj scaled by ``--mix``, untied head) and an EAGLE-4 drafter built to imitate
it (eh_proj = [I, 0] plus ``--noise``, the target's head), as tests/runtime_pair.py does:
lower noise = higher acceptance. For every noise level and concurrency it decodes the same
random-token prompts with the plain decoder and with each speculative shape of the same engine
(CUDA graphs on; ``--repeats`` pairs of the two, timed together), and reports tokens/s, speedup, mean acceptance length and the efficiency
speedup / acceptance (1.0 = a round costs one plain step; the ideal a runtime approaches).

    python tools/bench_runtime_efficiency.py --shape qwen3-8b --noise 0.0,0.2 --concurrency 1,8,64 \\
        --out docs/bench/runtime_efficiency.json
    torchrun --nproc_per_node=4 tools/bench_runtime_efficiency.py ...   # TP4 target (rank 0 reports)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from functools import partial

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from recipes.bench import paired_fields, paired_timings  # noqa: E402
from torchspec.runtime.costs import bytes_per_plain_step, copy_rate_bytes_per_s, step_costs  # noqa: E402

SHAPES = {  # name: (family, hidden, layers, heads, kv_heads, head_dim, intermediate, vocab)
    "qwen3-8b": ("qwen3", 4096, 36, 32, 8, 128, 12288, 151936),
    "llama-1b": ("llama", 2048, 16, 32, 8, 64, 8192, 128256),
    "smollm2-135m": ("llama", 576, 30, 9, 3, 64, 1536, 49152),
    "tiny": ("llama", 256, 8, 4, 4, 64, 512, 1024),  # smoke runs (CPU, TP up to 4)
}


def hf_config(shape: str, num_layers: int | None = None):
    """The transformers config of a named shape (``num_layers`` overrides its layer count)."""
    from transformers import LlamaConfig, Qwen3Config

    family, h, layers, heads, kv, hd, inter, vocab = SHAPES[shape]
    layers = num_layers or layers
    cls = Qwen3Config if family == "qwen3" else LlamaConfig
    return cls(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, max_position_embeddings=4096,
               rms_norm_eps=1e-6, tie_word_embeddings=False)


TARGET_HEAD_RANK = 64  # the target's lm_head is exactly this rank: a rank-128 scorer recovers it


@torch.no_grad()
def build_engine(shape: str, mix: float, max_batch: int, max_context: int, seed: int, device: str = "cuda",
                 tp_group=None, fuse: bool = True, head_rank: int = 128, layers: int | None = None,
                 cuda_graphs: bool | None = None):
    """A mostly-bigram target of ``shape`` and the EAGLE-4 drafter that imitates it (module docstring).

    Scale-free construction, so acceptance depends on ``mix`` and the noise, not on the width or depth:
    every projection is drawn with std 1/sqrt(fan_in) (a unit-rms input gives a unit-rms output), the
    embedding with std 1, and o_proj / down_proj are scaled by mix / sqrt(2 L): the L layers add a
    residual of rms ~``mix`` to the current token's unit-rms embedding. The lm_head is a product of
    rank ``TARGET_HEAD_RANK`` (unit-variance entries), so a drafter with a low-rank scorer of rank >=
    that (``head_rank``; 0 = the full head) proposes exactly the target head's top candidates. The
    drafter's layer is scaled the same way; its eh_proj is set by ``set_noise``."""
    from torchspec.config import DrafterConfig
    from torchspec.models import build_drafter
    from torchspec.runtime.drafter_runner import DrafterRunner
    from torchspec.runtime.engine import SpeculativeEngine
    from torchspec.targets import TargetDecoder, default_aux_layer_ids

    cfg = hf_config(shape, layers)
    torch.manual_seed(seed)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    with torch.device(dev):  # under TP every rank draws the same numbers: replicated weights agree
        decoder = TargetDecoder(cfg, tp_group=tp_group)
    decoder.rope.to(dev)
    residual_scale = mix / (2 * cfg.num_hidden_layers) ** 0.5
    _scale_free_init(decoder.named_parameters(), residual_scale, tp)
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    v, h = decoder.lm_head_weight.shape
    a = torch.randn(v, TARGET_HEAD_RANK, device=dev, generator=g)
    b = torch.randn(TARGET_HEAD_RANK, h, device=dev, generator=g) / TARGET_HEAD_RANK**0.5
    decoder.lm_head_weight.copy_(a @ b)
    decoder.to(dtype)
    n = cfg.num_hidden_layers  # --layers below 8 (smoke runs): the default ids would collide
    aux = default_aux_layer_ids(n) if n >= 8 else sorted({0, n // 2, n - 1} | set(range(3)))[-3:]
    drafter = build_drafter(DrafterConfig(lm_head_rank=head_rank, sliding_window=None), cfg, aux).to(dev)
    _scale_free_init(drafter.layer.named_parameters(), mix / 2**0.5, 1)
    drafter.init_from_target(decoder.embed_tokens_weight.float(), decoder.lm_head_weight.float())
    runner = DrafterRunner(drafter.to(dtype).eval(), cfg.vocab_size)
    return SpeculativeEngine(decoder, runner, None, max_batch=max_batch, max_context=max_context, page_size=16,
                             fuse=fuse, cuda_graphs=cuda_graphs)


def _scale_free_init(named_parameters, residual_scale: float, tp: int) -> None:
    """Matrices std 1/sqrt(fan_in) (row-parallel shards: the full fan-in), the embedding std 1,
    residual writers (o_proj, down_proj) times ``residual_scale``; the lm_head is left to the caller."""
    for name, p in named_parameters:
        if p.dim() < 2 or name.startswith("lm_head"):
            continue
        writer = name.endswith(("o_proj.weight", "down_proj.weight"))
        if name.startswith("embed_tokens"):
            p.normal_(0.0, 1.0)
            continue
        p.normal_(0.0, (p.shape[-1] * (tp if writer else 1)) ** -0.5)
        if writer:
            p.mul_(residual_scale)


@torch.no_grad()
def set_noise(engine, noise: float, seed: int = 0) -> None:
    """eh_proj = [I, 0] + noise: the drafter reads the token embedding (lower noise = more agreement)."""
    w = engine.runner.model.eh_proj.weight
    h = w.shape[0]
    g = torch.Generator(device=w.device).manual_seed(seed)
    base = torch.zeros(h, 2 * h, device=w.device)
    base[:, :h] = torch.eye(h, device=w.device)
    w.copy_(base + noise / h**0.5 * torch.randn(h, 2 * h, device=w.device, generator=g))


def measure(engine, prompts, spec, max_new: int, concurrency: int) -> dict:
    engine.generate(prompts[:concurrency], max_new_tokens=8, spec=spec, ignore_eos=True, concurrency=concurrency)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rounds_before = engine.decode_rounds
    t0 = time.perf_counter()
    out = engine.generate(prompts, max_new_tokens=max_new, spec=spec, ignore_eos=True, concurrency=concurrency)
    wall = time.perf_counter() - t0
    engine_rounds = engine.decode_rounds - rounds_before
    prefill = sum(r.prefill_s for r in out)
    tokens = sum(len(r.token_ids) - 1 for r in out)
    rounds = sum(len(r.accept_lengths) for r in out)
    return {"tokens_per_s": tokens / (wall - prefill), "mean_acceptance": sum(map(sum, (r.accept_lengths for r in out)))
            / max(rounds, 1), "decode_s": wall - prefill, "tokens": tokens, "round_ms": 1e3 * (wall - prefill)
            / max(engine_rounds, 1), "outputs": [r.token_ids for r in out]}


def main() -> None:
    from torchspec.runtime.drafting import SpecConfig
    from torchspec.runtime.tp import check_tp_consistency, init_tp_from_env, is_rank0

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", help=f"one of {sorted(SHAPES)}, comma-separated for several")
    p.add_argument("--noise", default="0.0,0.2")
    p.add_argument("--mix", type=float, default=0.1)
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--head-rank", type=int, default=128,
                   help="the drafter's low-rank scorer rank (EAGLE-4's efficient head); 0 = the full head")
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count (smoke runs)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed pairs of plain and speculative runs per row, the order alternating; the row is the "
                        "median pair (recipes.bench.paired_timings)")
    p.add_argument("--out", default="runtime_efficiency.json")
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run)")
    args = p.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    copy_rate = copy_rate_bytes_per_s(args.device)
    specs = {"chain": SpecConfig(shape="chain", depth=args.depth),
             "tree": SpecConfig(shape="tree", depth=args.depth, topk=4, num_nodes=16)}
    rows = []
    tp_group, tp_device = init_tp_from_env("gloo" if args.device == "cpu" else None)
    device = str(tp_device) if tp_group is not None else args.device
    for shape in args.shape.split(","):
        engine = build_engine(shape, args.mix, max(levels), args.prompt_len + args.max_new_tokens + 64, 0,
                              device, tp_group, head_rank=args.head_rank, layers=args.layers)
        vocab = engine.decoder.vocab_size
        for noise in (float(x) for x in args.noise.split(",")):
            set_noise(engine, noise)
            g = torch.Generator().manual_seed(1)
            for c in levels:
                n = max(c, 8)
                prompts = torch.randint(0, vocab, (n, args.prompt_len), generator=g).tolist()
                for name, spec in specs.items():  # pairs of plain and speculative runs (--repeats)
                    paired = paired_timings(partial(measure, engine, prompts, None, args.max_new_tokens, c),
                                            partial(measure, engine, prompts, spec, args.max_new_tokens, c), args.repeats)
                    plain, res, speedup = paired["plain"], paired["spec"], paired["speedup"]
                    check_tp_consistency(res["outputs"], tp_group)
                    step_bytes = bytes_per_plain_step(engine, c, args.prompt_len + args.max_new_tokens / 2)
                    row = {"shape": shape, "noise": noise, "concurrency": c, "mode": name,
                           **step_costs(res["round_ms"], plain["round_ms"], step_bytes, copy_rate),
                           **paired_fields(paired), "tokens_per_s": res["tokens_per_s"],
                           "mean_acceptance": res["mean_acceptance"],
                           "efficiency": speedup / res["mean_acceptance"],
                           "identical_to_plain": sum(a == b for a, b in zip(res["outputs"], plain["outputs"])) / n}
                    rows.append(row)
                    if not is_rank0():
                        continue
                    print(f"{shape:<13} noise={noise:<4} c={c:<3} {name:<6} plain {row['plain_tokens_per_s']:8.1f} "
                          f"spec {row['tokens_per_s']:8.1f} tok/s  x{speedup:.2f}  accept {row['mean_acceptance']:.2f}"
                          f"  efficiency {row['efficiency']:.2f}  identical {row['identical_to_plain']:.2f}  step "
                          f"{row['plain_step_ms']:.2f} ms  round {row['round_cost_plain_steps']:.2f} steps"
                          + (f"  hbm {row['hbm_fraction']:.2f}" if copy_rate else ""),
                          flush=True)
        engine_tp = engine.decoder.tp_size
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not is_rank0():
        return
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = {"device": name, "tp": engine_tp, "copy_rate_gb_per_s": copy_rate / 1e9 if copy_rate else None,
           "args": vars(args), "rows": rows}
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
