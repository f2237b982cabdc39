"""The EAGLE-4 drafter: fc-norm fusion, eh_proj, one decoder layer, normalised feedback, LM head.

Data flow of one drafting step (H = target hidden size, V = target vocabulary):

    step 0 hidden:  g = post_norm( fc( cat(norm_lo(h_lo), norm_mid(h_mid), norm_hi(h_hi)) ) )  3H -> H
    every step:     x = eh_proj( cat(embed_norm(E[token]), hidden_norm(g)) )                    2H -> H
                    x = x + attn( input_layernorm(x) )          (GQA; RoPE or NoPE; the caller's attend
                                                                 applies the sliding window)
                    x = x + mlp( post_attention_layernorm(x) )  (dense SwiGLU, or MoE: top-k routed
                                                                 SwiGLU experts + RMSNorm on their output)
                    y = norm(x);  logits = lm_head(y)   (full head; or the efficient head: a rank-r
                                        scorer picks the top-k ids, the full head re-scores only those)
    next step:      g = y if norm_output else x                 (EAGLE-3.1 "normalised feedback")

``fc_norm`` (three separate RMSNorms before fc) and ``fc_post_norm`` (an RMSNorm right after fc)
are separate flags because the EAGLE-4 description's "post-norm" admits both readings; the
``eagle4`` preset enables both plus ``norm_output`` (see docs/architecture.md for why).
The token embedding E is the target's, frozen.
"""

from __future__ import annotations

import torch
from torch import nn

from torchspec.attend import Attend
from torchspec.models.base import Drafter
from torchspec.models.config_base import SHARED_ARCH_FIELDS, SHARED_REQUIRED, Flag, StrictDrafterConfig
from torchspec.models.layers import Attention, RotaryEmbedding, SwiGLU, step_input
from torchspec.models.lm_head import EfficientLMHead
from torchspec.models.moe import MoEMLP
from torchspec.targets.layers import RMSNorm


class Eagle4Config(StrictDrafterConfig):
    model_type = "torchspec_eagle4"
    ARCH_FIELDS = {
        **SHARED_ARCH_FIELDS,
        "fc_norm": Flag(True, "RMS-normalise each of the three captured states separately before fc"),
        "fc_post_norm": Flag(True, "RMSNorm applied right after fc (3H -> H), before the first step"),
        "norm_output": Flag(True, "feed the final-normalised layer output back as the next step's hidden "
                            "(EAGLE-3.1 normalised feedback); False feeds the pre-norm residual stream"),
        "pre_attn_norm": Flag(True, "RMSNorm between eh_proj and attention (input_layernorm)"),
        "sliding_window": Flag(4096, "step-0 keys at positions t-window < s <= t are attended (RoPE positions "
                               "unchanged); null = full causal; the TTT diagonal is always attended", int | None),
        "nope": Flag(False, "no rotary embedding at all (NoPE); positions enter only through the causal mask"),
        "lm_head_rank": Flag(0, "rank r of the efficient LM head's vocabulary scorer: scores = up @ (down @ y), "
                             "lm_head.down [r,H], lm_head.up [V,r]; the best lm_head_topk ids are re-scored "
                             "exactly by lm_head.weight [V,H]; 0 = dense head only"),
        "lm_head_topk": Flag(128, "candidates k kept per token when drafting with the efficient head; every other "
                             "token gets logit -inf (used when lm_head_rank > 0)"),
        "moe": Flag(False, "replace the decoder layer's dense SwiGLU MLP by a top-k routed mixture of SwiGLU "
                    "experts (torchspec.models.moe.MoEMLP)"),
        "moe_num_experts": Flag(8, "routed experts E (used when moe)"),
        "moe_top_k": Flag(2, "experts per token k (used when moe)"),
        "moe_intermediate_size": Flag(None, "inner width of each expert and the shared expert; null = "
                                      "intermediate_size", int | None),
        "moe_shared_expert": Flag(False, "a SwiGLU expert applied to every token, added to the routed output"),
        "moe_norm_topk_prob": Flag(True, "routing weights = top-k softmax probs renormalised to sum 1; False = raw probs"),
        "moe_extra_norm": Flag(True, "RMSNorm on the MoE output before the residual add (EAGLE-4's extra "
                               "normalisation after the dense part; the MoE input is already normalised)"),
    }
    REQUIRED = SHARED_REQUIRED

    def validate(self) -> None:
        super().validate()
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"Eagle4Config: sliding_window={self.sliding_window} must be null or an int >= 1.")
        if self.lm_head_rank and not (1 <= self.lm_head_rank <= self.hidden_size and 1 <= self.lm_head_topk <= self.vocab_size):
            raise ValueError(
                f"Eagle4Config: lm_head_rank={self.lm_head_rank} must lie in [1, hidden_size={self.hidden_size}] and "
                f"lm_head_topk={self.lm_head_topk} in [1, vocab_size={self.vocab_size}] (or lm_head_rank=0: dense head)."
            )
        if self.moe and not 1 <= self.moe_top_k <= self.moe_num_experts:
            raise ValueError(
                f"Eagle4Config: moe_top_k={self.moe_top_k} must lie in [1, moe_num_experts={self.moe_num_experts}]."
            )


class Eagle4DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle4Config):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps) if cfg.pre_attn_norm else nn.Identity()
        self.self_attn = Attention(h, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.moe = cfg.moe
        if cfg.moe:
            self.mlp = MoEMLP(h, cfg.moe_intermediate_size or cfg.intermediate_size, cfg.moe_num_experts,
                              cfg.moe_top_k, shared_expert=cfg.moe_shared_expert, norm_eps=cfg.rms_norm_eps,
                              extra_norm=cfg.moe_extra_norm, norm_topk_prob=cfg.moe_norm_topk_prob)
        else:
            self.mlp = SwiGLU(h, cfg.intermediate_size)

    def forward(self, x, cos, sin, attend: Attend, token_mask=None, moe_stats=None):
        """-> (x, mlp output): the layer's output is their sum, left to the caller so that the drafter's
        final norm takes the add into its own kernel (``RMSNorm.add_norm``)."""
        x, h = self.post_attention_layernorm.add_norm(x, self.self_attn(self.input_layernorm(x), cos, sin, attend))
        if not self.moe:
            return x, self.mlp(h)
        out, stats = self.mlp(h, token_mask, with_stats=moe_stats is not None)
        if moe_stats is not None:
            moe_stats.append(stats)  # one MoEStats per TTT step
        return x, out


class Eagle4Drafter(Drafter):
    config_class = Eagle4Config
    base_model_prefix = "drafter"
    _supports_sdpa = False

    def __init__(self, config: Eagle4Config, attn_backend: str = "chunked"):
        super().__init__(config, attn_backend)
        h, v, eps = config.hidden_size, config.vocab_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(v, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.fc_norms = nn.ModuleList(RMSNorm(h, eps) for _ in range(3)) if config.fc_norm else None
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.fc_post_norm = RMSNorm(h, eps) if config.fc_post_norm else nn.Identity()
        self.embed_norm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = Eagle4DecoderLayer(config)
        self.norm = RMSNorm(h, eps)
        self.lm_head = (EfficientLMHead(h, v, config.lm_head_rank, config.lm_head_topk) if config.lm_head_rank
                        else nn.Linear(h, v, bias=False))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, EfficientLMHead):
            module.reset_parameters(0.02)
        elif isinstance(module, MoEMLP):
            module.reset_parameters(0.02)
        elif isinstance(module, RotaryEmbedding):
            # Buffers are not persistent: recompute after meta/empty initialisation.
            d = self.config.head_dim
            module.inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, device=module.inv_freq.device).float() / d))

    @property
    def window(self) -> int | None:
        return self.config.sliding_window

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

        input_ids [B, T] (token whose successor is predicted), hidden [B, T, H], positions [B, T]
        (RoPE; unused with NoPE); ``attend`` (``torchspec/attend.py``): ``self.ttt_attend(...)`` in
        the training unroll, ``PagedAttend`` in serving; it owns the keys and the sliding window.
        token_mask [B, T] marks real tokens (MoE load statistics count only those); the MoE layer
        appends its ``MoEStats`` to ``moe_stats``.
        Returns (normed [B, T, H] -> feed the head; feedback [B, T, H] -> next step's hidden).
        """
        x = self.eh_proj(step_input(self.embed_tokens, input_ids, hidden, self.embed_norm, self.hidden_norm))
        cos, sin = (None, None) if self.config.nope else self.rotary.cos_sin(positions)
        x, normed = self.norm.add_norm(*self.layer(x, cos, sin, attend, token_mask, moe_stats))
        return normed, (normed if self.config.norm_output else x)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] logits over the full target vocabulary (the dense head, also for an
        efficient head: training scores every token)."""
        return self.lm_head(normed)

    def target_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Serving: [..., H] -> fp32 [..., V]. An efficient head scores only its top-k candidates
        exactly (-inf elsewhere); a dense head scores every token."""
        if isinstance(self.lm_head, EfficientLMHead):
            return self.lm_head.draft_logits_sparse(normed).float()
        return self.lm_head(normed).float()

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """EAGLE-4 drafts in the target vocabulary: the identity map (cf. EAGLE-3's d2t)."""
        return draft_ids

    def draft_vocab_ids(self) -> None:
        """The head covers the full target vocabulary."""
        return None

    def fit_vocab(self, train_set) -> None:
        """No pruned vocabulary: the efficient head prunes per token instead."""
        return None

    def vocab_mapping(self) -> None:
        return None

    @torch.no_grad()
    def init_from_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                         init_lm_head: bool = True, svd_device: str | None = None) -> None:
        """Copy the target's embedding (frozen) and, if asked, its LM head as the drafter head's start;
        an efficient head's low-rank scorer starts as the truncated SVD of the (copied) full head, run
        where the target's head is unless ``svd_device`` says otherwise (training builds the drafter on
        the CPU beside a GPU target, whose SVD is far faster than the CPU's)."""
        self.embed_tokens.weight.copy_(embed_weight)
        if init_lm_head:
            self.lm_head.weight.copy_(lm_head_weight)
        if isinstance(self.lm_head, EfficientLMHead):
            self.lm_head.init_scorer(device=svd_device or lm_head_weight.device)
