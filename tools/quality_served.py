"""Served rows of ``tools/bench_quality.py``: one drafter export served in every mode at every concurrency.

``serve_drafter`` runs ``SpeculativeEngine`` on the held-out prompt ids (a warm-up for graph capture, then
``recipes.bench.measure``) against plain decoding at the same concurrency and temperature, and builds each
row. With ``--timing-repeats R`` the speedup comes from ``interleaved_timings``: R pairs of plain and
speculative runs through the same engine, timed together (one run against a plain run timed minutes earlier
moved by up to 8% between two timings of one lease on the H200: results.md, twelfth session). Each row has
served acceptance, speedup, the simulated numbers beside them (``quality_simulated.py``), and for greedy chains
``round_agreement``, the fraction of served rounds whose committed count equals the simulated chain at the
same start position. ``MODES`` maps a served mode to its temperature; a greedy chain row off its simulation by
more than ``TOLERANCE`` is flagged.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from quality_simulated import chain_length

from recipes.bench import measure, paired_fields, paired_timings
from torchspec.runtime.sampling import SamplingParams

MODES = {"chain": 0.0, "tree": 0.0, "sampled_tree": 1.0}  # mode -> temperature
TOLERANCE = 0.05  # served chain vs simulated acceptance (issue 15's target)


class _Recorder:
    """An engine for ``recipes.bench.measure`` that keeps the results of its one ``generate``."""

    def __init__(self, engine):
        self.engine, self.results = engine, None

    def generate(self, *args, **kwargs):
        self.results = self.engine.generate(*args, **kwargs)
        return self.results

    @property
    def decode_rounds(self) -> int:  # measure's round count (round_ms)
        return self.engine.decode_rounds

    @property
    def round_kinds(self) -> dict:  # measure's rounds by kind
        return self.engine.round_kinds

    @property
    def full_rounds(self) -> list:  # measure's steady-state rounds (every slot live)
        return self.engine.full_rounds


def timed(engine, prompts: list[list[int]], spec, temperature: float, max_new: int, seed: int, c: int):
    """A warm-up (CUDA-graph capture), then ``recipes.bench.measure`` -> (its numbers, the results)."""
    params = SamplingParams(temperature=temperature)
    measure(engine, prompts[:c], spec, params, min(16, max_new), seed, c)
    rec = _Recorder(engine)
    return measure(rec, prompts, spec, params, max_new, seed, c), rec.results


def interleaved_timings(engine, prompts: list[list[int]], spec, temperature: float, max_new: int, seed: int, c: int,
                        repeats: int) -> dict:
    """``recipes.bench.paired_timings`` of plain decoding and ``spec`` through one engine on the same prompts: the
    row's speedup, tokens/s and step times from the median pair, and every pair's speedup."""
    params = SamplingParams(temperature=temperature)
    measure(engine, prompts[:c], None, params, min(16, max_new), seed, c)  # this engine's plain graphs
    paired = paired_timings(partial(measure, engine, prompts, None, params, max_new, seed, c),
                            partial(measure, engine, prompts, spec, params, max_new, seed, c), repeats)
    spec_run = paired["spec"]
    return {**paired_fields(paired), "tokens_per_s": spec_run["tokens_per_s"], "round_ms": spec_run["round_ms"],
            "round_cost_plain_steps": spec_run["round_ms"] / paired["plain"]["round_ms"]}


def chosen_prompts(ids: list[list[int]], c: int) -> list[list[int]]:
    """A concurrency level's prompts: all, repeated up to c when fewer (as torchspec-bench)."""
    n = max(c, len(ids))
    return (ids * (1 + n // len(ids)))[:n]


def round_agreement(results, records: list[dict], per_example: list[torch.Tensor]) -> tuple[int, int]:
    """(rounds whose committed count equals the simulated chain at the same start, rounds compared).
    Compared: every served greedy chain round but each sequence's last, while all its tokens are the
    cached response's (bf16 serving may part from it at a near-tie; positions mean nothing after)."""
    matched = compared = 0
    for res, rec, both in zip(results, records, per_example):  # results beyond the records: repeats
        p, ref = len(rec["prompt_ids"]), rec["token_ids"]
        same = next((i for i, (a, b) in enumerate(zip(res.token_ids, ref)) if a != b), min(len(ref), len(res.token_ids)))
        n = p
        for count in res.accept_lengths[:-1]:
            if n + count - p >= same:  # the round commits x_{n+1} .. x_{n+count}: token_ids[n+1-p .. n+count-p]
                break
            matched += chain_length(both[0], n - 1) == count
            compared += 1
            n += count
    return matched, compared


def serve_drafter(d: dict, decoder, tokenizer, responses: dict, prompt_ids: dict, simulated: dict, plain: dict,
                  specs: dict, modes: list[str], levels: list[int], max_context: int, args,
                  replay_served: Callable | None = None, on_row: Callable | None = None) -> list[dict]:
    """One drafter served in every mode at every concurrency on every prompt set: its rows, each passed to
    ``on_row(rows so far)`` as soon as it is measured (a run cut short keeps it). A greedy chain
    row also gets ``replay_served(drafter, records, results)``'s numbers: the unroll walked over the text
    serving produced (``simulated_replay_served_text``, ``served_vs_replay_served_text``, ``diverged_responses``)."""
    from torchspec.export.serving import load_exported_drafter
    from torchspec.runtime.drafter_runner import DrafterRunner
    from torchspec.runtime.engine import SpeculativeEngine
    from torchspec.runtime.loading import decoder_identity

    device, dtype = decoder.embed_tokens_weight.device, decoder.embed_tokens_weight.dtype
    model = load_exported_drafter(d["path"], target=decoder_identity(decoder), dtype=dtype)
    engine = SpeculativeEngine(decoder, DrafterRunner(model.to(device), decoder.vocab_size), tokenizer,
                               max_batch=max(levels), max_context=max_context, page_size=args.page_size)
    rows = []
    for set_name, recs in responses.items():
        sim = simulated[(d["drafter"], set_name)]
        for label in modes:  # "tree@DxKxN": a greedy tree of --tree-shapes
            mode, spec = label.split("@")[0], specs[label]
            temp = MODES[mode]
            for c in levels:
                stats, results = timed(engine, chosen_prompts(prompt_ids[set_name], c), spec, temp,
                                       args.max_new_tokens, args.seed, c)
                base = plain[(set_name, temp, c)]
                row = {"drafter": d["drafter"], "arch": d["arch"], "train_tokens": d["train_tokens"],
                       "train_step": d["train_step"], "prompt_set": set_name, "mode": mode, "temperature": temp,
                       "concurrency": c, "depth": spec.depth, **_shape(mode, spec), "simulated_acceptance": sim["simulated_acceptance"],
                       "served_acceptance": stats["mean_acceptance"],
                       "served_vs_simulated": stats["mean_acceptance"] / sim["simulated_acceptance"],
                       "speedup": stats["tokens_per_s"] / base["tokens_per_s"], "tokens_per_s": stats["tokens_per_s"],
                       "plain_tokens_per_s": base["tokens_per_s"], "rounds": stats["rounds"],
                       # wall time of a batched engine round / plain step, host work included (recipes.bench)
                       "round_ms": stats["round_ms"], "plain_step_ms": base["round_ms"],
                       "round_cost_plain_steps": stats["round_ms"] / base["round_ms"],
                       "decode_tokens": stats["decode_tokens"],
                       "simulated_acceptance_marginals": sim["simulated_acceptance_marginals"],
                       "simulated_acceptance_efficient_lb": sim["simulated_acceptance_efficient_lb"],
                       "simulated_served_ids": sim["served_ids"]["acceptance"],
                       "simulated_served_ids_chain": sim["served_ids"]["chain_acceptance"],
                       "simulated_round_starts": sim["round_starts"]["acceptance"],
                       "simulated_chain_mean": sim["chain_mean"], "simulated_replay": sim["replay"]}
                if args.timing_repeats:  # the speedup from pairs timed together, the single run's kept beside
                    row["speedup_unpaired"] = row["speedup"]
                    row.update(interleaved_timings(engine, chosen_prompts(prompt_ids[set_name], c), spec, temp,
                                                   args.max_new_tokens, args.seed, c, args.timing_repeats))
                greedy_chain = mode == "chain" and temp == 0.0
                if greedy_chain:
                    matched, compared = round_agreement(results, recs, sim["_per_example"])
                    row.update(round_agreement=matched / max(compared, 1), rounds_compared=compared)
                    if replay_served is not None:
                        row.update(replay_served(d["drafter"], recs, results))
                row["flag"] = greedy_chain and abs(row["served_vs_simulated"] - 1) > TOLERANCE
                rows.append(row)
                print(format_row(row), flush=True)
                if on_row is not None:
                    on_row(rows)
    return rows


def _shape(mode: str, spec) -> dict:
    """A tree row's shape (the chain's is its depth alone)."""
    if mode == "chain":
        return {}
    return {"tree_topk": spec.topk, "tree_nodes": spec.num_nodes} if mode == "tree" else {"branching": list(spec.branching)}


def mode_label(r: dict) -> str:
    """A row's mode, with the greedy tree's shape (depth x topk x nodes)."""
    return f"tree {r['depth']}x{r['tree_topk']}x{r['tree_nodes']}" if "tree_topk" in r else r["mode"]


def format_row(r: dict) -> str:
    agree = f"  rounds agree {r['round_agreement']:.0%}" if "round_agreement" in r else ""
    if r.get("served_vs_replay_served_text") is not None:
        agree += (f"  on served text {r['served_vs_replay_served_text']:.2f} "
                  f"({r['diverged_responses']} responses diverged)")
    if "speedup_repeats" in r:  # every pair's ratio in the log too: it is all a killed run leaves of them
        agree += (f"  pairs {' '.join(f'x{x:.3f}' for x in r['speedup_repeats'])} (median x{r['speedup']:.3f}, "
                  f"unpaired x{r['speedup_unpaired']:.2f})")
    return (f"{r['drafter']:<12} {r['prompt_set']:<10} {mode_label(r):<14} T={r['temperature']:<3} c={r['concurrency']:<3} "
            f"sim {r['simulated_acceptance']:5.2f}  served {r['served_acceptance']:5.2f}  ratio "
            f"{r['served_vs_simulated']:5.2f}  x{r['speedup']:.2f}{agree}{'  !! >5%' if r['flag'] else ''}")
