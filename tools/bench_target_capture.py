"""Training capture of the target decoder vs transformers' forward of the same checkpoint (CPU or GPU).

    python tools/bench_target_capture.py                       # SmolLM2-135M shape, fp32, B=2, T=512
    python tools/bench_target_capture.py --threads 1 --iters 9 --dtype float32
    python tools/bench_target_capture.py --shape qwen3-8b --layers 4 --dtype bfloat16 --seq 4096 \
        --json docs/bench/target_capture_h200.json          # on the GPU

Builds a random-weight target of the given shape (``SHAPES``: SmolLM2-135M, 30 layers, hidden 576,
9/3 heads of dim 64, MLP 1536, vocabulary 49,152, tied head; or Qwen3-8B's layer shape with
``--layers`` layers) from a config, saves it, and times, interleaved so machine
load hits both alike: ``TargetDecoder.capture`` (torchspec/targets) and the transformers base model
(``model.model(...)``: what the earlier forward-hook capture ran, hooks cost nothing), unpacked
rows (causal) and packed rows (two documents per row). Prints the outputs' max difference and the
median / min time of each, wall and process CPU time. Random weights: speed only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from torchspec.data.packing import document_positions
from torchspec.targets import TargetDecoder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHAPES = {  # name -> (config class, model class, config kwargs without the layer count, default layers)
    "smollm2": (LlamaConfig, LlamaForCausalLM, dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True), 30),
    "qwen3-8b": (Qwen3Config, Qwen3ForCausalLM, dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False), 36),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    p.add_argument("--json", default=None, help="write the rows here (docs/bench/...)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, dev = DTYPES[args.dtype], torch.device(args.device)
    config_cls, model_cls, kwargs, default_layers = SHAPES[args.shape]
    layers = args.layers or default_layers
    cfg = config_cls(num_hidden_layers=layers, **kwargs)
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="bench_target_")
    with torch.device(dev):
        model_cls(cfg).to(dtype).save_pretrained(path)
    hf = model_cls.from_pretrained(path, dtype=dtype).to(dev).eval().model  # base model, no lm_head
    aux = [0, layers // 2, layers - 1]  # any three ids: capture costs the same
    ours = TargetDecoder.from_pretrained(path, aux, dtype=dtype, device=dev)
    b, t = args.batch, args.seq
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(0)).to(dev)
    docs = (torch.arange(t, device=dev) >= t * 2 // 5).long().expand(b, t)  # two documents per row
    runs = {
        "transformers unpacked": lambda: hf(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).last_hidden_state,
        "TargetDecoder unpacked": lambda: ours.capture(ids).last_hidden_state,
        "transformers packed": lambda: hf(input_ids=ids, position_ids=document_positions(docs), use_cache=False).last_hidden_state,
        "TargetDecoder packed": lambda: ours.capture(ids, document_ids=docs).last_hidden_state,
    }
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    with torch.no_grad():
        outs = {k: f() for k, f in runs.items()}  # warm-up
        diffs = {}
        for kind in ("unpacked", "packed"):
            diff = (outs[f"transformers {kind}"].float() - outs[f"TargetDecoder {kind}"].float()).abs().max().item()
            diffs[kind] = diff
            print(f"{kind}: max |last hidden difference| = {diff:.2e}")
        for _ in range(args.iters):
            for k, f in runs.items():
                c0, t0 = time.process_time(), time.perf_counter()
                f()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
    print(f"\n{args.dtype}, B={b}, T={t}, {args.device}, threads={torch.get_num_threads()}, {args.iters} iterations\n")
    print("| forward | wall median ms | wall min ms | CPU median ms |\n|---|---|---|---|")
    for k in runs:
        print(f"| {k} | {statistics.median(wall[k]) * 1e3:.1f} | {min(wall[k]) * 1e3:.1f} | "
              f"{statistics.median(cpu[k]) * 1e3:.1f} |")
    rows = []
    for kind in ("unpacked", "packed"):
        ours_ms, hf_ms = (statistics.median(wall[f"{who} {kind}"]) * 1e3 for who in ("TargetDecoder", "transformers"))
        print(f"{kind}: TargetDecoder / transformers wall-time median ratio {ours_ms / hf_ms:.3f}")
        rows.append({"shape": args.shape, "layers": layers, "rows": kind, "batch": b, "seq": t, "dtype": args.dtype,
                     "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                     "target_decoder_ms": round(ours_ms, 3), "transformers_ms": round(hf_ms, 3),
                     "ratio": round(ours_ms / hf_ms, 4), "tokens_per_s": round(b * t / ours_ms * 1e3),
                     "max_abs_diff": float(diffs[kind])})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
