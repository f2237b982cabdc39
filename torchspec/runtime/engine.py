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
plain decode step), and return the results that finished (the two forwards: ``engine_forwards.py``). The host reads back only what a step
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

import math

import torch

from torchspec.runtime.calibration import Calibration
from torchspec.runtime.controlled_drafting import PROBE_MOST, Controller
from torchspec.runtime.cost_table import CostTable
from torchspec.runtime.drafter_runner import DrafterRunner
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.engine_forwards import (
    GREEDY,
    capture_round_shapes,
    decode_round,
    prefill_forward,
    round_kind,
)
from torchspec.runtime.graphs import StepGraphs
from torchspec.runtime.paged_kv import MIN_TABLE_KEYS, TRASH_PAGE, PageAllocator, PagedKVCache, table_columns
from torchspec.runtime.pending_drafter import PendingDrafter
from torchspec.runtime.prefix_cache import TARGET_ONLY, WITH_DRAFTER, PrefixCache
from torchspec.runtime.recurrent_state import RecurrentState
from torchspec.runtime.sampling import RowSampling, SamplingParams
from torchspec.runtime.scheduler import GenerationResult, Scheduler
from torchspec.runtime.steps import Caches
from torchspec.targets import TargetDecoder


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
            max_batch, PROBE_MOST - 1, len(runner.config.aux_layer_ids), decoder.hidden_size,
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
        self.captured_shapes: set[tuple] = set()  # the controller's round families captured (capture_round_shapes)
        self.decode_rounds = 0  # decode rounds run so far (batched: one per step with running rows)
        # per kind of round ("plain", "plain-deferring", "spec", a controller's "d<depth>w<width>"): [rounds, seconds]
        self.round_kinds: dict[str, list[float]] = {}
        # rounds with every slot of the configured concurrency live: [rounds, seconds, tokens committed] -- the
        # steady state a server with a queue runs in, without a closed run's ramp and stragglers (recipes/bench.py)
        self.full_rounds: list[float] = [0, 0.0, 0]
        # the last controller table's calibration and its latest controller (whose plans the next one continues)
        self._calibrated: tuple[CostTable, Calibration, Controller | None] | None = None
        self.configure()

    # --- request API ------------------------------------------------------------------------------

    def configure(self, *, spec: SpecConfig | None = None, seed: int = 0, concurrency: int | None = None,
                  prefill_wait: int | None = None, controller: CostTable | None = None,
                  chain_from_batch: int | None = None, controller_mode: str = "ahead") -> None:
        """What the following steps do: ``spec`` (None = plain decoding), the RNG seed of sampled
        draws, at most ``concurrency`` (default ``max_batch``) requests running at once, and
        ``prefill_wait`` (None = unchanged; see ``__init__``). ``controller``: a measured cost table
        (``torchspec-profile``): greedy rounds then draft and verify what the draft controller chooses
        within ``spec``'s shape, a chain from ``chain_from_batch`` rows on (None: the table's rule, its
        ``chain_from_batch``; a number above every batch: the tree throughout) (``controlled_drafting.Controller``;
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
                self._calibrated = (controller, Calibration(self.device), None)
            rule = controller.chain_from_batch if chain_from_batch is None else chain_from_batch
            ctl = Controller(controller, spec, self._calibrated[1], rule, controller_mode)
            if self._calibrated[2] is not None:
                ctl.continue_from(self._calibrated[2])
            self._calibrated = (controller, self._calibrated[1], ctl)
        self.spec, self.controller = spec, ctl
        self._per_round_of = {greedy: self._kv_per_round(spec, greedy) for greedy in (True, False)}
        self.scheduler.concurrency = concurrency
        # pages written by plain decoding hold no drafter entries: they are cached apart
        self.scheduler.cache_root = WITH_DRAFTER if spec is not None else TARGET_ONLY
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        if self.graphs is not None:  # graphed steps draw from the default CUDA generator
            torch.cuda.manual_seed(seed)

    @torch.no_grad()
    def capture_controller_graphs(self, up_to_context: int | None = None, sampling: SamplingParams | None = None) -> int:
        """Capture now, on idle rows, the CUDA graph of every round the configured draft controller may run at the
        configured concurrency, for rows of up to ``up_to_context`` tokens (default ``max_context``) and
        ``sampling``'s kind of round (default greedy) -> graphs captured. A round captures the shapes of its
        (batch, context bucket) before it runs anyway (``engine_forwards.capture_round_shapes``); a server calls
        this after ``configure`` so that no request waits for a capture."""
        if self.graphs is None or self.controller is None:
            raise ValueError("capture_controller_graphs needs CUDA graphs and a controller: build the engine on a "
                             "CUDA device and call configure(spec=..., controller=table) first.")
        sampling = sampling or GREEDY
        sampling.validate()
        up_to = self.max_context if up_to_context is None else min(up_to_context, self.max_context)
        batch = self.scheduler.concurrency
        index = self.slot_ids[:batch]
        params = GREEDY if sampling.greedy else RowSampling.of([sampling] * batch, self.device)
        captured, keys, last = 0, MIN_TABLE_KEYS, self.table_columns_for(up_to + self._per_round(sampling.greedy))
        while True:  # each power-of-two bucket of keys from the smallest has its own table width (table_columns)
            cols = self.table_columns_for(keys)
            captured += capture_round_shapes(self, params, round_kind(params), index, self.block_table[index, :cols],
                                             min(keys, up_to) - 1)
            if cols >= last:
                return captured
            keys *= 2

    def drafter_changed(self) -> None:
        """The drafter's weights were replaced in place (another checkpoint in the same runner, a bench's next
        drafter): what the controller learnt about the old one -- its calibration and the probe schedule of its
        plain streaks -- no longer holds, so the next ``configure`` with a controller table starts over."""
        self._calibrated = None

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
            prefill_forward(self, plan)
        rows = [i for i, s in enumerate(sch.slots)  # decoding: past the prompt, not finished (one pass, no properties)
                if s is not None and s.ctx >= len(s.request.prompt) and not s.request.result.finish_reason]
        while rows:  # rows whose next round would not fit end now; the round's kind follows the rest
            greedy = all(sch.slots[i].request.sampling.greedy for i in rows)
            left = sch.finish_out_of_context(rows, self._per_round(greedy), self.max_context)
            if left == rows:
                break
            rows = left
        if rows:
            decode_round(self, rows, greedy)
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

    def table_columns_for(self, keys: int) -> int:
        """``paged_kv.table_columns`` of this engine's table: each width is its own CUDA graph."""
        return table_columns(keys, self.page_size, self.pages_per_row)

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


__all__ = ["GenerationResult", "SpeculativeEngine"]
