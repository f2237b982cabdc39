"""Served vs simulated acceptance of drafter exports on held-out prompts (issue 15, parts 3 and 5).

For one target and one or more drafter exports, on held-out prompt sets:

1. **Held-out conversations with the target's own responses.** Every prompt is answered by the
   target with plain greedy decoding through the bundled runtime (``--max-new-tokens``), cached in
   ``<out>.responses.jsonl`` beside ``--out`` (rewritten atomically after each prompt set) and reused
   by any later run with the same target weights, dtype, device type, chat template and token
   limit; a garbled line is named and its prompt answered again (``tools/quality_responses.py``).
2. **Simulated acceptance at depth K** (``--depth``; ``tools/quality_simulated.py``): the
   training-time held-out metric, computed by the trainer's own code. The conversations (user turn + the target's reply) go through the
   trainer's ``tokenize_conversation`` and ``collate``; ``torchspec.train.step.evaluate`` runs the
   target's ``capture`` and the drafter's TTT unroll (``ttt_unroll`` inside a "none"
   ``TrainingEngine``; bf16 when serving is bf16, as training on a GPU) with ``num_steps = K``:
   ``simulated_acceptance = eval/chain_acceptance``, the greedy chain rounds of depth K walked over each
   response as serving runs them (tokens committed per round, with the token an efficient head proposes),
   and ``simulated_acceptance_marginals = eval/acceptance_length = 1 + sum_k prod_{i<=k} acc_i``.
3. **Served acceptance and speedup** (``tools/quality_served.py``): ``SpeculativeEngine`` on the same prompt ids: greedy chain of
   depth K (``chain``), greedy dynamic tree of depth K (``tree``; ``--tree-topk``, ``--tree-nodes``)
   and the T = 1 sampled tree (``sampled_tree``; ``--branching``) at each ``--concurrency``, and each greedy
   tree of ``--tree-shapes`` (depth x topk x nodes; its rows carry their own ``depth``, ``tree_topk`` and
   ``tree_nodes``; their simulated numbers stay the chain's at ``--depth``), against
   plain decoding of the same decoder at the same concurrency and temperature (``recipes.bench.measure``:
   decode tokens/s and tokens committed per round, bonus included; a warm-up run first). ``--timing-repeats R``
   times each row R more times as pairs with plain decoding through the same engine, alternating which goes
   first; the row's speedup is then the median pair's (``speedup_repeats``, ``speedup_min``, ``speedup_max``;
   ``speedup_unpaired``: the single run against step 1's plain timing). Use it for any speedup you quote.
4. Rows to ``--out`` (JSON, atomic, rewritten after every served row: a run cut short keeps them; device, args), each with at least ``drafter, train_tokens,
   prompt_set, mode, temperature, concurrency, simulated_acceptance, served_acceptance, speedup``,
   ``served_vs_simulated`` (served / simulated) and ``depth``, and the diagnostics below. A greedy
   chain row whose ratio is off 1 by more than 5% (the issue's target) is flagged.

**Where they can part, step by step** (``simulated`` entries, one per drafter x prompt set; the table
prints them left to right). All come from the same unroll: its per-(position, step) drafter states and
argmaxes are read from the trainer's own fused head-loss call (checked against the trainer's acc_k).
``simulated_acceptance_efficient_lb`` is the trainer's own product-of-marginals bound for an efficient head.

    marg     the trainer's product of marginals (``eval/acceptance_length``) on the conversations as the
             trainer tokenises them (``simulated_acceptance_marginals``)
    sim      the trainer's chain acceptance (``eval/chain_acceptance``) on the same: the number compared
             with served (``simulated_acceptance``); sim - replay is the template / re-tokenisation
             effect (on the served ids, ``simulated_served_ids_chain``, it is the replay exactly)
    ids      marg on exactly the served token ids (prompt ids + generated ids, mask on the latter):
             marg - ids is the template / re-tokenisation / turn-closing effect
    starts   the product of per-step accuracies over the positions a round can start from only
             (t >= P - 1), each step's token being the one serving proposes from the same drafter state
             (``DrafterRunner.top_candidates``: an efficient head's best of its scorer's top-k, where the
             trainer's accuracy takes the dense head's argmax): ids - starts is the prompt positions the
             trainer scores and serving never drafts from, and the efficient head's candidates
    chain    mean over those positions of 1 + the leading run of correct steps: chain - starts is
             the product of marginals against the joint (steps are correlated)
    replay   the greedy chain rounds serving runs, walked over those per-position results (start
             after the first generated token, advance by accepted + 1): replay - chain is how serving
             weights positions (it starts rounds only where the previous round ended)
    stext    (greedy chain rows) the same unroll run on the text serving produced (prompt + served ids) and
             walked like ``replay`` (``simulated_replay_served_text``); ``served_vs_replay_served_text``, over
             the same sequences, is 1 unless the runtime and the unroll disagree on that text, so a served vs
             simulated gap with it at 1 is serving's text parting from the cached response at bf16 near-ties
             (``diverged_responses`` of them), not positions, window, norms or feedback
    served   the engine: served - replay is the last round of each sequence (serving counts drafts
             accepted past the stop token or the token limit) and numerics (bf16 serving)

``round_agreement`` (greedy chain rows): of the rounds serving ran inside the cached response (the
last excluded), the fraction whose committed count equals the simulated chain at the same start
position. 1.0 (fp32) means positions, window, norms and feedback of the unroll and the runtime agree.

train_tokens / train_step: from the export's ``training`` record (``torchspec.export.serving.export_training``,
written by training and torchspec-export), else ``train_step`` from ``<run>/DONE`` when the export is a run's
own ``<run>/drafter``; ``--train-tokens NAME=N`` overrides the tokens; else null.

    # H200, SmolLM2 (tools/device_smollm2.sh joined the GGUF under /tmp/work): one prompt set per call
    # (~5 min with two drafters, 32 prompts, 256 tokens, c = 1, 8, 64), --merge'd into one JSON kept on the
    # warm machine and copied to $OUT; the responses cache beside it serves the next calls:
    python tools/bench_quality.py --target /tmp/work/smollm2.gguf --cache-dir /tmp/work/cache \\
        --drafter eagle4=/tmp/work/eagle4/drafter --drafter eagle3=/tmp/work/eagle3/drafter \\
        --train-tokens eagle4=52428800 --train-tokens eagle3=52428800 --prompt-set mtbench --num-prompts 32 \\
        --depth 5 --concurrency 1,8,64 --merge --out /tmp/work/quality_smollm2.json && cp /tmp/work/quality_* $OUT/
    # CPU smoke run (seconds): a tiny target dir and a drafter export for it (tests/runtime_pair.py):
    python tools/bench_quality.py --device cpu --target T --drafter tiny=D --prompt-set prompts.txt \\
        --max-new-tokens 24 --depth 3 --concurrency 1,2 --out /tmp/quality.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from quality_options import build_parser, check_args  # noqa: E402
from quality_responses import ResponseCache, response_settings, target_responses  # noqa: E402
from quality_served import (  # noqa: E402, F401 (round_agreement: the tests read it here)
    MODES,
    TOLERANCE,
    chosen_prompts,
    format_row,
    mode_label,
    round_agreement,
    serve_drafter,
    timed,
)
from quality_simulated import (  # noqa: E402
    build_eval_engine,
    held_out_examples,
    served_text_examples,
    served_text_replay,
    simulate,
    simulated_entry,
)

from torchspec.cli import user_errors  # noqa: E402

ROW_KEYS = ("drafter", "train_tokens", "prompt_set", "mode", "temperature", "concurrency", "simulated_acceptance",
            "served_acceptance", "speedup", "served_vs_simulated", "depth")
ARCHS = {"torchspec_eagle4": "eagle4", "torchspec_eagle3": "eagle3"}
DIAGNOSTICS = {"marg": "simulated_acceptance_marginals", "sim": "simulated_acceptance",
               "ids": "simulated_served_ids", "starts": "simulated_round_starts",
               "chain": "simulated_chain_mean", "replay": "simulated_replay", "stext": "simulated_replay_served_text",
               "served": "served_acceptance"}


def drafter_record(name: str, path: str, train_tokens: int | None) -> dict:
    """What the JSON says about a drafter: architecture, dtype, aux ids, training step and tokens (--train-tokens
    over the export's own training record)."""
    from torchspec.export.serving import export_training

    config = json.loads((pathlib.Path(path) / "config.json").read_text())
    export = pathlib.Path(path).resolve()
    done = export.parent / "DONE"  # a run's own export <run>/drafter: DONE is the run's completion record
    step = json.loads(done.read_text())["step"] if export.name == "drafter" and done.is_file() else None
    training = export_training(export) or {}
    step = training.get("step", step)
    train_tokens = train_tokens if train_tokens is not None else training.get("train_tokens")
    return {"drafter": name, "path": str(path), "arch": ARCHS.get(config.get("model_type"), config.get("model_type")),
            "export_dtype": config.get("dtype"), "aux_layer_ids": config["aux_layer_ids"],
            "lm_head_rank": config.get("lm_head_rank", 0), "train_step": step, "train_tokens": train_tokens}


# --- 3. served acceptance and speedup --------------------------------------------------------------------

# --- the run ---------------------------------------------------------------------------------------------

def simulate_drafters(path: str, drafters: dict, responses: dict, tokenizer, args, dtype, device, max_context: int,
                      pad_id: int) -> tuple[dict[tuple[str, str], dict], Callable]:
    """The ``simulated`` entry of every drafter x prompt set: the trainer's evaluation on a capture target
    with the drafter's aux ids (captures shared by drafters with the same ids); and
    ``replay_served(drafter, records, results)``: the same unroll on the text serving produced
    (``quality_simulated.served_text_replay``, for the greedy chain rows)."""
    from torchspec.export.serving import load_exported_drafter
    from torchspec.runtime.loading import decoder_identity
    from torchspec.targets import TargetDecoder

    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    max_length = args.max_length or max_context
    examples = {name: held_out_examples(tokenizer, recs, max_length) for name, recs in responses.items()}
    simulated, captures, targets, engines = {}, {}, {}, {}
    for name, d in drafters.items():
        aux = tuple(d["aux_layer_ids"])
        if aux not in targets:
            targets[aux] = TargetDecoder.from_pretrained(path, aux_layer_ids=list(aux), dtype=dtype, device=device)
        target = targets[aux]
        model = load_exported_drafter(d["path"], target=decoder_identity(target), dtype=torch.float32)
        engine = engines[name] = build_eval_engine(model.to(device), precision)
        for set_name, (text_examples, served_examples, counts) in examples.items():
            text_metrics, _ = simulate(target, engine, text_examples, args.depth, args.sim_batch_size, pad_id,
                                       captures.setdefault((aux, set_name, "text"), {}))
            ids_metrics, per_example = simulate(target, engine, served_examples, args.depth, args.sim_batch_size,
                                                pad_id, captures.setdefault((aux, set_name, "ids"), {}))
            simulated[(name, set_name)] = simulated_entry(name, set_name, args.depth, counts, text_metrics,
                                                          ids_metrics, responses[set_name], per_example)

    def replay_served(name: str, records: list[dict], results) -> dict:
        examples, served, diverged = served_text_examples(records, results)
        target = targets[tuple(drafters[name]["aux_layer_ids"])]
        _, per_example = simulate(target, engines[name], examples, args.depth, args.sim_batch_size, pad_id, {})
        return {**served_text_replay(per_example, served, results), "diverged_responses": diverged}

    return simulated, replay_served


def run(args, on_progress=None) -> dict:
    """Responses and plain decoding -> simulated -> served (module docstring); the JSON's content.
    ``on_progress(partial)``, if given, gets the content so far after each served row."""
    from torchspec.runtime.loading import load_engine, resolve_dtype
    from torchspec.runtime.prompts import render_prompts
    from torchspec.targets import load_tokenizer, resolve_target_path

    checked = check_args(args)
    specs, levels, modes = checked["specs"], checked["levels"], checked["modes"]
    drafters = {n: drafter_record(n, p, checked["train_tokens"].get(n)) for n, p in checked["drafters"].items()}
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    path = resolve_target_path(args.target, os.path.expanduser(args.cache_dir))
    tokenizer = load_tokenizer(path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt_ids = {name: render_prompts(tokenizer, prompts) for name, prompts in checked["sets"].items()}
    longest = max(len(i) for ids in prompt_ids.values() for i in ids)
    slack = 2 * max(s.num_nodes + s.depth + 1 for s in specs.values()) + 16  # a round's KV beyond the limit
    max_context = -(-(longest + args.max_new_tokens + slack) // args.page_size) * args.page_size
    out_path = pathlib.Path(args.out)
    cache = ResponseCache(out_path.with_name(out_path.stem + ".responses.jsonl"))
    started = time.perf_counter()

    # 1. the target's responses, and plain decoding at every (set, temperature, concurrency)
    engine = load_engine(path, None, device=device, dtype=dtype, max_batch=max(levels), max_context=max_context,
                         page_size=args.page_size, cache_dir=args.cache_dir)
    decoder = engine.decoder
    responses, generated, plain = {}, 0, {}
    settings = response_settings(path, decoder, tokenizer, args.max_new_tokens)
    for name, prompts in checked["sets"].items():
        responses[name], n = target_responses(engine, tokenizer, name, prompts, prompt_ids[name],
                                              args.max_new_tokens, cache, settings)
        generated += n
        for temp in sorted({MODES[m.split('@')[0]] for m in modes}):
            for c in levels:
                plain[(name, temp, c)], _ = timed(engine, chosen_prompts(prompt_ids[name], c), None, temp,
                                                  args.max_new_tokens, args.seed, c)
    reused = sum(map(len, responses.values())) - generated
    print(f"responses: {generated} generated, {reused} reused ({cache.path})", flush=True)
    del engine

    # 2. simulated on the unfused target of training capture (serving fused its own copy); 3. served
    simulated, replay_served = simulate_drafters(path, drafters, responses, tokenizer, args, dtype, device,
                                                 max_context, pad_id)
    rows: list[dict] = []

    def content() -> dict:
        return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                "dtype": str(dtype).removeprefix("torch."), "target": args.target, "depth": args.depth,
                "tolerance": TOLERANCE, "row_keys": list(ROW_KEYS),
                "specs": {m: dataclasses.asdict(specs[m]) for m in modes}, "drafters": list(drafters.values()),
                "responses": {"path": str(cache.path), "generated": generated, "reused": reused,
                              "finish_reasons": {n: dict(Counter(r["finish_reason"] for r in recs))
                                                 for n, recs in responses.items()}},
                "simulated": list(simulated.values()), "rows": list(rows), "flagged": sum(r["flag"] for r in rows),
                "wall_s": time.perf_counter() - started, "args": vars(args)}

    for d in drafters.values():
        earlier_rows = list(rows)

        def on_row(drafter_rows: list[dict], earlier_rows: list[dict] = earlier_rows) -> None:  # --out after every row
            rows[:] = earlier_rows + drafter_rows
            if on_progress is not None:
                on_progress(content())

        rows[:] = earlier_rows + serve_drafter(d, decoder, tokenizer, responses, prompt_ids, simulated, plain, specs,
                                               modes, levels, max_context, args, replay_served, on_row)
    return content()


def print_table(out: dict) -> None:
    print(f"\ndevice: {out['device']} ({out['dtype']}), depth K={out['depth']}; columns marg .. served: the module "
          f"docstring's steps from the trainer's metric to the engine")
    print(f"{'drafter':<12} {'set':<10} {'mode':<14} {'T':>3} {'c':>4} "
          + " ".join(f"{k:>6}" for k in DIAGNOSTICS) + f" {'ratio':>6} {'speedup':>7}")
    for r in out["rows"]:
        cells = [r.get(k) for k in (*DIAGNOSTICS.values(), "served_vs_simulated")]
        print(f"{r['drafter']:<12} {r['prompt_set']:<10} {mode_label(r):<14} {r['temperature']:>3} {r['concurrency']:>4} "
              + " ".join(f"{x:6.2f}" if x is not None else f"{'-':>6}" for x in cells) + f" {r['speedup']:7.2f}"
              + ("  !! served chain vs simulated > 5%" if r["flag"] else ""))
    print(f"flagged (greedy chain, |served / simulated - 1| > {out['tolerance']:.0%}): {out['flagged']}")


def merge(old: dict, new: dict) -> dict:
    """``--merge``: the old rows and simulated entries this run did not measure again, then the new ones."""
    def key(r: dict) -> tuple:
        return tuple(r.get(k) for k in ("drafter", "prompt_set", "mode", "temperature", "concurrency", "depth",
                                        "tree_topk", "tree_nodes"))

    def sim_key(s: dict) -> tuple:
        return s["drafter"], s["prompt_set"], s["depth"]

    measured, simulated = {key(r) for r in new["rows"]}, {sim_key(s) for s in new["simulated"]}
    rows = [r for r in old.get("rows", []) if key(r) not in measured] + new["rows"]
    sims = [s for s in old.get("simulated", []) if sim_key(s) not in simulated]
    return {**new, "rows": rows, "simulated": sims + new["simulated"], "flagged": sum(r["flag"] for r in rows),
            "earlier_args": old.get("earlier_args", []) + [old.get("args")]}


def main(argv: list[str] | None = None) -> dict:
    """Run, print the table, write ``--out``; returns the result (with the in-memory ``_`` keys)."""
    from torchspec.io import atomic_write_text

    args = build_parser().parse_args(argv)
    with user_errors("bench_quality", args.debug):
        path = pathlib.Path(args.out)
        earlier = json.loads(path.read_text()) if args.merge and path.is_file() else None  # read once, before
        # any write of this run: each drafter's rows are merged into it and written as soon as they exist,
        # so a run cut short by a time limit keeps what it measured

        def write(out: dict) -> dict:
            out = merge(earlier, out) if earlier is not None else out
            public = {**out, "simulated": [{k: v for k, v in s.items() if not k.startswith("_")}
                                           for s in out["simulated"]]}
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(public, indent=1))
            return out

        out = write(run(args, on_progress=write))
        print_table(out)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
