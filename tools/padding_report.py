"""Padding fraction of the training micro-batches on ShareGPT, unpacked vs packed (``data.pack``).

    python -m tools.padding_report                       # 4000 conversations, max_length 2048, mb 1/4/8
    python -m tools.padding_report --num 1000 --max-length 320 --out /tmp/padding_cpu.json

Reads ShareGPT V3 through the training data path (``build_datasets`` on ``data.path=sharegpt``,
truncation to ``max_length``, the SmolLM2 tokenizer and chat template of the default job), then
runs one epoch of ``ResumableBatchSampler`` + ``collate`` exactly as the recipe does, over the
conversations (unpacked) or over the rows of ``pack_examples`` (packed), and counts

    padding fraction = padding tokens / all tokens of the micro-batches   (attention_mask == 0)

Micro-batches are right-padded to their longest row, so micro-batch size 1 has no padding
unpacked either; what packing changes there is the tokens per micro-batch (rows near max_length
instead of one conversation). Prints a table and writes JSON (default docs/bench/padding_sharegpt.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from torchspec.data import ResumableBatchSampler, build_datasets, collate
from torchspec.data.dataset import Example
from torchspec.data.packing import pack_examples
from torchspec.targets import load_tokenizer, resolve_target_path


def epoch_stats(rows: list[Example], micro_batch_size: int, seed: int) -> dict[str, float]:
    """One epoch of the recipe's sampler + collate over ``rows``: padding and sizes of the micro-batches."""
    sampler = ResumableBatchSampler(len(rows), micro_batch_size, seed=seed)
    total = real = 0
    for _ in range(sampler.batches_per_epoch):
        mask = collate([rows[i] for i in sampler.next_batch()], pad_id=0)["attention_mask"]  # [B, T]
        total += mask.numel()
        real += int(mask.sum())
    return {
        "micro_batches": sampler.batches_per_epoch,
        "padding_fraction": 1.0 - real / total,
        "real_tokens_per_micro_batch": real / sampler.batches_per_epoch,
        "tokens_per_micro_batch": total / sampler.batches_per_epoch,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="sharegpt", help="data.path (default: the bundled ShareGPT V3)")
    p.add_argument("--target", default="smollm2", help="target.path whose tokenizer and chat template are used")
    p.add_argument("--cache-dir", default="~/.cache/torchspec", help="target.cache_dir (GGUF conversion cache)")
    p.add_argument("--num", type=int, default=4000, help="conversations read (data.max_conversations)")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/bench/padding_sharegpt.json")
    args = p.parse_args()

    started = time.time()
    tokenizer = load_tokenizer(resolve_target_path(args.target, os.path.expanduser(args.cache_dir)))
    examples, _, skips = build_datasets(args.data, tokenizer, max_length=args.max_length, eval_size=0,
                                        seed=args.seed, max_conversations=args.num)
    packed = pack_examples(examples, args.max_length)
    lengths = sorted(len(e) for e in examples)
    results = []
    for mode, rows in (("unpacked", examples), ("packed", packed)):
        for mb in args.batch_sizes:
            results.append({"mode": mode, "micro_batch_size": mb, **epoch_stats(rows, mb, args.seed)})

    report = {
        "data": args.data, "target": args.target, "max_length": args.max_length, "seed": args.seed,
        "conversations": len(examples), "skipped": skips.skipped, "tokens": sum(lengths),
        "median_length": lengths[len(lengths) // 2],
        "truncated_to_max_length": sum(n == args.max_length for n in lengths),
        "packed_rows": len(packed), "conversations_per_packed_row": len(examples) / len(packed),
        "results": results,
    }
    print(f"{args.data}: {len(examples)} conversations, {sum(lengths)} tokens, median {report['median_length']}, "
          f"{report['truncated_to_max_length']} truncated to max_length {args.max_length}; packed into "
          f"{len(packed)} rows ({report['conversations_per_packed_row']:.2f} conversations per row)")
    print(f"{'mode':<9} {'mb':>3} {'micro-batches':>14} {'padding':>9} {'real tok/mb':>12} {'tok/mb':>9}")
    for r in results:
        print(f"{r['mode']:<9} {r['micro_batch_size']:>3} {r['micro_batches']:>14} "
              f"{100 * r['padding_fraction']:>8.2f}% {r['real_tokens_per_micro_batch']:>12.0f} "
              f"{r['tokens_per_micro_batch']:>9.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} ({time.time() - started:.0f}s)")


if __name__ == "__main__":
    main()
