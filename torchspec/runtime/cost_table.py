"""The measured cost table of one serving setup: what a draft depth and a verify forward cost, in ms.

The draft controller weighs the gain of one more draft depth, and of verifying more nodes, against
what they cost on THIS hardware. ``torchspec-profile`` (``recipes/profile_costs.py``, measuring with
``cost_profile.py``) writes the table once per setup; the runtime loads it with the key of the
setup it serves and refuses a table measured for another one.

**Key** (``CostKey``): the device name (``torch.cuda.get_device_name``, or ``"cpu"``), the TP
degree, the target's weights fingerprint (``export.serving.weights_fingerprint``, the one a drafter
export is checked against), the drafter's identity (``drafter_identity``: its model type and a hash
of its architecture flags -- a retrained drafter of the same architecture costs the same, so it
keeps its table) and the serving dtype.

**Layout** (JSON, ``"version": 2``; times in ms, each the median of ``meta.repeats`` runs)::

    {"version": 2,
     "key": {"device": "NVIDIA H200", "tp": 1, "target": "9c1d5e0a7b3f2e11",
             "drafter": "torchspec_eagle4:5a0c81d2e4f6a7b9", "dtype": "bfloat16"},
     "widths": [1, 2, 4, 8],                     frontier nodes a row of one draft depth
     "nodes": [0, 1, 2, 4, 8, 16, 32, 48, 64],   drafted nodes a row verified (0 = a plain step)
     "batches": [1, 8, 64],                      padded batch sizes
     "contexts": [512, 2048, 8192],              committed tokens a row
     "depth_ms":  [context][batch][width],
     "verify_ms": [context][batch][node],
     "round_ms":  [context][batch],             a whole round that verifies nothing (below)
     "overhead_ms": [batch],                     the host's time a round outside the timed forwards (below)
     "round_extra_ms": [batch],                  what a served speculating round adds to a plain one (below)
     "meta": {"timing": "graph", "repeats": 20, ...}}  (timing: "graph" | "eager", cost_profile.py)

``round_ms`` is a whole controlled round of width 0 -- depth 0's candidates, the controller's decision,
the verify forward of the root alone, acceptance and the drafter's catch-up -- so ``round_ms -
verify_ms[0]`` is what any speculating round pays beyond its verify forward and its later depths (the
controller's depth-0 cost; version 1 had no such column and charged a width-1 depth for it, a third of
what a round really adds on an H200, so version 1 files are refused: re-profile).

``overhead_ms`` is what every decode round costs besides its forwards: the engine's bookkeeping, the round's
inputs and launches, the sync, while the GPU idles (measured as the wall time of a plain decode round less
the timed plain step; 0.3-0.6 ms on an H200 host). Plain and speculating rounds pay it alike, so it is part of
every verify cost the controller weighs (``RoundCosts.lookup``): without it a deeper round, which spreads it
over more tokens, looks dearer than it is. Optional (tables written before it read as 0).

``round_extra_ms`` is depth 0's cost as served: the wall time of a fixed depth-1 round (top-k candidates, one
node verified) less a plain round's, less the verify forward's own difference (``verify_ms[1] - verify_ms[0]``),
both decoded through the engine at the first context bucket. ``round_ms - verify_ms[0]`` times the same work
as graphs replayed alone, the controller's decision included; on an H100 (thirty-sixth session) that was 0.35 ms
at batch 1 and 0.42 ms at 64 where served rounds added 0.15 and 0.22 ms. Every speculating round pays depth 0,
so an inflated one makes later depths look cheap against the whole round (at batch 64 it priced a second chain
depth at +10.0% of a round where served rounds pay +13.6%). When present, depth 0 is priced at
``round_ms - verify_ms[0]`` shifted by this less that difference at the first context bucket (so longer
contexts keep their measured growth, ``spec_extra_ms``). Optional (tables without it price depth 0 as before).

``chain_from_batch`` (optional, an int or null) is the padded batch from which the controller drafts a chain
(k = 1) instead of the tree: at high concurrency a tree's k-wide depths and wide verifies cost more than its
extra acceptance earns. It depends on the drafter's quality as well as on the hardware, so it is not derived
from the times: ``tools/bench_controller.py`` measures it for a drafter (its ``chain_from_batch``, the
concurrency from which the chain controller is at least as fast as the tree controller) and
``torchspec-profile --chain-from-batch N`` records it. The engine uses it unless ``configure`` is given one.

**Lookups** for a round at (batch, ctx): ``depth_ms`` -> [len(widths)], ``verify_ms`` ->
[N_max + 1] indexed by node count 0..N_max, ``round_ms`` -> a 0-d time. Between measured batches, context
buckets and node counts the times are interpolated linearly. A batch above the last measured one is a
ValueError; one below the first reads as the first, with a warning once per table and batch (a table
measured at batches 8 and 64 prices a lone row's 32-node verify at batch 8's, ~40% dear on an H200: 1.56 against
1.12 ms in the seventeenth session's table; the controller then verifies 16 nodes where 32 pay; re-profile with
``--batches`` from 1). (Until the thirty-first session a batch was rounded UP to the next measured one: with the
default ``1,8,64``, serving 16 rows priced every round as 64 rows'.) A context outside the measured buckets is CLAMPED to the nearest
one (a longer context than the last bucket reads as the last bucket: re-profile with a larger bucket for
long-context serving).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from torchspec.io import atomic_write_bytes, atomic_write_text

log = logging.getLogger(__name__)
_WARNED: set[tuple] = set()  # (table key, batch): lookups below a table's first batch, warned once

TABLE_VERSION = 2
TABLE_KEYS = ("version", "key", "widths", "nodes", "batches", "contexts", "depth_ms", "verify_ms", "round_ms", "meta")
OPTIONAL_KEYS = ("overhead_ms", "round_extra_ms", "chain_from_batch")


@dataclass(frozen=True)
class CostKey:
    """The setup a table was measured on; a table serves only an equal key."""

    device: str  # torch.cuda.get_device_name(), or "cpu"
    tp: int
    target: str  # the target's weights fingerprint
    drafter: str  # drafter_identity(config)
    dtype: str  # "bfloat16", "float32", ...

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def drafter_identity(config) -> str:
    """``model_type:hash`` of a drafter config's architecture flags (``ARCH_FIELDS``): equal for the
    export's config.json and the loaded drafter, unchanged by further training."""
    flags = {name: getattr(config, name) for name in sorted(config.ARCH_FIELDS)}
    digest = hashlib.sha256(json.dumps(flags, sort_keys=True, default=str).encode()).hexdigest()
    return f"{config.model_type}:{digest[:16]}"


def cost_key(decoder, runner) -> CostKey:
    """The key of a serving setup: a ``TargetDecoder`` and the ``DrafterRunner`` drafting for it."""
    from torchspec.runtime.loading import decoder_identity

    weight = decoder.embed_tokens_weight
    return CostKey(device=device_name(weight.device), tp=int(decoder.tp_size),
                   target=decoder_identity(decoder)["fingerprint"], drafter=drafter_identity(runner.config),
                   dtype=str(weight.dtype).removeprefix("torch."))


@dataclass
class CostTable:
    """The measured times of one setup (layout and lookup rules: module docstring); validated on
    construction, so a loaded table is complete."""

    key: CostKey
    widths: list[int]  # ascending, >= 1
    nodes: list[int]  # ascending, from 0 (a plain step)
    batches: list[int]  # ascending padded batch sizes
    contexts: list[int]  # ascending context buckets
    depth: torch.Tensor  # [C, B, W] ms, float64
    verify: torch.Tensor  # [C, B, N] ms, float64
    round: torch.Tensor  # [C, B] ms, float64: a whole width-0 round (module docstring)
    meta: dict
    overhead: torch.Tensor | None = None  # [B] ms, float64: the host's time a round (module docstring); None: 0
    round_extra: torch.Tensor | None = None  # [B] ms, float64: depth 0 as served (module docstring); None: unknown
    chain_from_batch: int | None = None  # greedy rounds draft a chain from this many rows on (module docstring)

    def __post_init__(self) -> None:
        for name, low in (("widths", 1), ("nodes", 0), ("batches", 1), ("contexts", 1)):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < low for v in values) or values != sorted(set(values)):
                raise ValueError(f"cost table {name}={values} must be strictly ascending ints >= {low}.")
        if self.nodes[0] != 0:
            raise ValueError(f"cost table nodes={self.nodes} must start at 0 (the plain step).")
        self.depth = torch.as_tensor(self.depth, dtype=torch.float64)
        self.verify = torch.as_tensor(self.verify, dtype=torch.float64)
        self.round = torch.as_tensor(self.round, dtype=torch.float64)
        for name, axis, times in (("depth_ms", "widths", self.depth), ("verify_ms", "nodes", self.verify),
                                  ("round_ms", None, self.round)):
            shape = [len(self.contexts), len(self.batches)] + ([len(getattr(self, axis))] if axis else [])
            if list(times.shape) != shape:
                raise ValueError(f"cost table {name} has shape {list(times.shape)}; [contexts, batches"
                                 f"{', ' + axis if axis else ''}] is {shape}.")
            if not bool(torch.isfinite(times).all() and (times > 0).all()):
                raise ValueError(f"cost table {name} holds a time that is not a positive number.")
        self.overhead = torch.zeros(len(self.batches), dtype=torch.float64) if self.overhead is None else \
            torch.as_tensor(self.overhead, dtype=torch.float64)
        if list(self.overhead.shape) != [len(self.batches)] or not bool(
                torch.isfinite(self.overhead).all() and (self.overhead >= 0).all()):
            raise ValueError(f"cost table overhead_ms={self.overhead.tolist()} must hold one time >= 0 a batch "
                             f"{self.batches}.")
        if self.round_extra is not None:
            self.round_extra = torch.as_tensor(self.round_extra, dtype=torch.float64)
            if list(self.round_extra.shape) != [len(self.batches)] or not bool(
                    torch.isfinite(self.round_extra).all() and (self.round_extra >= 0).all()):
                raise ValueError(f"cost table round_extra_ms={self.round_extra.tolist()} must hold one time >= 0 a "
                                 f"batch {self.batches}, or be left out.")
        if self.chain_from_batch is not None and (not isinstance(self.chain_from_batch, int)
                                                  or isinstance(self.chain_from_batch, bool) or self.chain_from_batch < 1):
            raise ValueError(f"cost table chain_from_batch={self.chain_from_batch!r} must be an int >= 1 or null (the "
                             f"tree at every batch).")

    # --- lookups --------------------------------------------------------------------------------

    def depth_ms(self, batch: int, ctx: int) -> torch.Tensor:
        """[len(widths)] fp32 ms of one draft depth at each frontier width, for ``batch`` rows of
        ``ctx`` committed tokens (rules: module docstring)."""
        return self._at(self.depth, batch, ctx).float()

    def verify_ms(self, batch: int, ctx: int) -> torch.Tensor:
        """[N_max + 1] fp32 ms of the verify forward over n = 0..N_max drafted nodes a row (n = 0:
        a plain decode step), interpolated between the measured node counts."""
        return _lerp(self.nodes, self._at(self.verify, batch, ctx), range(self.nodes[-1] + 1)).float()

    def round_ms(self, batch: int, ctx: int) -> torch.Tensor:
        """0-d fp32 ms of a whole width-0 round (module docstring) for ``batch`` rows of ``ctx`` tokens."""
        return self._at(self.round, batch, ctx).float()

    def spec_extra_ms(self, batch: int, ctx: int) -> torch.Tensor:
        """0-d fp32 ms that depth 0 adds to a round at (batch, ctx), beyond its verify forward (at least a
        microsecond): the width-0 round less its plain step, shifted to the served ``round_extra_ms`` where the
        table has it (module docstring)."""
        extra = self.round_ms(batch, ctx) - self.verify_ms(batch, ctx)[0]
        if self.round_extra is not None:
            first = self.contexts[0]
            served = float(_lerp(self.batches, self.round_extra, [self._batch(batch)])[0])
            extra = extra + (served - (self.round_ms(batch, first) - self.verify_ms(batch, first)[0]))
        return extra.clamp(min=1e-3)

    def overhead_ms(self, batch: int) -> float:
        """The host's time a decode round (module docstring) at ``batch`` rows (interpolated)."""
        return float(_lerp(self.batches, self.overhead, [self._batch(batch)])[0])

    def _at(self, times: torch.Tensor, batch: int, ctx: int) -> torch.Tensor:
        """``times`` [C, B, ...] at (batch, ctx): interpolated over batches, then over contexts -> [...]."""
        by_batch = _lerp(self.batches, times.transpose(0, 1), [self._batch(batch)])[0]  # [C, ...]
        return _lerp(self.contexts, by_batch, [float(self.clamp_context(ctx))])[0]

    def _batch(self, batch: int) -> float:
        """``batch`` as a point on the measured batches: refused above the last, the first below it (warned)."""
        if batch < 1 or batch > self.batches[-1]:
            raise ValueError(f"batch={batch} is outside the cost table's padded batches {self.batches}; "
                             f"re-run torchspec-profile with --batches covering it.")
        if batch < self.batches[0] and (self.key, batch) not in _WARNED:
            _WARNED.add((self.key, batch))
            log.warning("cost table (%s) has no batch %d: its rounds are priced at batch %d's costs (its batches: %s); "
                        "re-run torchspec-profile with --batches from %d.", self.key.device, batch, self.batches[0],
                        self.batches, batch)
        return float(max(batch, self.batches[0]))

    def clamp_context(self, ctx: int) -> int:
        """``ctx`` committed tokens as a point on the measured contexts: clamped to the first and the last (module
        docstring), so every context beyond them costs what they cost."""
        if ctx < 0:
            raise ValueError(f"ctx={ctx} committed tokens must be >= 0.")
        return min(max(ctx, self.contexts[0]), self.contexts[-1])

    # --- files ----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"version": TABLE_VERSION, "key": asdict(self.key), "widths": self.widths, "nodes": self.nodes,
                "batches": self.batches, "contexts": self.contexts, "depth_ms": _rounded(self.depth),
                "verify_ms": _rounded(self.verify), "round_ms": _rounded(self.round[None])[0],
                "overhead_ms": [round(float(t), 4) for t in self.overhead],
                "round_extra_ms": None if self.round_extra is None else [round(float(t), 4) for t in self.round_extra],
                "chain_from_batch": self.chain_from_batch,
                "meta": self.meta}

    @classmethod
    def from_dict(cls, data: dict, source: str = "cost table") -> CostTable:
        """A table from its JSON object; a wrong version, a missing or unknown key, or a bad shape
        is a ValueError naming ``source`` and the field."""
        if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
            got = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{source}: version {got!r}, this torchspec reads version {TABLE_VERSION}; "
                             f"re-run torchspec-profile to measure it again.")
        for what, keys, want in (("keys", set(data) - set(OPTIONAL_KEYS), TABLE_KEYS),
                                 ("key fields", set(data.get("key") or {}), [f.name for f in fields(CostKey)])):
            if keys != set(want):
                raise ValueError(f"{source}: {what} {sorted(keys)} differ from {sorted(want)} (missing "
                                 f"{sorted(set(want) - keys)}, unknown {sorted(keys - set(want))}).")
        try:
            return cls(key=CostKey(**data["key"]), widths=data["widths"], nodes=data["nodes"],
                       batches=data["batches"], contexts=data["contexts"], depth=data["depth_ms"],
                       verify=data["verify_ms"], round=data["round_ms"], meta=dict(data["meta"]),
                       overhead=data.get("overhead_ms"), round_extra=data.get("round_extra_ms"),
                       chain_from_batch=data.get("chain_from_batch"))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source}: {' '.join(str(err).split())}") from err

    @classmethod
    def load(cls, path: str | Path, expected_key: CostKey | None) -> CostTable:
        """Read a table; refuse it unless its key equals ``expected_key`` (None: no check, for
        inspecting or plotting a table)."""
        from torchspec.cli import read_json

        table = cls.from_dict(read_json(path, "re-run torchspec-profile to write it."), source=f"cost table {path}")
        if expected_key is not None and table.key != expected_key:
            differ = [f.name for f in fields(CostKey) if getattr(table.key, f.name) != getattr(expected_key, f.name)]
            raise ValueError(
                f"cost table {path} was measured for {table.key.describe()} but this setup is "
                f"{expected_key.describe()} (differ: {', '.join(differ)}); re-profile this setup: torchspec-profile "
                f"--target TARGET --drafter DRAFTER --tp {expected_key.tp} --dtype {expected_key.dtype} --out {path} "
                f"on this machine.")
        return table

    def save(self, path: str | Path) -> None:
        """Write the table atomically (an existing file is replaced only by a complete new one)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, _compact_json(self.to_dict()) + "\n")


def _lerp(xs: list[int], ys: torch.Tensor, at) -> torch.Tensor:
    """ys [len(xs), ...] piecewise-linear at the points ``at`` (each in [xs[0], xs[-1]]) -> [len(at), ...]."""
    at = torch.as_tensor(list(at), dtype=torch.float64)
    if len(xs) == 1:
        return ys[0].expand(len(at), *ys.shape[1:])
    grid = torch.tensor(xs, dtype=torch.float64)
    i = (torch.searchsorted(grid, at, right=True) - 1).clamp(0, len(xs) - 2)  # the segment of each point
    t = ((at - grid[i]) / (grid[i + 1] - grid[i])).view(-1, *[1] * (ys.dim() - 1))
    return ys[i] + t * (ys[i + 1] - ys[i])


def _rounded(times: torch.Tensor) -> list:
    """Nested lists of 4 significant digits: a tenth of a microsecond for the fastest GPU depth."""
    return [[[float(f"{v:.4g}") for v in row] for row in batch] for batch in times.tolist()]


def _compact_json(data: dict) -> str:
    """Indented JSON with every innermost list of numbers on one line (a row of times reads across)."""
    text = json.dumps(data, indent=1)
    return re.sub(r"\[[-\d.,\seE+]*\]", lambda m: re.sub(r"\s+", " ", m.group(0)).replace("[ ", "[").replace(" ]", "]"),
                  text)


def plot_costs(table: CostTable, path: str | Path) -> None:
    """A PNG of the table: one draft depth against frontier width, the verify forward against the
    verified node count; a colour per padded batch, a line style per context bucket (log-scale ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax_depth, ax_verify) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ["-", "--", ":", "-."]
    colours = plt.get_cmap("viridis")
    for c, ctx in enumerate(table.contexts):
        for b, batch in enumerate(table.batches):
            colour = colours(b / max(1, len(table.batches) - 1))
            label = f"b={batch} ctx={ctx}"
            style = styles[c % len(styles)]
            ax_depth.plot(table.widths, table.depth[c, b].tolist(), style, marker="o", color=colour, label=label)
            ax_verify.plot(table.nodes, table.verify[c, b].tolist(), style, marker="o", color=colour, label=label)
            ax_verify.plot([0], [float(table.round[c, b])], marker="x", markersize=10, color=colour)  # whole round
    ax_depth.set(xlabel="frontier width (nodes a row)", title="one draft depth")
    ax_verify.set(xlabel="verified drafted nodes a row (0 = plain step)",
                  title="target verify forward (x: a whole round verifying nothing)")
    for ax in (ax_depth, ax_verify):
        ax.set(ylabel="ms", yscale="log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax_verify.legend(fontsize=7, ncol=max(1, math.ceil(len(table.contexts) * len(table.batches) / 6)))
    k = table.key
    fig.suptitle(f"{k.device}, tp {k.tp}, {k.dtype}, target {k.target}, drafter {k.drafter} "
                 f"({table.meta.get('timing', '?')} timing); host ms a round "
                 + ", ".join(f"b={b}: {t:.2f}" for b, t in zip(table.batches, table.overhead.tolist()))
                 + ("" if table.round_extra is None else "; depth 0 as served " + ", ".join(
                     f"b={b}: {t:.2f}" for b, t in zip(table.batches, table.round_extra.tolist()))), fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())


__all__ = ["TABLE_VERSION", "CostKey", "CostTable", "cost_key", "device_name", "drafter_identity", "plot_costs"]
