"""How repetitive a target's own responses are, by position: the share of response tokens that an n-gram
lookup in the conversation so far predicts (the latest earlier occurrence of the last n tokens names the
next one), per bucket of response positions.

Greedy replies of a small model loop, and a drafter predicts a loop easily: a held-out set of long replies
reads as easier than one of short replies. This says how much, from token ids alone (no model):

    python tools/response_repetition.py /tmp/work/quality_mtbench.responses.jsonl --bucket 64 \\
        --json docs/bench/response_repetition_mtbench_h200.json

Input: ``tools/bench_quality.py``'s response cache (``<out>.responses.jsonl``: ``prompt_ids``, ``token_ids``
per line).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def lookup_hits(context: list[int], response: list[int], n: int = 3) -> list[bool]:
    """For each response token: whether the token after the latest earlier occurrence of the n tokens
    before it (in context + response so far) is that token. Linear time (a dict of last positions)."""
    seq, last, hits = list(context), {}, []
    for i in range(len(seq) - n):
        last[tuple(seq[i:i + n])] = i + n
    for tok in response:
        key = tuple(seq[-n:]) if len(seq) >= n else None
        hits.append(key in last and seq[last[key]] == tok)
        seq.append(tok)
        if len(seq) > n:
            last[tuple(seq[-n - 1:-1])] = len(seq) - 1
    return hits


def by_bucket(records: list[dict], bucket: int, n: int) -> list[dict]:
    """[{start, end, tokens, predicted}] over response positions [start, end)."""
    rows: dict[int, list[int]] = {}
    for r in records:
        for pos, hit in enumerate(lookup_hits(r["prompt_ids"], r["token_ids"], n)):
            cell = rows.setdefault(pos // bucket, [0, 0])
            cell[0] += 1
            cell[1] += hit
    return [{"start": b * bucket, "end": (b + 1) * bucket, "tokens": t, "predicted": h / t}
            for b, (t, h) in sorted(rows.items())]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("responses", help="a bench_quality <out>.responses.jsonl")
    p.add_argument("--bucket", type=int, default=64, help="response positions per row")
    p.add_argument("--ngram", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    path = pathlib.Path(args.responses)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = by_bucket(records, args.bucket, args.ngram)
    print(f"{path.name}: {len(records)} responses, {args.ngram}-gram lookup")
    for r in rows:
        print(f"  tokens {r['start']:4d}-{r['end'] - 1:4d}  {r['tokens']:6d} tokens  predicted {r['predicted']:.3f}")
    if args.json:
        from torchspec.io import atomic_write_text

        atomic_write_text(args.json, json.dumps({"source": path.name, "responses": len(records), "ngram": args.ngram,
                                                  "bucket": args.bucket, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
