"""Write a held-out prompt set as conversations for the target to answer (``data_pipelines.regenerate``),
so that training measures its held-out acceptance on the prompts serving is judged on.

    python tools/heldout_conversations.py --prompt-set mtbench --out outputs/data/mtbench.jsonl
    python -m data_pipelines.regenerate source=outputs/data/mtbench.jsonl output=outputs/data/regenerated/mtbench
    torchspec-train ... data.eval_path=outputs/data/regenerated/mtbench data.eval_size=80

MT-Bench: both user turns of each of the 80 questions (the follow-up asks about the target's own first
answer); HumanEval: each of the 164 problems as one turn, worded as ``torchspec-bench`` asks it; a file:
its prompts (``torchspec.runtime.prompts``), one turn each. Assistant turns hold a placeholder that the
regeneration replaces. OpenAI ``{"id", "messages"}`` JSONL, written atomically.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from torchspec.io import atomic_write_text  # noqa: E402
from torchspec.runtime.prompts import load_prompt_set, mtbench_turns  # noqa: E402

PLACEHOLDER = "(to be regenerated)"


def conversations(prompt_set: str, num: int | None) -> list[dict]:
    """The records: each user turn followed by a placeholder assistant turn."""
    if prompt_set == "mtbench":
        turn_lists = mtbench_turns()
    else:
        turn_lists = [[p] if isinstance(p, str) else [m["content"] for m in p if m["role"] == "user"]
                      for p in load_prompt_set(prompt_set)]
    records = []
    for i, turns in enumerate(turn_lists[:num]):
        messages = []
        for turn in turns:
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": PLACEHOLDER}]
        records.append({"id": f"{pathlib.Path(prompt_set).stem}-{i}", "messages": messages})
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-set", required=True, help="mtbench, humaneval or a prompt file")
    p.add_argument("--num", type=int, default=None, help="the first N prompts (default: all)")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    args = p.parse_args(argv)
    records = conversations(args.prompt_set, args.num)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(pathlib.Path(args.out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    print(f"wrote {len(records)} conversations ({sum(len(r['messages']) // 2 for r in records)} turns) to {args.out}")


if __name__ == "__main__":
    main()
