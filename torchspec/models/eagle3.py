"""The EAGLE-3 drafter (SpecForge / SGLang / vLLM convention), with the EAGLE-3.1 flags.

Data flow of one drafting step (H = target hidden size, V = target vocabulary, Vd = draft vocabulary):

    step 0 hidden:  g = fc( cat(n_lo(h_lo), n_mid(h_mid), n_hi(h_hi)) )        3H -> H  (n_* = RMSNorm
                                                                                 if fc_norm, else identity)
    every step:     a = cat( input_layernorm(E[token]), hidden_norm(g) )         [B, T, 2H]
                    x = g + attn(a)                  q/k/v read the 2H concatenation; o_proj -> H
                    x = x + mlp( post_attention_layernorm(x) )                   (dense SwiGLU)
                    y = norm(x);  logits = lm_head(y)                            [B, T, Vd]
    next step:      g = y if norm_output else x

Unlike EAGLE-4 there is no eh_proj: the decoder layer itself reads width 2H and its residual is
the incoming hidden state g (width H). ``fc_norm`` and ``norm_output`` are the EAGLE-3.1 flags;
both are off in plain EAGLE-3. The token embedding E is the target's, frozen.

Pruned draft vocabulary (contract 7). The LM head scores Vd <= V tokens. ``d2t[i]`` is an offset:
draft id i is target id ``i + d2t[i]``; ``t2d`` is a bool mask over the target vocabulary, True
for the Vd target ids in the draft vocabulary. The draft ids are the chosen target ids in
ascending order (``torchspec.data.vocab.build_vocab_mapping`` builds them from the training set).
Both are persistent buffers, so checkpoints and exports carry them; a mapping, once weights that
depend on it are loaded or initialised, is only replaced with ``force=True``.

Loss against a pruned vocabulary (SpecForge convention): the target distribution is the softmax of
the target logits restricted to the draft vocabulary, i.e. renormalised inside it
(``target_probs_for_loss``). Accuracy stays in target-vocab space: the draft argmax mapped through
d2t is compared with the target's full-vocabulary argmax, so a position whose target argmax lies
outside the draft vocabulary is a miss, exactly as acceptance would see it (the drafter can never
propose that token). SpecForge and the original EAGLE-3 trainer also drop such positions from the
loss (``position_mask = t2d[target_argmax] * loss_mask``); torchspec keeps them, because the
renormalised distribution still says which draftable token is best for sampled verification, and
because contract 4's denominators are counted from the loss mask before the target runs.

Aux layer ids. torchspec id i = the residual stream after decoder layer i, 0-indexed (contract 1).
SGLang and vLLM both capture ``hidden_states + residual`` on *entry* to a layer; with no explicit
ids both take the entries of layers (2, L//2, L-3), i.e. torchspec ids [1, L//2 - 1, L - 4], the
torchspec default. Explicit ``eagle_aux_hidden_state_layer_ids`` in a draft config.json differ:
SGLang adds 1 (``layers_to_capture = [i + 1 for i in layer_ids]``), so its ids equal torchspec's;
vLLM uses them as entry indices without a shift, so vLLM id j is torchspec id j - 1. The export
adapters own that conversion and pin it with golden tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchspec.attend import Attend
from torchspec.data.vocab import build_vocab_mapping, token_frequencies, vocab_coverage
from torchspec.models.base import Drafter
from torchspec.models.config_base import SHARED_ARCH_FIELDS, SHARED_REQUIRED, Flag, StrictDrafterConfig
from torchspec.models.layers import Attention, RotaryEmbedding, SwiGLU, step_input
from torchspec.targets.layers import RMSNorm


class Eagle3Config(StrictDrafterConfig):
    model_type = "torchspec_eagle3"
    ARCH_FIELDS = {
        **SHARED_ARCH_FIELDS,
        "draft_vocab_size": Flag(None, "draft vocabulary size Vd <= V scored by lm_head; draft id i is target "
                                 "id i + d2t[i] (d2t, t2d are buffers in the weights)", int | None),
        "fc_norm": Flag(False, "EAGLE-3.1: RMS-normalise each of the three captured states separately before fc"),
        "norm_output": Flag(False, "EAGLE-3.1: feed the final-normalised layer output (after norm) back as the "
                            "next step's hidden; False feeds the pre-norm residual stream (plain EAGLE-3)"),
    }
    REQUIRED = (*SHARED_REQUIRED, "draft_vocab_size")

    def validate(self) -> None:
        super().validate()
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"Eagle3Config: draft_vocab_size={self.draft_vocab_size} must lie in [1, vocab_size="
                f"{self.vocab_size}]; the draft vocabulary is a subset of the target's (set "
                f"drafter.draft_vocab_size <= the target vocab)."
            )


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> None:
    """Raise ValueError naming the problem unless (d2t, t2d) is a consistent pruned-vocab mapping:
    d2t long [Vd], t2d bool [V], the ids i + d2t[i] strictly increasing, inside [0, V) and exactly
    the ids where t2d is True. Host sync: call it at setup, never in a step."""
    if d2t.dtype not in (torch.int64, torch.int32) or tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(f"vocab mapping: d2t must be an integer tensor of shape [{draft_vocab_size}] "
                         f"(draft_vocab_size), got {d2t.dtype} {tuple(d2t.shape)}.")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        raise ValueError(f"vocab mapping: t2d must be a bool tensor of shape [{vocab_size}] (vocab_size), "
                         f"got {t2d.dtype} {tuple(t2d.shape)}.")
    count = int(t2d.sum())
    if count != draft_vocab_size:
        raise ValueError(f"vocab mapping: t2d marks {count} target ids but draft_vocab_size={draft_vocab_size}.")
    ids = torch.arange(draft_vocab_size, device=d2t.device) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"vocab mapping: i + d2t[i] leaves [0, {vocab_size}) "
                         f"(range {int(ids.min())}..{int(ids.max())}).")
    if draft_vocab_size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        bad = int((ids[1:] <= ids[:-1]).nonzero()[0]) + 1
        raise ValueError(f"vocab mapping: target ids i + d2t[i] must be strictly increasing; draft id {bad} maps "
                         f"to {int(ids[bad])} after {int(ids[bad - 1])}.")
    outside = ~t2d.to(ids.device)[ids]
    if bool(outside.any()):
        bad = int(outside.nonzero()[0])
        raise ValueError(f"vocab mapping: draft id {bad} maps to target id {int(ids[bad])}, where t2d is False.")


class Eagle3DecoderLayer(nn.Module):
    """The EAGLE-3 "midlayer": attention reads cat(normed embedding, normed hidden) at width 2H."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)  # on the token embedding
        self.hidden_norm = RMSNorm(h, eps)  # on the incoming hidden state
        self.self_attn = Attention(2 * h, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)

    def forward(self, attn_in, hidden, cos, sin, attend: Attend):
        """attn_in: cat(input_layernorm(embedding), hidden_norm(hidden)) [B, T, 2H] (``layers.step_input``)
        -> (x, mlp output): the layer's output is their sum, left to the caller so that the final norm's kernel
        takes the add (``RMSNorm.add_norm``), as the post-attention norm takes the first."""
        x, h = self.post_attention_layernorm.add_norm(hidden, self.self_attn(attn_in, cos, sin, attend))  # residual: hidden
        return x, self.mlp(h)


class Eagle3Drafter(Drafter):
    config_class = Eagle3Config
    base_model_prefix = "drafter"
    _supports_sdpa = False

    def __init__(self, config: Eagle3Config, attn_backend: str = "chunked"):
        super().__init__(config, attn_backend)
        h, v, vd, eps = config.hidden_size, config.vocab_size, config.draft_vocab_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(v, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.fc_norms = nn.ModuleList(RMSNorm(h, eps) for _ in range(3)) if config.fc_norm else None
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.fc_post_norm = nn.Identity()  # EAGLE-3 has none (the shared fuse_target_states applies it)
        self.layer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        # Placeholder mapping: the first Vd target ids (exact when Vd == V). A pruned drafter must get
        # its real mapping (set_vocab_mapping) before init_from_target or training.
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(v) < vd)
        self._mapping_set = vd == v
        self._mapping_locked = False
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, RotaryEmbedding):
            # Buffers are not persistent: recompute after meta/empty initialisation.
            d = self.config.head_dim
            module.inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, device=module.inv_freq.device).float() / d))

    # --- loading: the mapping comes with the weights and is locked ---------------------------------

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        """transformers' loader, made strict: a checkpoint missing weights or the d2t/t2d buffers is
        refused (never initialised silently), and the loaded mapping is checked and locked."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing = sorted(info.get("missing_keys", []))
        if missing:
            raise ValueError(f"Eagle3Drafter.from_pretrained: the checkpoint lacks {missing}; an EAGLE-3 "
                             f"checkpoint carries every weight and its vocab mapping (d2t, t2d).")
        model._after_weights_loaded(mapping_loaded=True)
        return (model, info) if want_info else model

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._after_weights_loaded(mapping_loaded="d2t" in state_dict)
        return out

    def _after_weights_loaded(self, mapping_loaded: bool) -> None:
        # Loaded weights lock the mapping in place, even a partial load (e.g. trainable weights on
        # resume) that leaves the mapping as it was: the loaded lm_head rows belong to some mapping.
        cfg = self.config
        check_vocab_mapping(self.d2t, self.t2d, cfg.vocab_size, cfg.draft_vocab_size)
        self._mapping_set = self._mapping_set or mapping_loaded
        self._mapping_locked = True

    # --- vocabulary mapping -------------------------------------------------------------------------

    @torch.no_grad()
    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor, force: bool = False) -> None:
        """Install the pruned-vocab mapping (see module docstring). Setting the mapping already in
        place is a no-op; changing it after weights were loaded or initialised from it (from_pretrained,
        load_state_dict, init_from_target with the LM head) is refused unless ``force=True``, because
        lm_head row i was trained for target id i + d2t[i]."""
        cfg = self.config
        check_vocab_mapping(d2t, t2d, cfg.vocab_size, cfg.draft_vocab_size)
        same = torch.equal(d2t.to(self.d2t), self.d2t) and torch.equal(t2d.to(self.t2d.device), self.t2d)
        if self._mapping_locked and not same and not force:
            raise ValueError(
                "Eagle3Drafter.set_vocab_mapping: mapping changes under loaded weights are refused (lm_head "
                "row i belongs to target id i + d2t[i]). Build a new drafter for a new mapping, or pass "
                "force=True if you re-initialise the LM head yourself."
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self._mapping_set = True

    def draft_target_ids(self) -> torch.Tensor:
        """[Vd] target id of every draft id, ascending (i + d2t[i])."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids (any shape) -> target-vocab ids."""
        return draft_ids + self.d2t[draft_ids]

    def draft_vocab_ids(self) -> torch.Tensor:
        """[Vd] target id of every head row (the teacher is restricted to these in training)."""
        return self.draft_target_ids()

    def fit_vocab(self, train_set) -> str:
        """The vocabulary-mapping hook: count the assistant tokens of the training split (never the
        held-out one; every rank counts the same) and keep the Vd most frequent as the draft
        vocabulary. Call before ``init_from_target``. Returns a line for the log."""
        cfg = self.config
        freqs = token_frequencies(train_set, cfg.vocab_size)
        d2t, t2d = build_vocab_mapping(freqs, cfg.draft_vocab_size)
        self.set_vocab_mapping(d2t, t2d)
        return (f"draft vocabulary {cfg.draft_vocab_size} / {cfg.vocab_size} covers "
                f"{100 * vocab_coverage(freqs, t2d):.1f}% of assistant tokens")

    def vocab_mapping(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d2t, t2d): a checkpoint carries them so a resumed run can refuse a different mapping."""
        return self.d2t, self.t2d

    def target_probs_for_loss(self, target_logits: torch.Tensor) -> torch.Tensor:
        """fp32 target logits [B, T, V] -> target probabilities over the draft vocabulary [B, T, Vd],
        renormalised inside it: softmax(target_logits[..., t2d]) (SpecForge convention).

        Gathers by ``draft_target_ids()`` (identical to boolean indexing by t2d, since the ids are
        ascending, but with no host sync)."""
        return torch.softmax(target_logits.index_select(-1, self.draft_target_ids()).float(), dim=-1)

    # --- forward ------------------------------------------------------------------------------------

    @property
    def window(self) -> None:
        """EAGLE-3 attends the full causal context."""
        return None

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        token_mask: torch.Tensor | None = None,
        moe_stats: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step over all positions, in training and in serving.

        input_ids [B, T] (token whose successor is predicted), hidden [B, T, H], positions [B, T];
        ``attend``: ``self.ttt_attend(...)`` in training, ``PagedAttend`` in serving (see
        ``Eagle4Drafter.step``).
        ``token_mask`` and ``moe_stats`` belong to the shared interface (MoE load statistics);
        EAGLE-3 has a dense MLP and ignores them.
        Returns (normed [B, T, H] -> feed ``lm_head``; feedback [B, T, H] -> next step's hidden).
        """
        attn_in = step_input(self.embed_tokens, input_ids, hidden, self.layer.input_layernorm, self.layer.hidden_norm)
        cos, sin = self.rotary.cos_sin(positions)
        x, normed = self.norm.add_norm(*self.layer(attn_in, hidden, cos, sin, attend))
        return normed, (normed if self.config.norm_output else x)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., Vd] logits over the draft vocabulary (map argmaxes with draft_to_target_ids)."""
        return self.lm_head(normed)

    def target_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Serving: [..., H] -> fp32 [..., V], the draft logits scattered to their target ids through
        d2t; target tokens outside the draft vocabulary get -inf."""
        draft = self.lm_head(normed).float()  # [..., Vd]
        out = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_target_ids(), draft)

    @torch.no_grad()
    def init_from_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                         init_lm_head: bool = True) -> None:
        """Copy the target's embedding (frozen) and, if asked, the target LM head rows of the draft
        vocabulary, selected by target id: lm_head row i = target row i + d2t[i]. Needs the real
        mapping first when the vocabulary is pruned; initialising the head from it locks the mapping."""
        if not self._mapping_set:
            raise ValueError(
                f"Eagle3Drafter.init_from_target: draft_vocab_size={self.config.draft_vocab_size} < "
                f"vocab_size={self.config.vocab_size} but no vocab mapping was set; build it from the "
                f"training set (torchspec.data.vocab) and call set_vocab_mapping first."
            )
        self.embed_tokens.weight.copy_(embed_weight)
        if init_lm_head:
            rows = self.draft_target_ids().to(lm_head_weight.device)  # [Vd] target ids
            self.lm_head.weight.copy_(lm_head_weight.index_select(0, rows))
            self._mapping_locked = True
