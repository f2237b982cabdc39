"""Simulated acceptance for `tools/bench_quality.py`: the trainer's own held-out evaluation.

The conversations (prompt + the target's own response) go through the trainer's
``tokenize_conversation`` / ``collate`` and ``torchspec.train.step.evaluate`` with K = depth steps:
``simulated_acceptance`` is its ``eval/chain_acceptance`` (greedy chain rounds of depth K walked over
each response as serving runs them, with the token serving proposes), ``simulated_acceptance_marginals`` its
``eval/acceptance_length`` (the product of per-step accuracies); no second definition of acceptance.
The per-position argmaxes are read from inside the trainer's fused head-loss call, so the rounds
serving would walk can be replayed from them (``replay_rounds``) to decompose a served-vs-simulated
gap.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torchspec.train.ttt as ttt_module  # noqa: E402

STEP_DECAY = 0.8  # evaluate's loss weights; no metric depends on them
PROPOSE_ROWS = 1024  # drafter states scored at once for serving's proposal (logits: rows x V fp32)



# --- 2. simulated acceptance: the trainer's held-out evaluation ------------------------------------------

@contextlib.contextmanager
def recorded_head_loss(records: list, propose):
    """Record each call of the trainer's fused head loss inside ``ttt_unroll``: per (target position, step)
    the drafter's argmax and the target's argmax that the trainer's accuracy counts, which entries are
    scored, and ``propose(states)``: the token serving would draft from the same drafter state."""
    original = ttt_module.fused_ttt_head_loss

    def recording(states, weight, teacher, token_weights, **kwargs):
        out = original(states, weight, teacher, token_weights, **kwargs)
        records.append((propose(states.detach()), out.argmax, out.target_argmax, token_weights > 0))
        return out

    ttt_module.fused_ttt_head_loss = recording
    try:
        yield
    finally:
        ttt_module.fused_ttt_head_loss = original


def held_out_examples(tokenizer, records: list[dict], max_length: int) -> tuple[list, list, dict]:
    """(the conversations as the trainer tokenises them, the served ids as examples, counts).

    Trainer: user turn + the target's reply text through ``tokenize_conversation`` at the trainer's
    ``max_length`` (what a regenerated held-out set gives it); served: prompt ids + generated ids, loss
    mask on the generated ones, never truncated (what was served)."""
    from torchspec.data import Example, SkipConversation, tokenize_conversation

    text, served, skipped, same = [], [], 0, 0
    for rec in records:
        ids = rec["prompt_ids"] + rec["token_ids"]
        mask = [0] * len(rec["prompt_ids"]) + [1] * len(rec["token_ids"])
        served.append(Example(torch.tensor(ids), torch.tensor(mask)))
        prompt = rec["prompt"]
        messages = (list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
        try:
            t_ids, t_mask = tokenize_conversation(tokenizer, messages + [{"role": "assistant", "content": rec["text"]}],
                                                  max_length)
        except SkipConversation:
            skipped += 1
            continue
        text.append(Example(torch.tensor(t_ids), torch.tensor(t_mask)))
        same += t_ids[: len(ids)] == ids
    return text, served, {"conversations": len(records), "skipped": skipped, "same_token_ids": same,
                          "truncated": sum(len(r["prompt_ids"]) + len(r["token_ids"]) > max_length for r in records)}


def build_eval_engine(drafter, precision: str):
    """The trainer's "none" engine around an fp32 drafter (bf16: fp32 masters + a bf16 module, as training)."""
    from torchspec.train.engine_base import OptimConfig, TrainingEngine, TTTModel

    return TrainingEngine(TTTModel(drafter), OptimConfig(lr=0.0), lambda _: 1.0, precision)


@torch.no_grad()
def simulate(target, engine, examples: list, depth: int, batch_size: int, pad_id: int, cache: dict
             ) -> tuple[dict[str, float], list[torch.Tensor]]:
    """``evaluate`` (the trainer's held-out eval) at ``num_steps = depth`` -> (its metrics, per example a
    [2, T, K] bool by input position t: [0] the token serving would draft at step k from t is the target's
    argmax, [1] step k at t is scored). Serving's proposal is ``DrafterRunner.top_candidates(state, 1)``
    on the unroll's state: the dense argmax, or the best of an efficient head's top-k candidates (the
    trainer's accuracy always takes the dense argmax). ``cache``: evaluate's capture cache of these
    exact batches (shared by drafters with the same aux ids)."""
    from torchspec.data import collate
    from torchspec.runtime.drafter_runner import DrafterRunner
    from torchspec.train.step import TTTOptions, evaluate

    device = target.embed_tokens_weight.device
    chunks = [examples[i:i + batch_size] for i in range(0, len(examples), batch_size)]
    batches = [{k: v.to(device) for k, v in collate(c, pad_id).items()} for c in chunks]
    drafter = engine.drafter
    runner = DrafterRunner(drafter, target.vocab_size)

    def propose(states: torch.Tensor) -> torch.Tensor:  # [N, K, H] -> [N, K] target ids, in row chunks
        flat = states.reshape(-1, states.shape[-1])
        ids = [runner.top_candidates(flat[i:i + PROPOSE_ROWS], 1)[1][:, 0] for i in range(0, len(flat), PROPOSE_ROWS)]
        return torch.cat(ids).view(states.shape[:2])

    records: list = []
    with recorded_head_loss(records, propose):
        metrics = evaluate(target, engine, batches, TTTOptions(depth, STEP_DECAY), None, cache)
    assert len(records) == len(batches), "ttt_unroll no longer calls fused_ttt_head_loss once per micro-batch"
    per_example, correct_sum, valid_sum = [], 0, 0
    for chunk, batch, (proposal, argmax, t_argmax, valid) in zip(chunks, batches, records):
        b, t = batch["input_ids"].shape
        correct = (drafter.draft_to_target_ids(argmax) == t_argmax[:, None]) & valid  # [N, K], as ttt_unroll
        correct_sum, valid_sum = correct_sum + correct.sum(0).double(), valid_sum + valid.sum(0).double()
        served = ((proposal == t_argmax[:, None]) & valid).view(b, t, depth)
        scored = valid.view(b, t, depth)
        by_input = torch.zeros(2, b, t, depth, dtype=torch.bool, device=correct.device)
        for k in range(depth):  # target position p = t + k + 1 -> input position t
            by_input[0, :, : t - k - 1, k] = served[:, k + 1:, k]
            by_input[1, :, : t - k - 1, k] = scored[:, k + 1:, k]
        per_example += [by_input[:, i, : len(e)].cpu() for i, e in enumerate(chunk)]
    for k, a in enumerate((correct_sum / valid_sum.clamp(min=1)).tolist()):  # the argmaxes the metric counted
        assert abs(a - metrics[f"eval/acc_{k}"]) < 1e-9, (k, a, metrics[f"eval/acc_{k}"])
    return metrics, per_example


def chain_length(correct: torch.Tensor, t: int) -> int:
    """1 + the leading run of correct steps at input position t: what a greedy chain round commits."""
    return 1 + int(correct[t].long().cumprod(0).sum())


def replay_rounds(correct: torch.Tensor, prompt_len: int, num_generated: int) -> list[int]:
    """The greedy chain rounds serving runs on one conversation, from [T, K] per-position results. Prefill
    commits x_P (P = prompt_len), so the target caches x_0..x_{N-1} with N = P; a round drafts TTT
    steps 0..K-1 at t = N - 1 and commits ``chain_length`` tokens, the last one only those that fit in
    ``num_generated`` (as serving counts a round cut by a stop token or the token limit)."""
    rounds, n, end = [], prompt_len, prompt_len + num_generated - 1
    while n < end:
        rounds.append(min(chain_length(correct, n - 1), end - n))
        n += rounds[-1]
    return rounds


def served_text_examples(records: list[dict], results) -> tuple[list, list[dict], int]:
    """What serving generated, as examples for ``simulate``: per record (``results`` beyond the records are
    repeats of the prompts) its prompt ids + the served token ids, mask on the latter -> (examples, records of
    the served text, how many differ from the cached response: bf16 serving may part from it at a near-tie)."""
    from torchspec.data import Example

    examples, served, diverged = [], [], 0
    for rec, res in zip(records, results):
        ids = list(rec["prompt_ids"]) + list(res.token_ids)
        mask = [0] * len(rec["prompt_ids"]) + [1] * len(res.token_ids)
        examples.append(Example(torch.tensor(ids), torch.tensor(mask)))
        served.append({"prompt_ids": rec["prompt_ids"], "token_ids": list(res.token_ids)})
        diverged += list(res.token_ids) != list(rec["token_ids"])
    return examples, served, diverged


def served_text_replay(per_example: list[torch.Tensor], served: list[dict], results) -> dict:
    """The chain rounds the unroll predicts on the served text itself, against the rounds served on it:
    ``simulated_replay_served_text`` (rounds walked as ``replay_rounds``), ``served_on_served_text`` (the same
    sequences' served acceptance) and their ratio ``served_vs_replay_served_text``. Off 1 only if the runtime and the unroll disagree on the
    text serving produced; a served-vs-simulated gap with this at 1 is the text's divergence alone."""
    replays = [replay_rounds(both[0], len(rec["prompt_ids"]), len(rec["token_ids"]))
               for rec, both in zip(served, per_example)]
    rounds = sum(map(len, replays))
    served_rounds = sum(len(r.accept_lengths) for r in results[: len(served)])
    replay = sum(map(sum, replays)) / rounds if rounds else None
    on_these = sum(sum(r.accept_lengths) for r in results[: len(served)]) / served_rounds if served_rounds else None
    return {"simulated_replay_served_text": replay, "served_on_served_text": on_these,
            "served_vs_replay_served_text": on_these / replay if replay and on_these else None}


def simulated_entry(name: str, set_name: str, depth: int, counts: dict, text_metrics: dict, ids_metrics: dict,
                    records: list[dict], per_example: list[torch.Tensor]) -> dict:
    """One drafter x prompt set: marg, sim, ids, starts, chain and replay of bench_quality's docstring
    (per-example results and replayed rounds under ``_per_example`` / ``_replays``, kept out of the JSON)."""
    from torchspec.train.ttt import acceptance_length

    correct, scored, chains, replays = torch.zeros(depth), torch.zeros(depth), [], []
    for rec, both in zip(records, per_example):
        p, r = len(rec["prompt_ids"]), len(rec["token_ids"])
        correct, scored = correct + both[0, p - 1:].sum(0), scored + both[1, p - 1:].sum(0)
        chains += [chain_length(both[0], t) for t in range(p - 1, p + r - 2)]  # every round start
        replays.append(replay_rounds(both[0], p, r))
    starts = (correct.double() / scored.double().clamp(min=1)).tolist()
    rounds = sum(map(len, replays))
    lb = "eval/acceptance_length_efficient_lb"
    return {"drafter": name, "prompt_set": set_name, "depth": depth, **counts,
            "simulated_acceptance": text_metrics["eval/chain_acceptance"],
            "simulated_acceptance_marginals": text_metrics["eval/acceptance_length"],
            "acc": [text_metrics[f"eval/acc_{k}"] for k in range(depth)],
            "simulated_acceptance_efficient_lb": text_metrics.get(lb),
            "served_ids": {"acceptance": ids_metrics["eval/acceptance_length"], "efficient_lb": ids_metrics.get(lb),
                           "acc": [ids_metrics[f"eval/acc_{k}"] for k in range(depth)],
                           "chain_acceptance": ids_metrics["eval/chain_acceptance"]},
            "round_starts": {"acceptance": acceptance_length(torch.tensor(starts)), "acc": starts},
            "chain_mean": sum(chains) / len(chains) if chains else None,
            "replay": sum(map(sum, replays)) / rounds if rounds else None, "replay_rounds": rounds,
            "_per_example": per_example, "_replays": replays}
