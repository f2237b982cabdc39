"""``SpeculativeEngine``: a target decoder, an optional exported drafter, a paged KV cache, and requests.

Request API: ``submit`` a prompt with its own limits and sampling settings (-> request id),
``cancel`` it, call ``step`` until ``has_work`` is False; ``generate`` is that loop for a list of
prompts. ``configure`` sets what the steps do: ``spec`` (None = plain decoding), the seed and the
concurrency.

One ``step`` is one scheduling iteration (``scheduler.py`` does the host bookkeeping): free the
slots of cancelled requests, admit waiting requests into free slots (each takes its prompt's longest
cached prefix, ``prefix_cache.py``), run ONE prefill forward (the next chunks of the prompts being
prefilled, at most ``prefill_tokens`` padded tokens: a long prompt never stalls the running rows for
its whole prefill), then ONE decode round over the rows past their prefill (a speculation round, or a
plain decode step), and return the results that finished. The host reads back only what a step
committed (a few ints per row) once per round, and once per prefill forward (its first tokens); all
per-round tensors are static in shape. What the host sends (chunk tokens, lengths, block-table
entries, per-row settings) goes as one packed asynchronous copy per forward (``scheduler.host_to_device``),
never a sync.

The rows of a round may carry different sampling settings: a round whose rows are all greedy runs
the greedy round (argmax verification, dynamic tree); any sampled row makes it a mixed round with
per-row settings (``sampling.RowSampling``; sampled tree). CUDA graphs are keyed by (kind, batch
size, spec, greedy / mixed / mixed with a top-k or top-p row) only: the per-row values are graph inputs
(a mixed round without top-k / top-p skips the filter's vocabulary-wide sort). Sampled draws come from
one generator per ``configure`` (seed), so a run is reproducible for a fixed seed and schedule.

A hybrid target (Gated DeltaNet layers) also keeps a recurrent state per slot
(``torchspec/runtime/recurrent_state.py``): a prompt's first chunk starts from zero state (prefill
never reads the slot's previous contents), later chunks continue it, and every step commits the
state of the tokens it commits. That state is not paged, so prefix caching is off for such targets.
Since committing is not idempotent, a CUDA graph's warm-up runs (``graphs.py``) see every row
invalid, which commits nothing.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from torchspec.runtime.controlled_drafting import PROBE_EVERY, Calibration, Controller
from torchspec.runtime.cost_table import CostTable
from torchspec.runtime.drafter_runner import DrafterRunner
from torchspec.runtime.drafting import DraftInputs, SpecConfig
from torchspec.runtime.graphs import StepGraphs
from torchspec.runtime.paged_kv import TRASH_PAGE, PageAllocator, PagedKVCache, table_columns
from torchspec.runtime.pending_drafter import PendingDrafter
from torchspec.runtime.prefix_cache import TARGET_ONLY, WITH_DRAFTER, PrefixCache
from torchspec.runtime.recurrent_state import RecurrentState
from torchspec.runtime.sampling import RowSampling, SamplingParams
from torchspec.runtime.scheduler import GenerationResult, Scheduler, host_to_device
from torchspec.runtime.steps import Caches, plain_step, prefill, speculate
from torchspec.targets import TargetDecoder

GREEDY = SamplingParams()


class SpeculativeEngine:
    def __init__(self, decoder: TargetDecoder, runner: DrafterRunner | None = None, tokenizer=None, *,
                 max_batch: int = 8, max_context: int = 2048, page_size: int = 16, num_pages: int | None = None,
                 cuda_graphs: bool | None = None, prefill_tokens: int = 16384, fuse: bool = True,
                 prefix_cache: bool = True, prefill_wait: int = 0):
        """``fuse``: serve with `TargetDecoder.fuse_for_serving` and `DrafterRunner.fuse_for_serving`
        (one GEMM for q|k|v and for gate|up, elementwise chains compiled to one kernel each on CUDA);
        it changes the decoder and the drafter in place.
        ``prefill_tokens``: padded tokens per prefill forward (longer prompts are prefilled in chunks).
        ``prefix_cache``: share full prompt pages between requests (always off for hybrid targets).
        ``prefill_wait``: steps a prompt admitted while others decode may wait to share a prefill
        forward with later ones (``scheduler.py``; 0 = prefill at once)."""
        if max_batch < 1 or max_context < 2 or page_size < 1 or prefill_tokens < 1 or prefill_wait < 0:
            raise ValueError(f"SpeculativeEngine: max_batch={max_batch} >= 1, max_context={max_context} >= 2, "
                             f"page_size={page_size} >= 1, prefill_tokens={prefill_tokens} >= 1 and "
                             f"prefill_wait={prefill_wait} >= 0 are required.")
        if fuse:
            decoder.fuse_for_serving()
            if runner is not None:
                runner.fuse_for_serving()
        self.decoder, self.runner, self.tokenizer = decoder, runner, tokenizer
        self.max_batch, self.max_context, self.page_size = max_batch, max_context, page_size
        self.prefill_tokens = prefill_tokens
        self.pages_per_row = math.ceil(max_context / page_size)
        num_pages = num_pages or max_batch * self.pages_per_row + 1
        dev = decoder.embed_tokens_weight.device
        self.device = dev
        drafter_cache = runner.make_kv_cache(num_pages, page_size) if runner is not None else None
        pending = None if runner is None else PendingDrafter(  # the controller's plain rounds defer drafter entries
            max_batch, PROBE_EVERY - 1, len(runner.config.aux_layer_ids), decoder.hidden_size,
            decoder.embed_tokens_weight.dtype, decoder.embed_tokens_weight.device)
        self.caches = Caches(PagedKVCache.for_target(decoder, num_pages, page_size), drafter_cache, page_size,
                             RecurrentState.for_target(decoder, max_batch), pending)
        self.prefix_cache = PrefixCache(page_size) if prefix_cache and self.caches.recurrent is None else None
        self.allocator = PageAllocator(num_pages, self.prefix_cache.evict if self.prefix_cache else None)
        self.block_table = torch.full((max_batch, self.pages_per_row), TRASH_PAGE, dtype=torch.long, device=dev)
        self.scheduler = Scheduler(max_batch, page_size, self.block_table, self.allocator, self.prefix_cache,
                                   prefill_tokens, prefill_wait)
        self.slot_ids = torch.arange(max_batch, device=dev)  # the active rows of a graphed round
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
        self.decode_rounds = 0  # decode rounds run so far (batched: one per step with running rows)
        self._calibrated: tuple[CostTable, Calibration] | None = None  # the last controller table's calibration
        self.configure()

    # --- request API ------------------------------------------------------------------------------

    def configure(self, *, spec: SpecConfig | None = None, seed: int = 0, concurrency: int | None = None,
                  prefill_wait: int | None = None, controller: CostTable | None = None,
                  chain_from_batch: int | None = None, controller_mode: str = "ahead") -> None:
        """What the following steps do: ``spec`` (None = plain decoding), the RNG seed of sampled
        draws, at most ``concurrency`` (default ``max_batch``) requests running at once, and
        ``prefill_wait`` (None = unchanged; see ``__init__``). ``controller``: a measured cost table
        (``torchspec-profile``): greedy rounds then draft and verify what the draft controller chooses
        within ``spec``'s shape, a chain from ``chain_from_batch`` rows on (``controlled_drafting.Controller``;
        ``controller_mode`` "ahead": each round's shape planned by the previous one on the GPU, graphed;
        "within": decided after every depth on the host, without graphs; ``self.controller.trace`` holds each
        greedy round's (depths drafted, verified width)). Only between requests: refused while any is in flight."""
        if self.scheduler.has_work:
            raise ValueError("configure: requests are in flight; finish or cancel them first.")
        concurrency = concurrency or self.max_batch
        if not 1 <= concurrency <= self.max_batch:
            raise ValueError(f"concurrency={concurrency} must lie in [1, max_batch={self.max_batch}].")
        if prefill_wait is not None:
            if prefill_wait < 0:
                raise ValueError(f"prefill_wait={prefill_wait} must be >= 0 (0 = prefill at once).")
            self.scheduler.prefill_wait = prefill_wait
        if spec is not None:
            if self.runner is None:
                raise ValueError("speculation needs a drafter: build the SpeculativeEngine with one, or pass spec=None.")
            spec.validate()
        if controller is not None:
            if spec is None:
                raise ValueError("controller needs a spec: its shape bounds the depth, top-k and nodes the controller chooses.")
            if controller.batches[-1] < concurrency:
                raise ValueError(f"controller: the cost table measured batches up to {controller.batches[-1]} but "
                                 f"{concurrency} rows may run at once; re-run torchspec-profile with --batches up to "
                                 f"{concurrency} or lower the concurrency.")
            if self.graphs is not None and controller_mode == "within":
                raise ValueError("controller_mode='within' decides on the host after every depth, without CUDA graphs; "
                                 "build the SpeculativeEngine with cuda_graphs=False or use controller_mode='ahead'.")
        ctl = None
        if controller is not None:  # the drafter's calibration lives as long as its cost table (plain runs between)
            if self._calibrated is None or self._calibrated[0] is not controller:
                self._calibrated = (controller, Calibration(self.device))
            ctl = Controller(controller, spec, self._calibrated[1], chain_from_batch, controller_mode)
        self.spec, self.controller = spec, ctl
        self._per_round_of = {greedy: self._kv_per_round(spec, greedy) for greedy in (True, False)}
        self.scheduler.concurrency = concurrency
        # pages written by plain decoding hold no drafter entries: they are cached apart
        self.scheduler.cache_root = WITH_DRAFTER if spec is not None else TARGET_ONLY
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        if self.graphs is not None:  # graphed steps draw from the default CUDA generator
            torch.cuda.manual_seed(seed)

    def submit(self, prompt_ids: list[int] | str, *, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
               stop_token_ids=(), ignore_eos: bool = False) -> int:
        """Queue a request; returns its id. It stops after an EOS (unless ``ignore_eos``) or one of
        ``stop_token_ids``, after ``max_new_tokens`` tokens, or at the context limit."""
        sampling = sampling or GREEDY
        prompt = self._encode([prompt_ids])[0]
        self.check_request([prompt], max_new_tokens, sampling, self.spec)
        stop = frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(self.eos_token_ids))
        return self.scheduler.submit(prompt, max_new_tokens, sampling, stop)

    def cancel(self, request_id: int) -> bool:
        """Cancel a request: a waiting one at once, a running one at the next scheduling point (its
        slot and pages are freed then). Its result, with the tokens so far and ``finish_reason =
        "cancelled"``, comes out of a following ``step``. Returns False, doing nothing, for a request
        that has finished (or was cancelled) already; raises ValueError for an id never issued."""
        return self.scheduler.cancel(request_id)

    @property
    def has_work(self) -> bool:
        """Requests waiting or running, or results not yet returned by ``step``."""
        return self.scheduler.has_work

    @torch.no_grad()
    def step(self) -> list[GenerationResult]:
        """One scheduling iteration (module docstring); returns the results finished in it."""
        sch = self.scheduler
        done = sch.drain()
        sch.admit()
        plan = sch.plan_prefill()
        if plan:
            self._prefill(plan)
        rows = [i for i, s in enumerate(sch.slots)  # decoding: past the prompt, not finished (one pass, no properties)
                if s is not None and s.ctx >= len(s.request.prompt) and not s.request.result.finish_reason]
        while rows:  # rows whose next round would not fit end now; the round's kind follows the rest
            greedy = all(sch.slots[i].request.sampling.greedy for i in rows)
            left = sch.finish_out_of_context(rows, self._per_round(greedy), self.max_context)
            if left == rows:
                break
            rows = left
        if rows:
            self._round(rows, greedy)
        return self._finish(done + sch.retire())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]] | list[str], *, max_new_tokens: int = 128,
                 sampling: SamplingParams | None = None, spec: SpecConfig | None = None, seed: int = 0,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                 concurrency: int | None = None, controller: CostTable | None = None,
                 chain_from_batch: int | None = None, controller_mode: str = "ahead") -> list[GenerationResult]:
        """Generate for every prompt (token id lists, or strings if the engine has a tokenizer), all
        with the same settings: ``configure``, ``submit`` each, ``step`` until done.

        ``spec=None`` decodes plainly (one target forward per token); otherwise each round drafts
        and verifies per ``spec`` (within it, what the draft controller chooses with a ``controller``
        cost table). At most ``concurrency`` (default ``max_batch``) sequences run at once. Results come
        back in prompt order. Needs an idle engine.
        """
        sampling = sampling or GREEDY
        prompts = self._encode(prompts)
        self.check_request(prompts, max_new_tokens, sampling, spec)
        self.configure(spec=spec, seed=seed, concurrency=concurrency, controller=controller,
                       chain_from_batch=chain_from_batch, controller_mode=controller_mode)
        ids = [self.submit(p, max_new_tokens=max_new_tokens, sampling=sampling, stop_token_ids=stop_token_ids or (),
                           ignore_eos=ignore_eos) for p in prompts]
        results: dict[int, GenerationResult] = {}
        try:
            while self.has_work:
                results.update((r.request_id, r) for r in self.step())
        except BaseException:
            self.scheduler.abort()
            raise
        return [results[i] for i in ids]

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

    # --- steps ------------------------------------------------------------------------------------

    @staticmethod
    def _kv_per_round(spec: SpecConfig | None, greedy: bool) -> int:
        """KV positions a round may write beyond a row's committed prefix."""
        if spec is None:
            return 1
        params = GREEDY if greedy else SamplingParams(temperature=1.0)
        return max(1 + spec.num_drafted(params), spec.draft_slots(params), spec.depth + 1)

    def _per_round(self, greedy: bool) -> int:
        return self._per_round_of[greedy]

    def _sampling(self, rows: list[int], active, greedy: bool) -> SamplingParams | RowSampling:
        """The round's settings: ``RowSampling`` over ``active`` (``rows`` keep theirs, the others are
        greedy), built on the host and sent by asynchronous copies (no sync)."""
        if greedy:
            return GREEDY
        slots, chosen = self.scheduler.slots, set(rows)
        host = RowSampling.of([slots[i].request.sampling if i in chosen else GREEDY for i in active], "cpu")
        t, p, k = (host_to_device(x, x.dtype, self.device) for x in (host.temperature, host.top_p, host.top_k))
        return RowSampling(t, p, k, greedy=host.greedy, filtered=host.filtered)

    def _prefill(self, plan: list[tuple[int, int]]) -> None:
        """One prefill forward: the next chunk of each planned slot's prompt [(slot, length)]."""
        t0 = time.perf_counter()
        sch, slots = self.scheduler, self.scheduler.slots
        b, width = len(plan), max(n for _, n in plan)
        rows = [i for i, _ in plan]
        lengths = [n for _, n in plan]
        ctx = [slots[i].ctx for i in rows]
        follow, ids = [], []
        for i, n in plan:
            s, prompt = slots[i], slots[i].request.prompt
            follow.append(prompt[s.ctx + n] if s.ctx + n < len(prompt) else -1)
            ids += prompt[s.ctx:s.ctx + n]
            ids += [0] * (width - n)
            sch.ensure_pages(i, s.ctx + n)
        sch.flush_table()
        cols = self.table_columns_for(max(c + n for c, n in zip(ctx, lengths)))
        packed = host_to_device(rows + lengths + ctx + follow + ids, torch.long, self.device)  # one copy
        index, lengths_d, ctx_d, follow_d = (packed[k * b:(k + 1) * b] for k in range(4))
        greedy = all(slots[i].request.sampling.greedy for i in rows)
        out = prefill(self.decoder, self.runner if self.spec is not None else None, self.caches,
                      self.block_table[index, :cols], packed[4 * b:].view(b, width), lengths_d,
                      self._sampling(rows, rows, greedy), self.generator, slots=index, ctx=ctx_d,
                      next_tokens=follow_d)
        self._store(index, out)
        if self.caches.pending is not None:  # a new request's drafter entries are its prefill's
            self.caches.pending.reset(index)
        first = out.root.tolist()
        dt = time.perf_counter() - t0
        for (i, n), tok, nxt in zip(plan, first, follow):
            sch.prefilled(i, n)
            slots[i].request.result.prefill_s += dt / len(plan)
            if nxt < 0:  # the prompt's last chunk: its first token
                sch.commit(i, [tok])

    def _store(self, rows: torch.Tensor, out) -> None:
        self.root[rows] = out.root
        if out.normed is not None:
            self.normed[rows] = out.normed.to(self.normed.dtype)
            self.feedback[rows] = out.feedback.to(self.feedback.dtype)

    def _round(self, rows: list[int], greedy: bool) -> None:
        """One decode round (speculation, or a plain step) over ``rows``; with CUDA graphs every slot
        runs, the others as invalid rows, so one static shape serves all rounds."""
        t0 = time.perf_counter()
        self.decode_rounds += 1
        sch, spec = self.scheduler, self.spec
        slots = sch.slots
        per_round = self._per_round(greedy)
        for i in rows:
            sch.ensure_pages(i, slots[i].ctx + per_round)  # allocates only when the round crosses into a new page
        sch.flush_table()
        if self.graphs is not None:  # every slot runs (one static shape); row j is slot j
            active, chosen = range(sch.concurrency), set(rows)
            index = self.slot_ids[: sch.concurrency]
            ctx = host_to_device([slots[i].ctx if i in chosen else -1 for i in active], torch.long, self.device)
            valid = ctx >= 0
            ctx = ctx.clamp(min=0)
            position = rows  # of row i in the round's outputs
        else:
            active = rows
            packed = host_to_device(rows + [slots[i].ctx for i in rows], torch.long, self.device)
            index, ctx = packed[: len(rows)], packed[len(rows):]
            valid = torch.ones(len(rows), dtype=torch.bool, device=self.device)
            position = range(len(rows))
        cols = self.table_columns_for(max(slots[i].ctx for i in rows) + per_round)
        bt = self.block_table[index, :cols]
        params = self._sampling(rows, active, greedy)
        generator = self.generator if self.graphs is None else None
        costs = None
        if spec is None:
            def step(bt, ctx, root, valid, slots, params):
                return plain_step(self.decoder, self.caches, bt, ctx, root, valid, params, generator, slots=slots)
            args = {"bt": bt, "ctx": ctx, "root": self.root[index], "valid": valid, "slots": index, "params": params}
        else:
            if self.controller is not None:  # the round's shape and measured costs at its batch and context
                spec, costs = self.controller.plan(params, len(active), max(slots[i].ctx for i in rows))

            def step(inp, slots, params, costs):  # costs: graph inputs (the table's row for this batch and context)
                return speculate(self.decoder, self.runner, self.caches, inp, spec, params, generator, slots=slots,
                                 costs=costs)
            args = {"inp": DraftInputs(root=self.root[index], normed=self.normed[index],
                                       feedback=self.feedback[index], ctx_len=ctx, block_table=bt, row_valid=valid),
                    "slots": index, "params": params, "costs": costs}
        kind = "greedy" if greedy else "mixed-filtered" if params.filtered else "mixed"  # host-side, static
        key = ("plain" if spec is None else "spec", len(active), spec, kind, cols, costs and (costs.plan, costs.flush))
        out = step(**args) if self.graphs is None else self._run_graph(key, step, args)
        self._store(index, out)
        synced = torch.cat([out.count[:, None], out.tokens], 1)
        if out.plan is not None:  # the controller's plan rides on the same transfer (a padded last row)
            synced = torch.cat([synced, torch.nn.functional.pad(out.plan, (0, synced.shape[1] - 2))[None]])
        committed = synced.tolist()  # the round's one host sync
        if self.controller is not None:
            self.controller.after(costs, committed.pop() if out.plan is not None else None)
        dt = time.perf_counter() - t0
        for i, j in zip(rows, position):
            count, *tokens = committed[j]
            s = slots[i]
            s.ctx += count
            result = s.request.result
            result.decode_s += dt
            result.accept_lengths.append(sch.commit(i, tokens[:count]))  # a stop or the limit may cut the round

    def table_columns_for(self, keys: int) -> int:
        """``paged_kv.table_columns`` of this engine's table: each width is its own CUDA graph."""
        return table_columns(keys, self.page_size, self.pages_per_row)

    def _run_graph(self, key, step, args: dict):
        """``graphs.run``; a hybrid target's graph, and a controlled round's (its deferred drafter entries and the
        calibration's evidence), are captured on idle inputs (every row invalid), so the warm-up runs commit no
        state (``graphs.py``)."""
        stateful = self.caches.recurrent is not None or args.get("costs") is not None
        return self.graphs.run(key, step, args, capture_inputs=_all_rows_invalid if stateful else None)

    # --- helpers ----------------------------------------------------------------------------------

    def _encode(self, prompts: list) -> list[list[int]]:
        if prompts and isinstance(prompts[0], str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a SpeculativeEngine built with a tokenizer; pass token ids instead.")
            return [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return [list(p) for p in prompts]

    def _finish(self, results: list[GenerationResult]) -> list[GenerationResult]:
        if self.tokenizer is not None:
            for r in results:
                r.text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        return results

    @property
    def free_pages(self) -> int:
        """Pages a request could get now: free, or cached by the prefix cache but held by no sequence."""
        idle = self.prefix_cache.idle_pages if self.prefix_cache is not None else 0
        return self.allocator.free_pages + idle

    @property
    def total_pages(self) -> int:
        return self.allocator.capacity


def _all_rows_invalid(args: dict) -> dict:
    """A step's inputs with every row invalid: running it writes nothing (CUDA-graph warm-ups)."""
    idle = dict(args)
    if "valid" in idle:
        idle["valid"] = torch.zeros_like(args["valid"])
    else:
        idle["inp"] = dataclasses.replace(args["inp"], row_valid=torch.zeros_like(args["inp"].row_valid))
    return idle


__all__ = ["GenerationResult", "SpeculativeEngine"]
