"""``torchspec-generate``: decode prompts with the bundled runtime, with or without speculation.

    torchspec-generate --target smollm2 --drafter runs/x/export --prompt "Hello" --max-new-tokens 64
    torchspec-generate --target smollm2 --no-spec --prompts-file prompts.txt --json out.json
    torchspec-generate ... --temperature 0.7 --top-p 0.9 --chain --depth 6 --json -

Prompts come from ``--prompt`` (repeatable), ``--prompts-file`` (.txt lines / .jsonl) or
``--prompt-set mtbench|humaneval``; chat-templated unless ``--raw``. ``--json PATH`` (or ``-``)
writes tokens, text, the acceptance length of every round and timings per prompt.
Every option is checked before a model loads; user errors print one line,
``torchspec-generate: error: ...``, and exit 2 (``--debug``: the traceback).
"""

from __future__ import annotations

import json
import sys
import time

from torchspec.cli import ArgumentParser, check_at_least, user_errors
from torchspec.runtime.cli import (
    add_engine_args,
    add_sampling_args,
    add_spec_args,
    check_engine_args,
    check_output_file,
    controller_from_args,
    engine_kwargs,
    read_prompt_set,
    sampling_from_args,
    spec_from_args,
)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="torchspec-generate", description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    src.add_argument("--prompts-file", default=None, help=".txt (one per line) or .jsonl")
    src.add_argument("--prompt-set", default=None, choices=["mtbench", "humaneval"])
    src.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    src.add_argument("--raw", action="store_true", help="no chat template: the prompt text as is")
    p.add_argument("--json", default=None, help="write results as JSON to PATH ('-' = stdout)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    add_engine_args(p)
    add_spec_args(p)
    add_sampling_args(p)
    return p


def collect_prompts(args) -> list:
    prompts: list = list(args.prompt)
    for source in (args.prompts_file, args.prompt_set):
        if source:
            prompts += read_prompt_set(source)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    if not prompts:
        raise ValueError("no prompts: give --prompt, --prompts-file or --prompt-set.")
    return prompts


def check_args(args):
    """Every option, before a model loads. Returns (sampling params, spec or None)."""
    params, spec = sampling_from_args(args), spec_from_args(args)
    if spec is not None and args.drafter is None:
        raise ValueError("speculation needs --drafter PATH (a torchspec export); or pass --no-spec.")
    check_at_least("--max-new-tokens", args.max_new_tokens, 1)
    check_at_least("--num-prompts", args.num_prompts, 1)
    check_engine_args(args, spec)
    if args.json not in (None, "-"):
        check_output_file("--json", args.json)
    return params, spec


def run(args) -> dict:
    from torchspec.runtime.loading import load_engine
    from torchspec.runtime.prompts import render_prompts
    from torchspec.runtime.tp import check_tp_consistency, init_tp_from_env

    params, spec = check_args(args)
    prompts = collect_prompts(args)
    tp_group, device = init_tp_from_env()  # under torchrun: the target is tensor-parallel over all ranks
    kwargs = engine_kwargs(args)
    kwargs["device"] = args.device or device
    engine = load_engine(args.target, args.drafter if spec is not None else None, tp_group=tp_group, **kwargs)
    ids = render_prompts(engine.tokenizer, prompts, chat=not args.raw)
    controller = controller_from_args(args, engine)
    t0 = time.perf_counter()
    results = engine.generate(ids, max_new_tokens=args.max_new_tokens, sampling=params, spec=spec,
                              seed=args.seed, ignore_eos=args.ignore_eos, controller=controller,
                              chain_from_batch=args.chain_from_batch, controller_mode=args.controller_mode)
    wall = time.perf_counter() - t0
    check_tp_consistency([r.token_ids for r in results], tp_group)
    tokens = sum(len(r.token_ids) for r in results)
    rounds = sum(len(r.accept_lengths) for r in results)
    accepted = sum(sum(r.accept_lengths) for r in results)
    summary = {"prompts": len(results), "generated_tokens": tokens, "wall_s": wall,
               "tokens_per_s": tokens / wall if wall else 0.0,
               "mean_acceptance": accepted / rounds if rounds else 0.0, "speculation": spec is not None}
    return {"summary": summary, "results": [r.to_dict() for r in results]}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    with user_errors("torchspec-generate", args.debug):
        out = run(args)
    from torchspec.runtime.tp import is_rank0

    if not is_rank0():
        return
    if args.json:
        text = json.dumps(out, indent=1)
        if args.json == "-":
            print(text)
        else:
            from pathlib import Path

            from torchspec.io import atomic_write_text

            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(Path(args.json), text)
    if args.json != "-":
        for r in out["results"]:
            print(r["text"])
            print("-" * 40)
        s = out["summary"]
        print(f"{s['generated_tokens']} tokens in {s['wall_s']:.2f} s ({s['tokens_per_s']:.1f} tok/s), "
              f"mean acceptance {s['mean_acceptance']:.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
