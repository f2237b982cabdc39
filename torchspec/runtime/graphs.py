"""CUDA graphs for whole engine steps: one graph per (step kind, batch size, spec, sampling).

A plain decode step and a full speculation round (draft tree, verify forward, accept, compact,
drafter catch-up) are static in shape and never sync with the host, so each is captured once and
replayed every round: the host copies a handful of per-row tensors (root token, drafter state,
committed length, block table, row validity) into the graph's static inputs, replays, and reads
the static outputs. This removes the per-kernel launch cost that dominates decoding of small and
mid-size targets.

Capturing runs the step twice first (warm-up on a side stream, as torch requires). That is safe
on live caches: a step only writes KV positions >= each row's committed length, which the real
replay rewrites. A step whose effects are not idempotent (a hybrid target commits recurrent state)
passes ``capture_inputs``: the warm-ups run on inputs that make it a no-op (every row invalid), and
the first real call is the first replay. Random draws inside a graph come from the default CUDA generator (graph-safe:
each replay advances its offset), seeded by the engine per ``generate`` call. A step that cannot
be captured (e.g. an op that syncs) falls back to eager execution, once, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields, is_dataclass

import torch

log = logging.getLogger(__name__)


def _clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if is_dataclass(x):
        return type(x)(**{f.name: _clone_tree(getattr(x, f.name)) for f in fields(x)})
    return x


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif is_dataclass(dst):
        for f in fields(dst):
            _copy_into(getattr(dst, f.name), getattr(src, f.name))


def _sources(x) -> tuple:
    """The tensors of an input (a tensor, or a dataclass of them), each with its version counter: equal
    sources (the same tensor objects, none written since) hold equal values."""
    if isinstance(x, torch.Tensor):
        return ((x, x._version),)
    if is_dataclass(x):
        return tuple(s for f in fields(x) for s in _sources(getattr(x, f.name)))
    return ()


def _same_sources(a: tuple | None, b: tuple) -> bool:
    return a is not None and len(a) == len(b) and all(t is u and v == w for (t, v), (u, w) in zip(a, b))


class StepGraphs:
    """Cache of captured steps keyed by the caller; ``run(key, fn, inputs)`` replays or captures."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self._graphs: dict = {}
        self._failed: set = set()
        self._pool = None
        self._copied: dict = {}  # (key, input name) -> the sources last copied into a steady input

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def failed(self) -> frozenset:
        """The keys whose capture failed (each runs eagerly: slower by its launches, and worth a bug report)."""
        return frozenset(self._failed)

    def run(self, key, fn: Callable, inputs: dict, capture_inputs: Callable[[dict], dict] | None = None,
            steady: frozenset[str] = frozenset()):
        """fn(**inputs) through a CUDA graph captured for ``key`` (inputs: tensors or dataclasses of
        tensors with the same shapes on every call for that key). ``capture_inputs(inputs)``, if
        given, is what the capture's warm-up runs see instead (module docstring). ``steady`` names
        inputs the step only reads: one is copied into the graph only when its tensors are other
        objects than last time, or were written since (a controller's cost rows: the same kept
        tensors round after round, whose copies were ~2 launches and ~20 us of host time a round)."""
        entry = self._graphs.get(key) or self.capture(key, fn, inputs, capture_inputs)
        if entry is None:
            return fn(**inputs)
        graph, static_in, static_out = entry
        for name, value in inputs.items():
            if name in steady:
                sources = _sources(value)
                if _same_sources(self._copied.get((key, name)), sources):
                    continue
                self._copied[key, name] = sources
            _copy_into(static_in[name], value)
        graph.replay()
        return static_out

    def __contains__(self, key) -> bool:
        return key in self._graphs or key in self._failed

    def capture(self, key, fn: Callable, inputs: dict, capture_inputs: Callable[[dict], dict] | None = None):
        """Capture ``key``'s graph now, without replaying it (a draft controller's rounds are captured ahead of
        the rounds that run them) -> its entry, or None where it cannot be captured (it then runs eagerly);
        one already captured is kept."""
        if key in self._failed:
            return None
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(fn, capture_inputs(inputs) if capture_inputs is not None else inputs)
            except Exception as e:  # noqa: BLE001 - any capture failure means: run this step eagerly
                log.warning("CUDA graph capture failed for %s (%s: %s); running it eagerly.", key,
                            type(e).__name__, e)
                self._failed.add(key)
                torch.cuda.synchronize()
                return None
            self._graphs[key] = entry
        return entry

    def _capture(self, fn: Callable, inputs: dict):
        static_in = {name: _clone_tree(value) for name, value in inputs.items()}
        rng_state = torch.cuda.get_rng_state()  # warm-up draws must not shift the seeded stream
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                fn(**static_in)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_out = fn(**static_in)
        torch.cuda.set_rng_state(rng_state)
        return graph, static_in, static_out
