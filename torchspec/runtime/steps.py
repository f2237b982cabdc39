"""The batched steps of the engine: prefill, plain decode, drafter catch-up and a speculation round.

Every function works on the active rows of a batch, with static shapes, and never syncs with the
host; the engine (``torchspec/runtime/engine.py``) does the per-sequence bookkeeping once per
round. Conventions (per row): ``ctx`` = tokens in the target's KV cache = committed drafter
positions; ``root`` = the last committed token, not yet in the cache.

A round (``speculate``):
    1. draft a tree rooted at ``root`` (``torchspec/runtime/drafting.py``);
    2. verify it in ONE target forward: node i is written at logical position ctx + i, RoPE
       position ctx + depth(i), attending the committed prefix and its own ancestors;
    3. accept a path (greedy or tree rejection sampling, ``torchspec/runtime/verify.py``) and
       compact it to the front: the K/V of path node i moves to position ctx + i, so rejected
       nodes leave no trace (positions >= the new ctx are never attended again);
    4. catch the drafter up: step-0 entries for the a + 1 new committed positions, fed the target
       states the verify forward captured on the accepted path.

Hybrid targets (Gated DeltaNet layers) also keep a recurrent state per slot (``caches.recurrent``,
``torchspec/runtime/recurrent_state.py``): prefill and plain decode commit it as they run; in a
round every tree node continues from its parent's state and, after step 3, only the state of the
accepted path's last node ``path[b, num_accepted[b]]`` is committed (rejected nodes leave no trace
there either). ``slots`` [B] names each row's state slot (default: row b is slot b).

Sampling settings are one ``SamplingParams`` for every row or a ``RowSampling`` (per-row values);
either way a step's shapes depend only on whether every row is greedy (``params.greedy``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchspec.attend import in_window
from torchspec.runtime.controlled_drafting import PLAIN_ROUND
from torchspec.runtime.controlled_rounds import draft_ahead_tree, draft_controlled_tree
from torchspec.runtime.drafter_runner import DrafterRunner
from torchspec.runtime.drafting import DraftInputs, SpecConfig, draft_round
from torchspec.runtime.paged_kv import (
    AttentionMeta,
    PagedAttend,
    PagedKVCache,
    build_attention_meta,
    slots_for_positions,
)
from torchspec.runtime.pending_drafter import PendingDrafter, catch_up_pending
from torchspec.runtime.recurrent_state import (
    HybridAttend,
    RecurrentState,
    RecurrentStep,
    build_recurrent_meta,
    tree_level_widths,
)
from torchspec.runtime.round_costs import RoundCosts
from torchspec.runtime.sampled_depth import next_depth_after_sampled
from torchspec.runtime.sampling import RowSampling, SamplingParams, process_logits, sample
from torchspec.runtime.tree import DraftTree
from torchspec.runtime.verify import verify_greedy, verify_sampling
from torchspec.targets import TargetDecoder
from torchspec.targets.fused_ops import fused


@dataclass
class Caches:
    target: PagedKVCache
    drafter: PagedKVCache | None
    page_size: int
    recurrent: RecurrentState | None = None  # hybrid targets: per-slot conv / delta-rule state
    pending: PendingDrafter | None = None  # drafter entries deferred by the controller's plain rounds


@dataclass
class StepOut:
    """What a step commits per row: ``tokens[b, :count[b]]`` (host-synced by the engine)."""

    tokens: torch.Tensor  # [B, W]
    count: torch.Tensor  # [B]
    root: torch.Tensor  # [B] new last committed token
    normed: torch.Tensor | None = None  # [B, H] drafter state at the new last position
    feedback: torch.Tensor | None = None
    plan: torch.Tensor | None = None  # [2 or 4] int64: the draft controller's next round (depth, width; a probe's), synced
    # [B (+1 with a plan), 1 + W] int64: count, tokens, then the plan's row -- the round's one host read, built
    # where the step runs (inside its CUDA graph: no eager launches between the replay and the read)
    synced: torch.Tensor | None = None

    def __post_init__(self):
        if self.synced is None:
            synced = torch.cat([self.count[:, None], self.tokens], 1)
            if self.plan is not None:  # one more row, as wide as the widest of the two
                width = max(synced.shape[1], self.plan.shape[0])
                synced = torch.nn.functional.pad(synced, (0, width - synced.shape[1]))
                synced = torch.cat([synced, torch.nn.functional.pad(self.plan, (0, width - self.plan.shape[0]))[None]])
            self.synced = synced


def next_token(decoder: TargetDecoder, hidden: torch.Tensor, params: SamplingParams | RowSampling,
               generator: torch.Generator) -> torch.Tensor:
    """[B, H] final hidden -> token [B]: the target's argmax (no full logits under TP) when every row
    is greedy, else a draw from its processed fp32 distribution (a greedy row's is a point mass)."""
    if params.greedy:
        return decoder.argmax(hidden)
    return sample(process_logits(decoder.logits(hidden), params), generator)


def causal_mask(b: int, t: int, device, window: int | None = None) -> torch.Tensor:
    """[B, T, T] bool: query i sees key j by THE window rule (`torchspec.attend.in_window`)."""
    i = torch.arange(t, device=device)
    return in_window(i[:, None], i[None, :], window).expand(b, t, t)


def target_attend(caches: Caches, meta: AttentionMeta, slots: torch.Tensor | None, row_valid: torch.Tensor,
                  **recurrent) -> PagedAttend | HybridAttend:
    """The target's attend for one forward: paged attention, plus the recurrent state's ops for a
    hybrid target (``recurrent``: `build_recurrent_meta`'s lengths / parents / depths / level_widths)."""
    paged = PagedAttend(caches.target, meta)
    if caches.recurrent is None:
        return paged
    if slots is None:
        slots = torch.arange(row_valid.shape[0], device=row_valid.device)
    rmeta = build_recurrent_meta(slots, caches.recurrent.conv_kernel, row_valid=row_valid, **recurrent)
    return HybridAttend(paged, RecurrentStep(caches.recurrent, rmeta))


def catch_up_drafter(runner: DrafterRunner, caches: Caches, block_table: torch.Tensor, ctx: torch.Tensor,
                     tokens: torch.Tensor, aux: list[torch.Tensor], last: torch.Tensor, row_valid: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-0 entries for positions ctx .. ctx + T - 1 (tokens [B, T] = x_{t+1}, aux 3 x [B, T, H] =
    target states at t); returns (normed, feedback) [B, H] at position ctx + last[b]."""
    b, t = tokens.shape
    positions, mask = _step0_layout(ctx, t, runner.window)
    meta = build_attention_meta(block_table, ctx, mask.expand(b, t, t), caches.page_size, anchor=positions,
                                window=runner.window, row_valid=row_valid)
    normed, feedback = runner.forward(tokens, runner.fuse(aux), positions, caches.drafter, meta)
    pick = last[:, None, None].expand(b, 1, normed.shape[-1])
    return torch.gather(normed, 1, pick)[:, 0], torch.gather(feedback, 1, pick)[:, 0]


@fused
def _step0_layout(ctx: torch.Tensor, t: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ctx .. ctx + t - 1 [B, T] of step-0 entries and their window-causal mask [T, T] (the same
    for every row: callers broadcast it, so a prefill chunk never materialises B x T x T booleans)."""
    positions = ctx[:, None] + torch.arange(t, device=ctx.device)
    return positions, causal_mask(1, t, ctx.device, window)[0]


def prefill(decoder: TargetDecoder, runner: DrafterRunner | None, caches: Caches, block_table: torch.Tensor,
            prompts: torch.Tensor, lengths: torch.Tensor, params: SamplingParams | RowSampling,
            generator: torch.Generator | None, slots: torch.Tensor | None = None, ctx: torch.Tensor | None = None,
            next_tokens: torch.Tensor | None = None) -> StepOut:
    """A chunk of each row's prompt, prompts [B, T] (right-padded; ``lengths`` [B]), written after the
    row's ``ctx`` [B] committed tokens (default 0: empty rows); fills the target (and drafter) cache.

    Each chunk token attends the committed prefix and the chunk causally (the one mask rule of
    ``paged_kv``). ``next_tokens`` [B]: the prompt token that follows each row's chunk, or -1 where
    the chunk ends the prompt (default: every row's does); there the first token x_P is sampled and
    becomes the drafter's input at the last prompt position (x_{t+1} at t). ``tokens`` / ``root``
    mean nothing for rows that continue. Padding positions only write KV at positions >= ctx +
    length (uncommitted, or the trash page beyond the block table). A hybrid target's rows with ctx
    = 0 start from zero state, the others continue from their slot's committed state; each commits
    the state after its last real token."""
    b, t = prompts.shape
    dev = prompts.device
    ctx = torch.zeros(b, dtype=torch.long, device=dev) if ctx is None else ctx
    valid = torch.ones(b, dtype=torch.bool, device=dev)
    positions = ctx[:, None] + torch.arange(t, device=dev)
    meta = build_attention_meta(block_table, ctx, causal_mask(b, t, dev), caches.page_size, row_valid=valid)
    aux_ids = tuple(runner.config.aux_layer_ids) if runner is not None else ()
    attend = target_attend(caches, meta, slots, valid, lengths=lengths, resume=ctx > 0)
    out = decoder(prompts, positions, attend, capture_layers=aux_ids)
    last = (lengths - 1)[:, None, None]
    hidden_last = torch.gather(out.hidden, 1, last.expand(b, 1, out.hidden.shape[-1]))[:, 0]
    first = next_token(decoder, hidden_last, params, generator)  # [B]
    step = StepOut(tokens=first[:, None], count=torch.ones(b, dtype=torch.long, device=dev), root=first)
    if runner is not None:
        follow = first if next_tokens is None else torch.where(next_tokens >= 0, next_tokens, first)
        shifted = torch.cat([prompts[:, 1:], follow[:, None]], 1)  # x_{t+1}; the follower at the last position
        shifted = shifted.scatter(1, (lengths - 1)[:, None], follow[:, None])
        step.normed, step.feedback = catch_up_drafter(runner, caches, block_table, ctx, shifted, out.aux,
                                                      lengths - 1, valid)
    return step


def plain_step(decoder: TargetDecoder, caches: Caches, block_table: torch.Tensor, ctx: torch.Tensor,
               root: torch.Tensor, row_valid: torch.Tensor, params: SamplingParams | RowSampling,
               generator: torch.Generator, slots: torch.Tensor | None = None) -> StepOut:
    """Plain decoding: one target forward per token (a hybrid target's state is committed at once)."""
    out = _root_forward(decoder, caches, block_table, ctx, root, row_valid, slots)
    tok = next_token(decoder, out.hidden[:, 0], params, generator)
    return StepOut(tokens=tok[:, None], count=torch.ones_like(tok), root=tok)


def _root_forward(decoder: TargetDecoder, caches: Caches, block_table: torch.Tensor, ctx: torch.Tensor,
                  root: torch.Tensor, row_valid: torch.Tensor, slots: torch.Tensor | None,
                  capture_layers: tuple[int, ...] = ()):
    """The target forward over each row's root at position ctx (a plain step's), capturing ``capture_layers``."""
    meta = build_attention_meta(block_table, ctx, torch.ones(root.shape[0], 1, 1, dtype=torch.bool, device=root.device),
                                caches.page_size, row_valid=row_valid)
    return decoder(root[:, None], ctx[:, None], target_attend(caches, meta, slots, row_valid),
                   capture_layers=capture_layers)


def plain_step_deferring_drafter(decoder: TargetDecoder, runner: DrafterRunner, caches: Caches,
                                 block_table: torch.Tensor, ctx: torch.Tensor, root: torch.Tensor,
                                 row_valid: torch.Tensor, slots: torch.Tensor | None) -> StepOut:
    """A greedy plain step whose drafter entry is deferred (the draft controller's plain rounds): the target forward
    over the root captures the drafter's aux layers, and the committed token and those states wait in
    ``caches.pending`` for the next round that drafts (``pending_drafter.catch_up_pending``). The output carries
    no drafter state: the engine keeps the stale one, which that round replaces."""
    out = _root_forward(decoder, caches, block_table, ctx, root, row_valid, slots, tuple(runner.config.aux_layer_ids))
    tok = decoder.argmax(out.hidden)[:, 0]  # [B]
    caches.pending.push(torch.arange(tok.shape[0], device=tok.device) if slots is None else slots, tok, out.aux,
                        row_valid)
    return StepOut(tokens=tok[:, None], count=torch.ones_like(tok), root=tok)


def verify_forward(decoder: TargetDecoder, caches: Caches, tree: DraftTree, depth: int, block_table: torch.Tensor,
                   ctx: torch.Tensor, row_valid: torch.Tensor, slots: torch.Tensor | None, aux_layer_ids: tuple[int, ...],
                   level_widths: tuple[int, ...]):
    """The target forward over a draft tree [B, N] after ``ctx`` committed tokens (its mask bounded by ``depth``),
    capturing the drafter's aux layers -> (output, the attend it used). ``speculate``'s, and what
    ``cost_profile`` times."""
    meta = build_attention_meta(block_table, ctx, tree.attention_mask(depth), caches.page_size, row_valid=row_valid)
    attend = target_attend(caches, meta, slots, row_valid, parents=tree.parents, depths=tree.depths,
                           level_widths=level_widths)
    return decoder(tree.tokens, ctx[:, None] + tree.depths, attend, capture_layers=aux_layer_ids), attend


def speculate(decoder: TargetDecoder, runner: DrafterRunner, caches: Caches, inp: DraftInputs,
              spec: SpecConfig, params: SamplingParams | RowSampling, generator: torch.Generator,
              slots: torch.Tensor | None = None, costs: RoundCosts | None = None) -> StepOut:
    """One draft-verify-accept-compact-catch-up round over the active rows (see module docstring);
    with ``costs`` a greedy round's depth and width are the draft controller's (``controlled_drafting``), and
    the output carries its plan for the next round (ahead mode; sampled rounds: the next one's depth)."""
    plan = None
    if costs is not None and costs.plan == PLAIN_ROUND:
        raise ValueError("a controller's plain round is a plain step (plain_step_deferring_drafter), not a speculation "
                         "round; engine_forwards.decode_round dispatches it.")
    if costs is not None and costs.flush:  # the first round drafting after plain rounds catches the drafter up
        inp = catch_up_pending(runner, caches, inp, torch.arange(inp.root.shape[0], device=inp.root.device)
                               if slots is None else slots)
    if costs is not None and params.greedy and costs.plan is not None:
        tree, plan = draft_ahead_tree(runner, caches.drafter, inp, spec, costs)
    elif costs is not None and params.greedy:
        tree = draft_controlled_tree(runner, caches.drafter, inp, spec, costs)
    else:
        tree = draft_round(runner, caches.drafter, inp, spec, params, generator)
        if costs is not None and spec.sampled(params):  # the next sampled round's depth, fixed before its draws
            plan = next_depth_after_sampled(tree, spec.depth, costs, inp.row_valid)
    b = tree.tokens.shape[0]
    depth = min(spec.depth, tree.num_nodes - 1)  # static: a tree of fewer nodes (a controlled width) is shallower
    ctx, bt = inp.ctx_len, inp.block_table
    out, attend = verify_forward(decoder, caches, tree, depth, bt, ctx, inp.row_valid, slots,
                                 tuple(runner.config.aux_layer_ids), tree_level_widths(spec, params))
    if params.greedy:
        res = verify_greedy(tree, decoder.argmax(out.hidden), max_depth=depth)  # [B, N] argmaxes
    else:
        res = verify_sampling(tree, process_logits(decoder.logits(out.hidden), params), generator, max_depth=depth,
                              max_tries=spec.max_tries(params))
    a = res.num_accepted  # [B]
    if costs is not None and params.greedy:  # how far the drafter's confidence was borne out
        costs.calibration.observe(a, _path_ranks(tree, res.path), inp.row_valid)
    if isinstance(attend, HybridAttend):  # recurrent state: the accepted path's last node only
        attend.commit(res.path.gather(1, a[:, None])[:, 0], inp.row_valid)
    path, src, dst, emitted = _compaction(a, res.path, res.next_token, tree.tokens, bt, ctx, inp.row_valid,
                                          caches.page_size)
    caches.target.move_slots(src, dst)
    width = path.shape[1]  # D + 1
    aux = [torch.gather(h, 1, path[:, :, None].expand(b, width, h.shape[-1])) for h in out.aux]
    normed, feedback = catch_up_drafter(runner, caches, bt, ctx, emitted, aux, a, inp.row_valid)
    return StepOut(tokens=emitted, count=a + 1, root=res.next_token, normed=normed, feedback=feedback, plan=plan)


def _path_ranks(tree: DraftTree, path: torch.Tensor) -> torch.Tensor:
    """[B, D] the score rank of the accepted path's node at each depth 1..D (the calibration's evidence by rank);
    a tree without ranks is a chain, whose depth-d node is its rank d - 1."""
    nodes = path[:, 1:].clamp(min=0)
    if tree.score_rank is None:
        return torch.arange(nodes.shape[1], device=path.device).expand_as(nodes)
    return tree.score_rank.gather(1, nodes)


@fused
def _compaction(a: torch.Tensor, path: torch.Tensor, next_token: torch.Tensor, tokens: torch.Tensor,
                block_table: torch.Tensor, ctx: torch.Tensor, row_valid: torch.Tensor, page_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3's bookkeeping for ``a`` [B] accepted nodes on ``path`` [B, D + 1] -> (path with off-path
    entries made identity moves, KV source slots, destination slots, the committed tokens [B, D + 1]:
    the accepted drafted tokens, then ``next_token``). One fused region on CUDA (~30 index ops)."""
    b, width = path.shape
    n = tokens.shape[1]
    steps = torch.arange(width, device=a.device)
    on_path = steps[None] <= a[:, None]  # [B, D+1]
    path = torch.where(on_path, path, steps[None].expand(b, width))  # off-path: identity (no-op move)
    src = slots_for_positions(block_table, ctx[:, None] + path, page_size)
    dst = slots_for_positions(block_table, ctx[:, None] + steps[None], page_size)
    src = torch.where(on_path & row_valid[:, None], src, dst)
    # committed tokens of this round: accepted drafted tokens, then the bonus
    drafted = torch.gather(tokens, 1, path[:, 1:].clamp(max=n - 1))
    emitted = torch.cat([drafted, next_token[:, None]], 1)  # [B, D+1]
    emitted = torch.where(steps[None] < a[:, None], emitted, next_token[:, None])
    return path, src, dst, emitted
