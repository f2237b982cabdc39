"""``SpeculativeEngine``: a target decoder, an optional exported drafter, a paged KV cache, and ``generate``.

Scheduling is continuous batching over ``max_batch`` slots: a waiting prompt is prefilled into a
free slot, all occupied slots then advance together (one speculation round, or one plain decode
step), and a slot is freed -- its pages returned -- as soon as its sequence finishes. The host
reads back only what a step committed (a few ints per row) once per round; all per-round tensors
are static in shape.

A hybrid target (Gated DeltaNet layers) also keeps a recurrent state per slot
(``torchspec/runtime/recurrent_state.py``): a prompt prefilled into a slot starts from zero state
(prefill never reads the slot's previous contents) and every step commits the state of the tokens
it commits. Since committing is not idempotent, the first call of a CUDA graph (two warm-up runs
and a replay, ``graphs.py``) is made with every row invalid, which commits nothing.

Stop rules (identical with and without speculation, so greedy outputs are comparable token for
token): a sequence ends after an EOS / stop token (kept in ``token_ids``), after
``max_new_tokens`` tokens, or when its next round would not fit ``max_context`` (reason "length").
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from torchspec.runtime.drafter_runner import DrafterRunner
from torchspec.runtime.drafting import DraftInputs, SpecConfig
from torchspec.runtime.graphs import StepGraphs
from torchspec.runtime.paged_kv import TRASH_PAGE, PageAllocator, PagedKVCache
from torchspec.runtime.recurrent_state import RecurrentState
from torchspec.runtime.sampling import SamplingParams
from torchspec.runtime.steps import Caches, plain_step, prefill, speculate
from torchspec.targets import TargetDecoder


@dataclass
class GenerationResult:
    prompt_len: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per decode round
    text: str | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0  # wall time of the rounds this sequence took part in

    @property
    def mean_acceptance(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    def to_dict(self) -> dict:
        return {"prompt_len": self.prompt_len, "token_ids": self.token_ids, "text": self.text,
                "finish_reason": self.finish_reason, "accept_lengths": self.accept_lengths,
                "mean_acceptance": self.mean_acceptance, "prefill_s": self.prefill_s, "decode_s": self.decode_s}


@dataclass
class _Slot:
    index: int  # request index
    result: GenerationResult
    pages: list[int]
    ctx: int  # tokens in the KV cache


class SpeculativeEngine:
    def __init__(self, decoder: TargetDecoder, runner: DrafterRunner | None = None, tokenizer=None, *,
                 max_batch: int = 8, max_context: int = 2048, page_size: int = 16, num_pages: int | None = None,
                 cuda_graphs: bool | None = None, prefill_tokens: int = 16384, fuse: bool = True):
        """``fuse``: serve with `TargetDecoder.fuse_for_serving` (one GEMM for q|k|v and for gate|up,
        elementwise chains compiled to one kernel each on CUDA); it changes the decoder in place."""
        if max_batch < 1 or max_context < 2 or page_size < 1:
            raise ValueError(f"SpeculativeEngine: max_batch={max_batch} >= 1, max_context={max_context} >= 2 and "
                             f"page_size={page_size} >= 1 are required.")
        if fuse:
            decoder.fuse_for_serving()
        self.decoder, self.runner, self.tokenizer = decoder, runner, tokenizer
        self.max_batch, self.max_context, self.page_size = max_batch, max_context, page_size
        self.prefill_tokens = prefill_tokens  # padded tokens per batched prefill forward
        self.pages_per_row = math.ceil(max_context / page_size)
        num_pages = num_pages or max_batch * self.pages_per_row + 1
        self.allocator = PageAllocator(num_pages)
        dev = decoder.embed_tokens_weight.device
        self.device = dev
        drafter_cache = runner.make_kv_cache(num_pages, page_size) if runner is not None else None
        self.caches = Caches(PagedKVCache.for_target(decoder, num_pages, page_size), drafter_cache, page_size,
                             RecurrentState.for_target(decoder, max_batch))
        self.block_table = torch.full((max_batch, self.pages_per_row), TRASH_PAGE, dtype=torch.long, device=dev)
        self.root = torch.zeros(max_batch, dtype=torch.long, device=dev)
        if runner is not None:
            self.normed = torch.zeros(max_batch, runner.hidden_size, dtype=runner.dtype, device=dev)
            self.feedback = torch.zeros_like(self.normed)
        self.eos_token_ids = set(decoder.eos_token_ids)
        if cuda_graphs is None:
            cuda_graphs = dev.type == "cuda"
        if cuda_graphs and dev.type != "cuda":
            raise ValueError("cuda_graphs=True needs the engine on a CUDA device.")
        self.graphs = StepGraphs() if cuda_graphs else None
        self._graph_keys: set = set()  # keys whose graph has been made (hybrid targets: see the docstring)

    # --- bookkeeping ---------------------------------------------------------------------------

    def _ensure_pages(self, slot_id: int, slot: _Slot, length: int) -> None:
        need = math.ceil(length / self.page_size) - len(slot.pages)
        if need > 0:
            new = self.allocator.alloc(need)
            start = len(slot.pages)
            slot.pages.extend(new)
            self.block_table[slot_id, start:start + need] = torch.tensor(new, dtype=torch.long)

    def _release(self, slot_id: int, slot: _Slot) -> None:
        self.allocator.free(slot.pages)
        slot.pages = []
        self.block_table[slot_id] = TRASH_PAGE

    def _commit(self, slot: _Slot, tokens: list[int], max_new: int, stop: set[int]) -> None:
        res = slot.result
        for tok in tokens:
            res.token_ids.append(tok)
            if tok in stop:
                res.finish_reason = "stop"
                return
            if len(res.token_ids) >= max_new:
                res.finish_reason = "length"
                return

    # --- API -------------------------------------------------------------------------------------

    def check_request(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams,
                      spec: SpecConfig | None) -> None:
        sampling.validate()
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0.")
        if spec is not None:
            if self.runner is None:
                raise ValueError("speculation needs a drafter: build the SpeculativeEngine with one, or pass spec=None.")
            spec.validate()
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: give at least one token (e.g. the chat template's prefix).")
            if len(p) >= self.max_context:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the engine's max_context is {self.max_context} "
                                 f"(prompt + generated tokens must fit). Shorten it or raise max_context.")
            bad = [t for t in p if not 0 <= t < self.decoder.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} holds token ids outside [0, {self.decoder.vocab_size}): {bad[:5]}.")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]] | list[str], *, max_new_tokens: int = 128,
                 sampling: SamplingParams | None = None, spec: SpecConfig | None = None, seed: int = 0,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                 concurrency: int | None = None) -> list[GenerationResult]:
        """Generate for every prompt (token id lists, or strings if the engine has a tokenizer).

        ``spec=None`` decodes plainly (one target forward per token); otherwise each round drafts
        and verifies per ``spec``. At most ``concurrency`` (default ``max_batch``) sequences run
        at once. Results come back in prompt order.
        """
        concurrency = concurrency or self.max_batch
        if not 1 <= concurrency <= self.max_batch:
            raise ValueError(f"concurrency={concurrency} must lie in [1, max_batch={self.max_batch}].")
        sampling = sampling or SamplingParams()
        if prompts and isinstance(prompts[0], str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a SpeculativeEngine built with a tokenizer; pass token ids instead.")
            prompts = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        self.check_request(prompts, max_new_tokens, sampling, spec)
        stop = set() if ignore_eos else set(self.eos_token_ids)
        stop |= set(stop_token_ids or ())
        results = [GenerationResult(prompt_len=len(p)) for p in prompts]
        if max_new_tokens == 0:
            for r in results:
                r.finish_reason = "length"
            return self._finish(results)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        if self.graphs is not None:  # graphed steps draw from the default CUDA generator
            torch.cuda.manual_seed(seed)
        runner = self.runner if spec is not None else None
        per_round = 1  # KV positions a round may write beyond a row's committed prefix
        if spec is not None:
            per_round = max(1 + spec.num_drafted(sampling), spec.draft_slots(sampling), spec.depth + 1)
        waiting = deque(range(len(prompts)))
        slots: list[_Slot | None] = [None] * concurrency
        try:
            while waiting or any(s is not None for s in slots):
                free = [i for i in range(concurrency) if slots[i] is None]
                if free and waiting:  # fill free slots: one batched prefill
                    admitted = [(slot_id, waiting.popleft()) for slot_id in free[: len(waiting)]]
                    self._admit(admitted, slots, prompts, results, runner, sampling, generator, max_new_tokens,
                                stop)
                    for slot_id, _ in admitted:
                        self._retire_if_done(slot_id, slots, per_round)
                active = [i for i, s in enumerate(slots) if s is not None]
                if not active:
                    continue
                for i in active:
                    self._ensure_pages(i, slots[i], slots[i].ctx + per_round)
                self._round(active, slots, runner, spec, sampling, generator, max_new_tokens, stop)
                for i in active:
                    self._retire_if_done(i, slots, per_round)
        finally:
            for i, s in enumerate(slots):
                if s is not None:
                    self._release(i, s)
        return self._finish(results)

    def _admit(self, admitted, slots, prompts, results, runner, sampling, generator, max_new, stop) -> None:
        """Prefill the prompts of ``admitted`` [(slot_id, request index)] together, in chunks of
        at most ``prefill_tokens`` padded tokens."""
        t0 = time.perf_counter()
        chunk: list = []
        for pair in sorted(admitted, key=lambda x: len(prompts[x[1]])):  # ascending: the newest is the longest
            if chunk and len(prompts[pair[1]]) * (len(chunk) + 1) > self.prefill_tokens:
                self._prefill_chunk(chunk, slots, prompts, results, runner, sampling, generator, max_new, stop)
                chunk = []
            chunk.append(pair)
        self._prefill_chunk(chunk, slots, prompts, results, runner, sampling, generator, max_new, stop)
        dt = time.perf_counter() - t0
        for slot_id, _ in admitted:
            if slots[slot_id] is not None:
                slots[slot_id].result.prefill_s = dt / len(admitted)

    def _prefill_chunk(self, chunk, slots, prompts, results, runner, sampling, generator, max_new, stop) -> None:
        lengths = [len(prompts[i]) for _, i in chunk]
        width = max(lengths)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (slot_id, index) in enumerate(chunk):
            ids[row, : lengths[row]] = torch.tensor(prompts[index])
            slots[slot_id] = _Slot(index=index, result=results[index], pages=[], ctx=lengths[row])
            self._ensure_pages(slot_id, slots[slot_id], lengths[row])
        rows = torch.tensor([slot_id for slot_id, _ in chunk], dtype=torch.long).to(self.device)
        out = prefill(self.decoder, runner, self.caches, self.block_table[rows], ids.to(self.device),
                      torch.tensor(lengths).to(self.device), sampling, generator, slots=rows)
        self._store(rows, out)
        for (slot_id, _), first in zip(chunk, out.root.tolist()):
            self._commit(slots[slot_id], [first], max_new, stop)

    def _store(self, rows: torch.Tensor, out) -> None:
        self.root[rows] = out.root
        if out.normed is not None:
            self.normed[rows] = out.normed.to(self.normed.dtype)
            self.feedback[rows] = out.feedback.to(self.feedback.dtype)

    def _round(self, active, slots, runner, spec, sampling, generator, max_new, stop) -> None:
        t0 = time.perf_counter()
        if self.graphs is not None:  # every slot, empty ones as invalid rows: one static shape
            active_all = list(range(len(slots)))
            valid = torch.tensor([s is not None for s in slots], dtype=torch.bool).to(self.device)
        else:
            active_all = active
            valid = torch.ones(len(active), dtype=torch.bool, device=self.device)
        rows = torch.tensor(active_all, dtype=torch.long).to(self.device)
        ctx = torch.tensor([slots[i].ctx if slots[i] is not None else 0 for i in active_all],
                           dtype=torch.long).to(self.device)
        bt = self.block_table[rows]
        if runner is None:
            def step(bt, ctx, root, valid, slots):
                return plain_step(self.decoder, self.caches, bt, ctx, root, valid, sampling,
                                  generator if self.graphs is None else None, slots=slots)
            args = {"bt": bt, "ctx": ctx, "root": self.root[rows], "valid": valid, "slots": rows}
            key = ("plain", len(active_all), sampling)
        else:
            def step(inp, slots):
                return speculate(self.decoder, runner, self.caches, inp, spec, sampling,
                                 generator if self.graphs is None else None, slots=slots)
            args = {"inp": DraftInputs(root=self.root[rows], normed=self.normed[rows], feedback=self.feedback[rows],
                                       ctx_len=ctx, block_table=bt, row_valid=valid), "slots": rows}
            key = ("spec", len(active_all), spec, sampling)
        out = step(**args) if self.graphs is None else self._run_graph(key, step, args)
        self._store(rows, out)
        tokens, counts = out.tokens.tolist(), out.count.tolist()  # the round's one host sync
        dt = time.perf_counter() - t0
        for j, i in enumerate(active_all):
            slot = slots[i]
            if slot is None:
                continue
            slot.ctx += counts[j]
            slot.result.accept_lengths.append(counts[j])
            slot.result.decode_s += dt
            self._commit(slot, tokens[j][: counts[j]], max_new, stop)

    def _run_graph(self, key, step, args: dict):
        """``graphs.run``; a hybrid target's first call of ``key`` runs with every row invalid first,
        so the capture's warm-up runs and first replay commit no recurrent state (nor RNG draws)."""
        if self.caches.recurrent is not None and key not in self._graph_keys:
            idle = dict(args)
            if "valid" in idle:
                idle["valid"] = torch.zeros_like(args["valid"])
            else:
                idle["inp"] = dataclasses.replace(args["inp"], row_valid=torch.zeros_like(args["inp"].row_valid))
            rng = torch.cuda.get_rng_state()
            self.graphs.run(key, step, idle)
            torch.cuda.set_rng_state(rng)
        self._graph_keys.add(key)
        return self.graphs.run(key, step, args)

    def _retire_if_done(self, slot_id: int, slots: list, per_round: int) -> None:
        slot = slots[slot_id]
        if slot is None:
            return
        # the next round writes KV positions ctx .. ctx + per_round - 1 and may commit up to
        # per_round tokens beyond them: stop while prompt + generated still fits max_context
        if not slot.result.finish_reason and slot.ctx + per_round >= self.max_context:
            slot.result.finish_reason = "length"
        if slot.result.finish_reason:
            self._release(slot_id, slot)
            slots[slot_id] = None

    def _finish(self, results: list[GenerationResult]) -> list[GenerationResult]:
        if self.tokenizer is not None:
            for r in results:
                r.text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        return results

    @property
    def free_pages(self) -> int:
        return self.allocator.free_pages

    @property
    def total_pages(self) -> int:
        return self.allocator.capacity
