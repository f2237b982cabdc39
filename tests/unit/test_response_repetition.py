"""tools/response_repetition.py: the n-gram lookup's hits equal a naive scan, a loop is predicted and fresh
text is not, and the buckets add up."""

from __future__ import annotations

import json
import random

from tests.tool_loader import load_tool

rep = load_tool("response_repetition")


def naive_hits(context, response, n):
    seq, hits = list(context), []
    for tok in response:
        pred = None
        for i in range(len(seq) - n - 1, -1, -1):  # latest earlier occurrence of the last n tokens
            if seq[i:i + n] == seq[-n:]:
                pred = seq[i + n]
                break
        hits.append(pred == tok)
        seq.append(tok)
    return hits


def test_lookup_equals_the_naive_scan_on_random_text():
    rng = random.Random(0)
    for _ in range(50):
        ctx = [rng.randrange(5) for _ in range(rng.randrange(0, 12))]
        resp = [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
        for n in (1, 2, 3):
            assert rep.lookup_hits(ctx, resp, n) == naive_hits(ctx, resp, n), (ctx, resp, n)


def test_a_loop_is_predicted_and_distinct_tokens_are_not():
    loop = [7, 8, 9, 10] * 10
    hits = rep.lookup_hits([1, 2], loop, 3)
    assert not any(hits[:7]) and all(hits[7:])  # once a 3-gram of the loop repeats (second lap, 4th token)
    assert not any(rep.lookup_hits([1, 2], list(range(100, 140)), 3))


def test_buckets_count_every_token(tmp_path):
    records = [{"prompt_ids": [1, 2, 3], "token_ids": [5, 6, 7] * 30}, {"prompt_ids": [4], "token_ids": list(range(50))}]
    path = tmp_path / "r.responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "rep.json"
    rows = rep.main([str(path), "--bucket", "32", "--json", str(out)])
    assert sum(r["tokens"] for r in rows) == 140 and [r["start"] for r in rows] == [0, 32, 64]
    assert rows[-1]["predicted"] == 1.0  # positions 64..89: only the loop reaches them
    assert json.loads(out.read_text())["rows"] == rows
