"""Host-side scheduling of the engine's requests: queue, slots, pages, prefix reuse, prefill chunks, stop rules.

Everything here is bookkeeping the host does between steps (``SpeculativeEngine.step`` runs the
forwards). A request waits in a FIFO queue until one of ``concurrency`` slots is free; admitted, it
takes the longest cached prefix of its prompt (``prefix_cache.py``; those pages enter its block table
as shared pages, its ``ctx`` starts after them), then its prompt is prefilled in chunks
(``plan_prefill``: at most ``prefill_tokens`` padded tokens per forward, oldest requests first, a chunk
may end anywhere, also mid-page), and after the last chunk it decodes with the others. Each finished
prompt page is offered to the prefix cache as soon as its chunk is written.

Pages: a slot's block table lists its pages in position order; the first ``shared`` are held in the
prefix cache (matched, or registered by this slot), the rest are its own. Releasing a slot drops its
references to the former and returns the latter to the allocator. Block-table entries are written to
the device table in one batch per forward (``flush_table``, one asynchronous copy: no host sync), and
a released row is reset on the device at once, so a row never keeps an earlier occupant's pages. ``cancel`` of a running request
takes effect at the next scheduling point (``drain``): its slot and pages are freed and its result
has ``finish_reason = "cancelled"``.

Stop rules (identical with and without speculation, so greedy outputs are comparable token for
token): a sequence ends after an EOS / stop token (kept in ``token_ids``), after ``max_new_tokens``
tokens, or when its next round would not fit ``max_context`` (reason "length").

``prefill_wait`` (default 0: every step prefills what it admitted) lets the prompts admitted while
other rows decode gather for up to that many steps into one prefill forward: an eager prefill of a
few tokens costs as much launch overhead as one of many, so a regeneration at high concurrency (a
request or two admitted per step) spends far less host time per step. A prompt waits only while rows
are decoding and the waiting chunks do not fill a forward (``prefill_tokens``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from torchspec.runtime.paged_kv import TRASH_PAGE, PageAllocator
from torchspec.runtime.prefix_cache import PrefixCache
from torchspec.runtime.sampling import SamplingParams


@dataclass
class GenerationResult:
    prompt_len: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" | "length" | "cancelled"
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per decode round
    text: str | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0  # wall time of the rounds this sequence took part in
    request_id: int = -1
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def mean_acceptance(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    def to_dict(self) -> dict:
        return {"prompt_len": self.prompt_len, "token_ids": self.token_ids, "text": self.text,
                "finish_reason": self.finish_reason, "accept_lengths": self.accept_lengths,
                "mean_acceptance": self.mean_acceptance, "prefill_s": self.prefill_s, "decode_s": self.decode_s}


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: frozenset[int]
    result: GenerationResult
    cancelled: bool = False


@dataclass
class Slot:
    request: Request
    pages: list[int] = field(default_factory=list)
    ctx: int = 0  # tokens in the KV cache (cached prefix + prefilled chunks, then committed tokens)
    admitted: int = 0  # the scheduler step it was admitted at (``prefill_wait``)
    shared: int = 0  # leading pages held in the prefix cache
    parent: int = 0  # prefix-cache entry of page shared - 1 (the chain's root before any)
    caching: bool = False  # this slot still offers its prompt pages to the prefix cache

    @property
    def prefilling(self) -> bool:
        return self.ctx < len(self.request.prompt)

    @property
    def finished(self) -> bool:
        return bool(self.request.result.finish_reason)


class Scheduler:
    """The queue, the slots and their pages (see the module docstring). ``block_table`` [slots, P]
    is the device tensor the steps read; the scheduler writes a slot's row when its pages change."""

    def __init__(self, num_slots: int, page_size: int, block_table: torch.Tensor, allocator: PageAllocator,
                 prefix_cache: PrefixCache | None, prefill_tokens: int, prefill_wait: int = 0):
        self.page_size, self.block_table, self.allocator = page_size, block_table, allocator
        self.prefix_cache, self.prefill_tokens, self.prefill_wait = prefix_cache, prefill_tokens, prefill_wait
        self._table_writes: dict[int, dict[int, int]] = {}  # row -> column -> page, not yet on the device
        self.steps = 0  # scheduling points so far (``admit`` calls): the clock of ``prefill_wait``
        self.slots: list[Slot | None] = [None] * num_slots
        self.concurrency = num_slots
        self.cache_root = 0  # prefix-cache namespace (``prefix_cache.WITH_DRAFTER`` / ``TARGET_ONLY``)
        self.waiting: deque[Request] = deque()
        self.done: list[GenerationResult] = []  # finished outside a slot, returned by the next drain
        self._live: dict[int, Request] = {}  # waiting or running
        self._next_id = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.done or any(s is not None for s in self.slots))

    def submit(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, stop: frozenset[int]) -> int:
        rid = self._next_id
        self._next_id += 1
        req = Request(rid, list(prompt), max_new_tokens, sampling, stop,
                      GenerationResult(prompt_len=len(prompt), request_id=rid))
        if max_new_tokens == 0:
            req.result.finish_reason = "length"
            self.done.append(req.result)
        else:
            self._live[rid] = req
            self.waiting.append(req)
        return rid

    def cancel(self, rid: int) -> bool:
        if not 0 <= rid < self._next_id:
            raise ValueError(f"cancel: no request has id {rid} (ids issued so far: 0..{self._next_id - 1}).")
        req = self._live.get(rid)
        if req is None or req.cancelled:
            return False  # finished (or cancelled) already
        req.cancelled = True
        if req in self.waiting:
            self.waiting.remove(req)
            self._finish(req, "cancelled")
            self.done.append(req.result)
        return True

    def _finish(self, req: Request, reason: str) -> None:
        if not req.result.finish_reason:
            req.result.finish_reason = reason
        self._live.pop(req.id, None)

    # --- scheduling points ------------------------------------------------------------------------

    def drain(self) -> list[GenerationResult]:
        """Free the slots of cancelled requests; return them with everything else finished since."""
        for i, s in enumerate(self.slots):
            if s is not None and s.request.cancelled:
                s.request.result.finish_reason = "cancelled"
                self.done.append(s.request.result)
                self._release(i)
        out, self.done = self.done, []
        return out

    def retire(self) -> list[GenerationResult]:
        """Free the slots of finished sequences and return their results."""
        out = []
        for i, s in enumerate(self.slots):
            if s is not None and s.finished:
                out.append(s.request.result)
                self._release(i)
        return out

    def admit(self) -> None:
        """Fill free slots from the queue; each takes its prompt's longest cached prefix."""
        self.steps += 1
        for i in range(self.concurrency):
            if not self.waiting:
                return
            if self.slots[i] is not None:
                continue
            req = self.waiting.popleft()
            slot = Slot(req, parent=self.cache_root, caching=self.prefix_cache is not None, admitted=self.steps)
            if self.prefix_cache is not None:
                slot.pages, slot.parent = self.prefix_cache.match(req.prompt, self.cache_root)
                slot.shared = len(slot.pages)
                slot.ctx = slot.shared * self.page_size
                req.result.cached_tokens = slot.ctx
                self._write_table(i, 0, slot.pages)
            self.slots[i] = slot

    def plan_prefill(self) -> list[tuple[int, int]]:
        """The next prefill forward: [(slot, chunk length)], oldest requests first, at most
        ``prefill_tokens`` tokens once every chunk is padded to the longest; [] while the chunks wait
        (``prefill_wait``, module docstring)."""
        budget, plan, width = self.prefill_tokens, [], 0
        order = sorted((s.request.id, i) for i, s in enumerate(self.slots)
                       if s is not None and s.ctx < len(s.request.prompt))  # prefilling (no property: hot)
        if order and self.prefill_wait > 0 and not self._prefill_due([i for _, i in order]):
            return []
        for _, i in order:
            s = self.slots[i]
            left = len(s.request.prompt) - s.ctx
            n = min(left, budget)
            if (len(plan) + 1) * max(width, n) > budget:  # join at the current width, or not at all
                n = min(left, width)
                if (len(plan) + 1) * width > budget:
                    break
            plan.append((i, n))
            width = max(width, n)
        return plan

    def _prefill_due(self, pending: list[int]) -> bool:
        """Whether the prefilling slots ``pending`` go now: nothing decodes meanwhile, one has waited
        ``prefill_wait`` steps, or together they fill a forward."""
        slots = self.slots
        if not any(s is not None and not s.prefilling and not s.finished for s in slots):
            return True
        if self.steps - min(slots[i].admitted for i in pending) >= self.prefill_wait:
            return True
        return sum(len(slots[i].request.prompt) - slots[i].ctx for i in pending) >= self.prefill_tokens

    def prefilled(self, i: int, n: int) -> None:
        """Slot i's chunk of n tokens is written: offer its completed prompt pages to the prefix cache."""
        s = self.slots[i]
        s.ctx += n
        cache = self.prefix_cache
        if cache is None or not s.caching:
            return
        for k in range(s.shared, min(s.ctx // self.page_size, cache.shareable(len(s.request.prompt)))):
            entry = cache.insert(s.parent, s.request.prompt, k, s.pages[k])
            if entry is None:  # the same page was cached meanwhile by another slot: stop the chain here
                s.caching = False
                return
            s.shared, s.parent = k + 1, entry

    def finish_out_of_context(self, rows: list[int], per_round: int, max_context: int) -> list[int]:
        """Rows whose next round (up to ``per_round`` KV positions) would not fit end with "length";
        returns the others."""
        keep = []
        for i in rows:
            s = self.slots[i]
            if s.ctx + per_round >= max_context:
                self._finish(s.request, "length")
            else:
                keep.append(i)
        return keep

    def commit(self, i: int, tokens: list[int]) -> int:
        """Append a step's committed tokens to slot i's result, applying the stop rules; returns how
        many were kept (fewer than given when a stop token or the token limit ends the request)."""
        req = self.slots[i].request
        res = req.result
        if len(res.token_ids) + len(tokens) < req.max_new_tokens and req.stop.isdisjoint(tokens):
            res.token_ids.extend(tokens)  # the common case: no rule ends the request in this round
            return len(tokens)
        for n, tok in enumerate(tokens, start=1):
            res.token_ids.append(tok)
            if tok in req.stop:
                self._finish(req, "stop")
                return n
            if len(res.token_ids) >= req.max_new_tokens:
                self._finish(req, "length")
                return n
        return len(tokens)

    def abort(self) -> None:
        """Drop every request (after an error inside a step): all pages come back."""
        for i, s in enumerate(self.slots):
            if s is not None:
                self._release(i)
        for req in self.waiting:
            self._finish(req, "cancelled")
        self.waiting.clear()
        self.done = []
        self._live.clear()

    # --- pages ------------------------------------------------------------------------------------

    def ensure_pages(self, i: int, length: int) -> None:
        """Slot i's block table covers positions 0 .. length - 1 (on the device after ``flush_table``)."""
        s = self.slots[i]
        need = -(-length // self.page_size) - len(s.pages)
        if need > 0:
            new = self.allocator.alloc(need)
            self._write_table(i, len(s.pages), new)
            s.pages.extend(new)

    def _write_table(self, i: int, start: int, pages: list[int]) -> None:
        if pages:
            row = self._table_writes.setdefault(i, {})
            for col, page in enumerate(pages, start=start):
                row[col] = page

    def flush_table(self) -> None:
        """Apply the block-table entries written since the last flush to the device table: one
        asynchronous host-to-device copy and one scatter (the engine calls it before each forward)."""
        if not self._table_writes:
            return
        rows, cols, pages = [], [], []
        for i, row in self._table_writes.items():
            rows.extend([i] * len(row))
            cols.extend(row)
            pages.extend(row.values())
        self._table_writes = {}
        n = len(rows)
        packed = host_to_device(rows + cols + pages, torch.long, self.block_table.device)
        self.block_table[packed[:n], packed[n:2 * n]] = packed[2 * n:]  # (row, column) pairs are unique

    def _release(self, i: int) -> None:
        s = self.slots[i]
        if self.prefix_cache is not None:
            self.prefix_cache.release(s.pages[: s.shared])
        self.allocator.free(s.pages[s.shared:])
        self._table_writes.pop(i, None)  # never flushed: the fill below supersedes them
        self.block_table[i] = TRASH_PAGE  # a fill on the device, in stream order before any later write
        self._finish(s.request, "cancelled")  # no-op unless it had no reason yet
        self.slots[i] = None


def host_to_device(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on ``device`` without a host sync. On CUDA it is staged
    in pinned memory and copied asynchronously (a pageable copy waits for the whole stream); the
    caching host allocator keeps the staging buffer until the copy has run."""
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype)
    if isinstance(values, torch.Tensor):
        staged = values.to(dtype).pin_memory()
    else:
        staged = torch.tensor(values, dtype=dtype, pin_memory=True)
    return staged.to(device, non_blocking=True)


__all__ = ["GenerationResult", "Request", "Scheduler", "Slot", "host_to_device"]
