"""Held-out conversations for `tools/bench_quality.py`: the target's own greedy responses, cached.

Each prompt is answered once by the target through the runtime (plain greedy decoding); the answers
are cached next to the output (``<out>.responses.jsonl``, rewritten atomically) under a key of the
target's weights, dtype, device type, chat template and max new tokens, so re-runs reuse them and a
garbled line is reported by file and line and only that prompt is answered again.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# --- 1. held-out conversations: the target's own greedy responses, cached --------------------------------

def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def weights_digest(path: str, samples: int = 64, chunk: int = 1 << 16) -> str:
    """sha256 over every ``*.safetensors`` file's name, size and ``samples`` evenly spaced chunks of its
    bytes (headers included): any change of weights shows, at the cost of reading a few MiB. (The
    export fingerprint covers only the embedding and the LM head, which e.g. scaled layers keep.)"""
    digest = hashlib.sha256()
    for file in sorted(pathlib.Path(path).glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            for i in range(samples):
                f.seek(i * max(size - chunk, 0) // max(samples - 1, 1))
                digest.update(f.read(chunk))
    return digest.hexdigest()[:16]


def response_settings(path: str, decoder, tokenizer, max_new_tokens: int) -> str:
    """The cache key of the responses: what decides the target's greedy answers."""
    return _sha({"weights": weights_digest(path), "dtype": str(decoder.embed_tokens_weight.dtype),
                 "device": decoder.embed_tokens_weight.device.type, "max_new_tokens": max_new_tokens,
                 "chat_template": getattr(tokenizer, "chat_template", None)})


class ResponseCache:
    """``<out>.responses.jsonl``: one JSON object per answered prompt, keyed by (settings, prompt)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.records: dict[tuple[str, str], dict] = {}
        lines = path.read_text().splitlines() if path.is_file() else []
        for n, line in enumerate(lines, 1):
            try:
                rec = json.loads(line)
                self.records[(rec["settings"], rec["prompt_sha"])] = rec
            except (ValueError, KeyError, TypeError):
                print(f"{path} line {n} is not a cached response (truncated or garbled): its prompt is answered "
                      f"again", flush=True)

    def get(self, settings: str, prompt, prompt_ids: list[int]) -> dict | None:
        rec = self.records.get((settings, _sha(prompt)))
        return rec if rec is not None and rec["prompt_ids"] == prompt_ids else None

    def put(self, rec: dict) -> None:
        self.records[(rec["settings"], rec["prompt_sha"])] = rec

    def save(self) -> None:
        from torchspec.io import atomic_write_text

        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records.values()))


def target_responses(engine, tokenizer, name: str, prompts: list, ids: list[list[int]], max_new: int,
                     cache: ResponseCache, settings: str) -> tuple[list[dict], int]:
    """(per prompt: prompt, prompt_ids, token_ids, text, finish_reason; how many were generated now)."""
    records = [cache.get(settings, p, i) for p, i in zip(prompts, ids)]
    todo = [j for j, r in enumerate(records) if r is None]
    if todo:
        results = engine.generate([ids[j] for j in todo], max_new_tokens=max_new, spec=None,
                                  concurrency=min(len(todo), engine.max_batch))
        for j, res in zip(todo, results):
            records[j] = {"settings": settings, "prompt_sha": _sha(prompts[j]), "prompt_set": name, "index": j,
                          "prompt": prompts[j], "prompt_ids": ids[j], "token_ids": res.token_ids, "text": res.text,
                          "finish_reason": res.finish_reason}
            cache.put(records[j])
        cache.save()
    return records, len(todo)
