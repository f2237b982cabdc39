"""Regenerate every assistant turn of a conversation file with the target itself, resumably.

    python -m data_pipelines.regenerate                              # configs/regenerate_sharegpt.yaml
    python -m data_pipelines.regenerate source=my_chats.jsonl output=outputs/data/regenerated/mine \\
        device=cuda concurrency=128 temperature=0.7 top_p=0.95

The target (``target``: HF dir, .gguf or alias, loaded by ``torchspec.runtime.loading.load_engine``;
``device=auto``: CUDA in bf16 if there is one, else CPU in fp32) answers every user turn again,
turn by turn with its own earlier replies as context (``turns.py``), with continuous batching over
``concurrency`` requests; plain decoding by default, speculative with ``drafter=<export>`` (lossless).
The output directory is ``torchspec.data.regenerated``'s layout: JSONL shards in the input's own
format (ids and other fields kept), each written atomically with a sidecar, and ``generation.json``
(target, fingerprint, sampling, limits, seed, dtype, date, torchspec version).

Resume: shard k holds input records [k * shard_size, (k + 1) * shard_size); a rerun verifies every
shard, reports and regenerates a corrupted one, skips the conversations of the intact ones, and does
nothing when generation.json says complete and every shard is intact. A rerun with settings that
change the output (``regen_output.IDENTITY_KEYS``) is refused; ``concurrency``, ``device``, ``drafter``,
``num_workers`` and ``prefill_wait`` may change.

Host time: at high concurrency a request or two finish per step, and each step would run an eager
prefill forward for the one or two prompts that replace them (launch-bound: about as costly as one of
many prompts). ``prefill_wait`` (steps) lets those prompts gather into one prefill forward while the
other rows decode (``torchspec/runtime/scheduler.py``); greedy outputs do not depend on it.

Several GPUs: ``num_workers=N`` starts N worker processes (worker w on ``cuda:(w % GPUs)``; on the CPU, N
processes), deals the shards round-robin (worker w regenerates shard k iff k % N == w), and marks the
output complete once every worker has finished. Greedy output is the same for any N; a sampled run is
reproducible for a fixed N and concurrency.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING
from tqdm import tqdm

from data_pipelines.config import run_pipeline
from data_pipelines.regen_output import (
    ShardBook,
    check_fingerprint,
    finish_generation,
    identity_of,
    intact_shards,
    open_output,
    start_record,
)
from data_pipelines.turns import Conversation, TurnRegenerator
from torchspec.cli import check_at_least
from torchspec.data.formats import SkipStats, iter_records
from torchspec.data.regenerated import read_generation
from torchspec.runtime.sampling import SamplingParams

PROG = "data_pipelines.regenerate"


@dataclass
class RegenerateConfig:
    target: str = "smollm2"  # HF checkpoint dir, .gguf file or alias
    drafter: str | None = None  # a torchspec export: speculative decoding (greedy output = plain output)
    source: str = "sharegpt"  # conversation file (ShareGPT / OpenAI JSONL or JSON array) or "sharegpt"
    format: str = "auto"  # auto | messages | sharegpt
    output: str = MISSING  # the output directory (torchspec-train / data_pipelines.prepare data.path=<output>)
    max_conversations: int | None = None  # regenerate the first N records of the source only
    shard_size: int = 256  # records per shard (the unit a rerun skips or regenerates)
    concurrency: int = 64  # requests in flight
    max_new_tokens: int = 1024  # per assistant turn
    max_context: int = 4096  # prompt + reply tokens; a turn whose prompt does not fit ends the conversation
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    device: str = "auto"  # auto (cuda if available) | cuda | cpu
    dtype: str = "auto"  # auto (bf16 on cuda, fp32 on cpu) | float32 | bfloat16
    chat_template: str | None = None  # Jinja template overriding the tokenizer's
    page_size: int = 16
    cache_dir: str = "~/.cache/torchspec"
    num_workers: int = 1  # worker processes, worker w on cuda:(w % GPUs) (more than one a GPU overlaps one's
    #                       host bookkeeping with another's forwards); shards dealt round-robin
    prefill_wait: int = 8  # steps a new turn's prompt may wait to share a prefill forward (0 = at once)


def check_config(cfg: RegenerateConfig) -> SamplingParams:
    for key, low in (("shard_size", 1), ("concurrency", 1), ("max_new_tokens", 1), ("max_context", 2),
                     ("page_size", 1), ("max_conversations", 1), ("num_workers", 1), ("prefill_wait", 0)):
        check_at_least(key, getattr(cfg, key), low)
    if cfg.format not in ("auto", "messages", "sharegpt"):
        raise ValueError(f"format={cfg.format!r} is not one of ['auto', 'messages', 'sharegpt'].")
    if cfg.device not in ("auto", "cpu") and not cfg.device.startswith("cuda"):
        raise ValueError(f"device={cfg.device!r}: pass auto, cpu or cuda[:N].")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={cfg.device}: no CUDA device is visible here; pass device=cpu or device=auto.")
    if cfg.num_workers > 1 and cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={cfg.device} with num_workers={cfg.num_workers}: worker w uses cuda:(w % GPUs); "
                         "pass device=cuda (or auto) and make the GPUs to use visible with CUDA_VISIBLE_DEVICES.")
    if cfg.dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"dtype={cfg.dtype!r} is not one of ['auto', 'float32', 'bfloat16'].")
    if cfg.drafter is not None:
        from torchspec.runtime.cli import check_drafter_export

        check_drafter_export(cfg.drafter)
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    sampling.validate()
    return sampling


def regenerate(cfg: RegenerateConfig, engine=None) -> Path:
    """Regenerate into ``cfg.output`` (resuming it); ``engine``: an already built engine (tests)."""
    from torchspec.runtime.loading import resolve_dtype
    from torchspec.targets import load_tokenizer, resolve_target_path

    sampling = check_config(cfg)
    out = Path(cfg.output)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    target_path = resolve_target_path(cfg.target, os.path.expanduser(cfg.cache_dir))
    tokenizer = engine.tokenizer if engine is not None else load_tokenizer(target_path)
    if cfg.chat_template is not None:
        tokenizer.chat_template = cfg.chat_template
    identity = identity_of(cfg, target_path, tokenizer, dtype)
    generation = open_output(out, identity)
    intact = intact_shards(out)
    if generation is not None and generation.get("complete") and \
            all(int(Path(name).stem.split("_")[1]) in intact for name in generation["shards"]):
        print(f"regeneration in {out} is complete ({generation['conversations']} conversations in "
              f"{len(generation['shards'])} shards); nothing to do", flush=True)
        return out

    started = time.perf_counter()
    if cfg.num_workers > 1:
        assert engine is None, "a built engine serves one worker only"
        counted = run_workers(cfg, device, dtype, target_path, identity, generation, intact)
        record = read_generation(out)
    else:
        if engine is None:
            engine = build_engine(cfg, target_path, device, dtype)
        record = start_record(out, cfg, identity, generation, engine, target_path)
        counted = regenerate_shards(cfg, engine, tokenizer, sampling, out, intact)
    elapsed = time.perf_counter() - started
    finish_generation(out, record)
    print(f"regenerated {counted['conversations']} conversations ({counted['turns']} turns, {counted['tokens']} "
          f"tokens) in {elapsed:.1f} s: {counted['conversations'] / elapsed:.2f} conversations/s, "
          f"{counted['tokens'] / elapsed:.1f} tokens/s -> {out}", flush=True)
    return out


def run_workers(cfg: RegenerateConfig, device: torch.device, dtype: torch.dtype, target_path: str, identity: dict,
                generation: dict | None, intact: set[int]) -> Counter:
    """``cfg.num_workers`` processes, worker w on shards k % N == w; their counts summed. A worker's user
    error (e.g. a target whose weights differ from a resumed output's) is raised here as it was raised there;
    an interrupt (Ctrl-C, a time limit) stops every worker: the shards written so far stay, a rerun resumes."""
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    results = context.Queue()
    workers = [context.Process(target=_worker_main, args=(
        w, results, cfg, device.type, dtype, target_path, identity, generation, intact)) for w in range(cfg.num_workers)]
    for process in workers:
        process.start()
    outcomes: dict[int, Counter | BaseException] = {}
    try:
        while len(outcomes) < len(workers):
            try:
                worker, outcome = results.get(timeout=1.0)
                outcomes[worker] = outcome
            except queue.Empty:
                dead = [w for w, p in enumerate(workers) if w not in outcomes and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"regenerate worker {dead[0]} died (exit code {workers[dead[0]].exitcode}) "
                                       f"without a result; rerun to resume from the shards written so far.") from None
    finally:
        for process in workers:
            if process.is_alive() and len(outcomes) < len(workers):
                process.terminate()
            process.join()
    for outcome in outcomes.values():
        if isinstance(outcome, BaseException):
            raise outcome
    return sum(outcomes.values(), Counter())


def _worker_main(worker: int, results, *args) -> None:
    try:
        results.put((worker, regenerate_worker(worker, *args)))
    except Exception as err:  # sent back whole when it is a user error (exit 2 there), else by its text
        results.put((worker, err if isinstance(err, ValueError) else
                     RuntimeError(f"regenerate worker {worker}: {type(err).__name__}: {err}")))


def regenerate_worker(worker: int, cfg: RegenerateConfig, device_type: str, dtype: torch.dtype, target_path: str,
                      identity: dict, generation: dict | None, intact: set[int]) -> Counter:
    """One worker: its own engine on ``worker_device`` (the CPU, or a GPU it may share with other workers);
    worker 0 writes generation.json, every worker checks the target's weights against a resumed output's."""
    from torchspec.targets import load_tokenizer

    device = worker_device(worker, device_type, torch.cuda.device_count() if device_type == "cuda" else 0)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.num_workers))  # the workers share the host's cores
    if device.type == "cuda":
        torch.cuda.set_device(device)
    engine = build_engine(cfg, target_path, device, dtype)
    tokenizer = engine.tokenizer or load_tokenizer(target_path)
    if cfg.chat_template is not None:
        tokenizer.chat_template = cfg.chat_template
    out = Path(cfg.output)
    check_fingerprint(out, cfg, generation, engine)
    if worker == 0:
        start_record(out, cfg, identity, generation, engine, target_path)
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    owned = lambda shard: shard % cfg.num_workers == worker  # noqa: E731
    return regenerate_shards(cfg, engine, tokenizer, sampling, out, intact, owned=owned, position=worker)


def worker_device(worker: int, device_type: str, gpus: int) -> torch.device:
    """Worker ``worker``'s device: GPUs round-robin (``cuda:(worker % gpus)``), so more workers than GPUs share
    them: while one worker's host prepares its next step, another's forward keeps the GPU busy."""
    return torch.device(f"cuda:{worker % gpus}") if device_type == "cuda" else torch.device("cpu")


def build_engine(cfg: RegenerateConfig, target_path: str, device: torch.device, dtype: torch.dtype):
    from torchspec.runtime.loading import load_engine

    engine = load_engine(target_path, cfg.drafter, device=device, dtype=dtype, max_batch=cfg.concurrency,
                         max_context=cfg.max_context, page_size=cfg.page_size, cache_dir=cfg.cache_dir)
    if cfg.chat_template is not None:
        engine.tokenizer.chat_template = cfg.chat_template
    return engine


def regenerate_shards(cfg: RegenerateConfig, engine, tokenizer, sampling: SamplingParams, out: Path,
                      intact: set[int], owned: Callable[[int], bool] = lambda shard: True,
                      position: int = 0) -> Counter:
    """Regenerate every record of the ``owned`` shards outside the ``intact`` ones and write their shards;
    returns counts. ``position``: the progress bar's line (one per worker)."""
    from torchspec.runtime.drafting import SpecConfig

    engine.configure(spec=SpecConfig() if cfg.drafter is not None else None, seed=cfg.seed,
                     concurrency=cfg.concurrency, prefill_wait=cfg.prefill_wait)
    book, stats, counted = ShardBook(out, cfg.shard_size, cfg.format), SkipStats(), Counter()
    started = time.perf_counter()

    def to_do() -> Iterator[Conversation]:
        with closing(iter_records(cfg.source, cfg.format, stats)) as records:
            for index, (raw, messages, reason) in enumerate(records):
                if cfg.max_conversations is not None and index >= cfg.max_conversations:
                    break
                if index // cfg.shard_size in intact or not owned(index // cfg.shard_size):
                    continue
                book.saw(index)
                if messages is None:
                    book.resolve(index, reason)
                    continue
                yield Conversation(index, raw, messages)
        book.finish_input()

    regenerator = TurnRegenerator(engine, tokenizer, concurrency=cfg.concurrency, max_new_tokens=cfg.max_new_tokens,
                                  sampling=sampling)
    bar = tqdm(total=cfg.max_conversations and -(-cfg.max_conversations // cfg.num_workers), unit="conv",
               desc="regenerate" if cfg.num_workers == 1 else f"regenerate[{position}]", position=position,
               dynamic_ncols=True, mininterval=1)
    with bar, closing(regenerator.run(to_do())) as finished:
        for conversation in finished:
            counted.update(conversations=1, turns=len(conversation.replies), tokens=conversation.generated_tokens)
            bar.update(1)
            bar.set_postfix(tok_s=f"{counted['tokens'] / (time.perf_counter() - started):.0f}")
            book.resolve(conversation.index, conversation)
    book.finish_input()  # the input may end with records of intact shards only
    return counted


def main(argv: list[str] | None = None) -> None:
    run_pipeline(PROG, __doc__, RegenerateConfig, "regenerate_sharegpt", regenerate, argv)


if __name__ == "__main__":
    main()
