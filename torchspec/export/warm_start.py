"""Warm start: initialise an EAGLE-4 drafter from a trained EAGLE-3 drafter.

``eagle3_to_eagle4(e3, e4_config, target_lm_head=..., fit_tokens=..., fit_aux=...)`` builds an
``Eagle4Drafter`` that computes (approximately) the EAGLE-3 drafter's function, and a
``ConversionReport`` naming every EAGLE-4 weight as loaded or initialised and every EAGLE-3 weight
as loaded or dropped. ``format_report`` prints it as a table.

What maps verbatim (``loaded``): the target's embedding, ``fc``, ``fc_norms`` (if EAGLE-3.1 had
them), ``o_proj``, ``post_attention_layernorm``, the final ``norm``, the dense MLP (or, for an MoE
drafter, every expert: sparse upcycling with ``MoEMLP.load_expert``), EAGLE-3's
``input_layernorm`` -> ``embed_norm`` and ``hidden_norm`` -> ``hidden_norm``.

What cannot map and is initialised deliberately:

* **LM head.** EAGLE-3 scores a pruned draft vocabulary, EAGLE-4 the full one. Row ``i`` of the
  EAGLE-3 head goes to target id ``i + d2t[i]``. Every other token must score low, as EAGLE-3 never
  proposes it, and the head has no bias. So its row is ``c * mu / |mu|^2``, with ``mu`` the mean of EAGLE-3's
  normed states on the fit samples: it scores ~``c``, 2 below the median draft logit. The target's own rows
  were used here before. On SmolLM2 they won 95% of the argmaxes (their max logit averaged 8.7 against
  5.5 for the draft rows), and the converted drafter's acc_0 fell from 0.180 to 0.002; zero rows keep 0.180
  but put most of the softmax mass on the 17K tokens (KL to the target 6.5 against 4.5). An efficient head's
  scorer is then the truncated SVD of that expanded head (``EfficientLMHead.init_scorer``).
* **eh_proj and q/k/v (the width change).** EAGLE-3's attention reads ``a = cat(input_layernorm(e),
  hidden_norm(g))`` at 2H and its residual is the incoming hidden ``g``; EAGLE-4 reads
  ``u = pre_attn_norm(z)``, ``z = eh_proj(a')`` at H, and its residual is ``z``. So ``z`` must
  carry both what q/k/v need from ``a`` (up to rank 2H) and the residual ``g`` (rank H) through a
  rank-H bottleneck: in general no exact map exists. We fit it by **reduced-rank regression** on
  sample inputs ``a'`` (what EAGLE-4's eh_proj reads) collected by running EAGLE-3's TTT unroll on
  ``fit_tokens`` / ``fit_aux``: targets ``[q3(a)/s_q, k3(a)/s_k, v3(a)/s_v, sqrt(w) g/s_g]`` (each
  block scaled to unit RMS, so the objective is a sum of squared relative errors; ``w`` =
  ``residual_weight``). The best rank-H fit ``targets ~ (a' B) V_H V_H^T`` is re-parametrised
  so the residual block's decoder is the identity: ``eh_proj = B V_H L_res`` (hence ``z ~ g`` in
  EAGLE-3's residual basis, which o_proj, the MLP, the norms and the head were trained in), then
  q/k/v are re-solved by least squares from the exact ``u = RMSNorm(z)`` (pre_attn_norm weight 1),
  so the per-token rescaling of the norm in between is accounted for, not ignored.
  With ``fit_tokens=None`` the samples are synthetic (random token ids, unit-RMS Gaussian hidden
  states), i.e. the analytic top-H SVD of the stacked ``[Wq; Wk; Wv; residual]`` map under an
  isotropic hidden: weaker, since the residual scale and the data's subspace are guesses.
  Both least-squares solves are ridge-regularised (``RIDGE``): a sharper fit starts closer but
  trains worse. ``report.metrics`` holds the relative errors on the fit samples (``attention_fit_error`` measures
  them on held-out samples). The samples and the fit are ``warm_start_fit.py``.
* **fc-norm / post-norm scales.** If EAGLE-4 has ``fc_norm`` and EAGLE-3 had not, each captured
  state is RMS-normalised before fc, which changes the relative scale of the three inputs; the
  three norms start at the mean RMS of their state on the fit samples (``fc`` stays verbatim, so
  ``fc(cat(s_j h_j / rms(h_j)))`` ~ ``fc(cat(h_j))``), or at 1 without samples (noted).
  ``fc_post_norm`` starts at 1: invisible to what follows, because the step-0 hidden only reaches
  the layer through ``hidden_norm`` (scale-invariant) and the fitted eh_proj.
* **MoE.** Every expert is the dense MLP; the router starts small random (std 1e-3), so routing is
  near uniform and ties break per token; with renormalised top-k weights the routed sum is then
  exactly the dense MLP. A shared expert starts with the dense gate/up and a zero ``down`` (adds 0).
  ``extra_norm`` (RMSNorm on the MoE output) starts at the dense MLP output's mean RMS on the fit
  samples (1 without). Without ``norm_topk_prob`` the experts' ``down`` is scaled by E/k, so the
  expected routed sum is the dense output.
* **Config fields from the target.** The sizes must equal EAGLE-3's (``check_compatible``); the other
  shared fields (``TARGET_FIELDS``: RoPE base, max positions, norms' eps) take the EAGLE-4 config's
  value -- the target's, in torchspec-convert -- and ``report.config`` lists both values of each, so
  a changed RoPE base is never silent (it also gets a note: the fitted q/k then rotate differently).
* **Attention position/window.** EAGLE-3 had full causal attention with RoPE; EAGLE-4's
  ``sliding_window`` / ``nope`` are kept as configured (a window >= the training length changes
  nothing; NoPE changes the attention scores of the fitted q/k and is noted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from torchspec.export.warm_start_fit import (
    RIDGE,
    collect_eagle3_samples,
    e4_attention_inputs,
    fit_attention_input,
    flat_samples,
)
from torchspec.models.config_base import SHARED_ARCH_FIELDS
from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter
from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter
from torchspec.models.lm_head import EfficientLMHead
from torchspec.models.moe import MoEMLP

# Config fields shared by EAGLE-3 and EAGLE-4 that ``check_compatible`` does not require to be equal
# (RoPE base, max positions, norms' eps): EAGLE-4's value is used (torchspec-convert sizes EAGLE-4 from
# the target), and the report lists both values of each.
COMPARED_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "intermediate_size", "aux_layer_ids", "target_num_layers")
TARGET_FIELDS = tuple(k for k in SHARED_ARCH_FIELDS if k not in COMPARED_FIELDS)


@dataclass(frozen=True)
class Entry:
    key: str
    shape: tuple[int, ...]
    detail: str
    sources: tuple[str, ...] = ()  # the EAGLE-3 keys a loaded weight came from


@dataclass
class ConversionReport:
    loaded: list[Entry] = field(default_factory=list)  # EAGLE-4 keys, values from EAGLE-3 (or the target)
    initialised: list[Entry] = field(default_factory=list)  # EAGLE-4 keys set deliberately (how: detail)
    dropped: list[Entry] = field(default_factory=list)  # EAGLE-3 keys not carried over verbatim (why: detail)
    # Config fields EAGLE-4 does not take from EAGLE-3 (torchspec-convert: the target's): (name, EAGLE-3, EAGLE-4).
    config: list[tuple[str, Any, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # fit relative errors etc.


def format_report(report: ConversionReport) -> str:
    """The report as a plain-text table (one row per key), then the notes and the fit metrics."""
    rows = [(kind, e.key, "x".join(map(str, e.shape)), e.detail)
            for kind, entries in (("loaded", report.loaded), ("initialised", report.initialised),
                                  ("dropped", report.dropped)) for e in entries]
    widths = [max(len(r[i]) for r in [("status", "key", "shape", ""), *rows]) for i in range(3)]
    lines = [f"{'status':<{widths[0]}}  {'key':<{widths[1]}}  {'shape':<{widths[2]}}  detail"]
    lines.append("-" * (sum(widths) + 12))
    lines += [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows]
    lines.append(f"{len(report.loaded)} loaded, {len(report.initialised)} initialised (EAGLE-4 keys); "
                 f"{len(report.dropped)} dropped (EAGLE-3 keys)")
    lines += [f"config: {name} = {new} from the EAGLE-4 config (the target's), EAGLE-3 had {old}"
              + (" (CHANGED)" if new != old else "") for name, old, new in report.config]
    lines += [f"note: {n}" for n in report.notes]
    lines += [f"metric: {k} = {v:.4f}" for k, v in report.metrics.items()]
    return "\n".join(lines)


def check_compatible(c3: Eagle3Config, c4: Eagle4Config) -> None:
    """Refuse an EAGLE-4 config whose sizes, aux layers or target differ from the EAGLE-3 drafter's (no
    weights needed: torchspec-convert calls it before anything loads)."""
    inter4 = (c4.moe_intermediate_size or c4.intermediate_size) if c4.moe else c4.intermediate_size
    pairs = {
        "hidden_size": (c3.hidden_size, c4.hidden_size), "vocab_size": (c3.vocab_size, c4.vocab_size),
        "num_attention_heads": (c3.num_attention_heads, c4.num_attention_heads),
        "num_key_value_heads": (c3.num_key_value_heads, c4.num_key_value_heads),
        "head_dim": (c3.head_dim, c4.head_dim), "intermediate_size (per expert)": (c3.intermediate_size, inter4),
        "aux_layer_ids": (list(c3.aux_layer_ids), list(c4.aux_layer_ids)),
        "target_num_layers": (c3.target_num_layers, c4.target_num_layers),
    }
    bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if bad:
        raise ValueError("eagle3_to_eagle4: the EAGLE-4 config does not match the EAGLE-3 drafter in "
                         + ", ".join(f"{k} (EAGLE-3 {a}, EAGLE-4 {b})" for k, (a, b) in bad.items())
                         + "; size the EAGLE-4 drafter like the EAGLE-3 one (same target, same layer sizes).")


@torch.no_grad()
def eagle3_to_eagle4(
    e3: Eagle3Drafter,
    e4_config: Eagle4Config,
    *,
    target_lm_head: Tensor,
    fit_tokens: Tensor | None,
    fit_aux: list[Tensor] | None = None,
    fit_attention_mask: Tensor | None = None,
    fit_steps: int = 3,
    residual_weight: float = 1.0,
    ridge: float = RIDGE,
    seed: int = 0,
    attn_backend: str = "chunked",
) -> tuple[Eagle4Drafter, ConversionReport]:
    """Initialise an EAGLE-4 drafter from ``e3`` (see the module docstring for every choice).

    target_lm_head [V, H]: the target's LM head (rows outside the draft vocabulary).
    fit_tokens [B, T] token ids with fit_aux 3 x [B, T, H], the target's captured states for them
    (and optionally fit_attention_mask [B, T]): samples EAGLE-3 is run on for the fit. fit_tokens
    without fit_aux uses random hidden states; None uses synthetic samples throughout.
    ``residual_weight`` weighs the residual block against each of q, k, v in the fit; ``ridge`` is
    its regularisation (see ``RIDGE``). ``e3`` is
    cast to fp32 and run in eval mode (its training mode is restored).
    """
    check_compatible(e3.config, e4_config)
    if fit_aux is not None and fit_tokens is None:
        raise ValueError("eagle3_to_eagle4: fit_aux needs the fit_tokens it was captured on.")
    c3, h = e3.config, e4_config.hidden_size
    was_training = e3.training
    e3 = e3.float().eval()
    torch.manual_seed(seed)
    e4 = Eagle4Drafter(e4_config, attn_backend=attn_backend).float().eval()
    s3, s4 = e3.state_dict(), e4.state_dict()
    report = ConversionReport()
    done3: set[str] = set()
    for name in TARGET_FIELDS:  # not checked equal above: EAGLE-4's value wins, and the report says so
        report.config.append((name, getattr(c3, name), getattr(e4_config, name)))
    if c3.rope_theta != e4_config.rope_theta and not e4_config.nope:
        report.notes.append(f"RoPE base {e4_config.rope_theta:g} replaces EAGLE-3's {c3.rope_theta:g}: the fitted q/k "
                            f"see other rotations at every position but 0, so attention scores change")

    def load(key4: str, key3: str | tuple[str, ...], value: Tensor | None = None, detail: str = "verbatim") -> None:
        keys3 = (key3,) if isinstance(key3, str) else key3
        s4[key4].copy_(s3[keys3[0]] if value is None else value)
        report.loaded.append(Entry(key4, tuple(s4[key4].shape), detail, keys3))
        done3.update(keys3)

    def init(key4: str, value: Tensor | None, detail: str) -> None:
        if value is not None:
            s4[key4].copy_(value)
        report.initialised.append(Entry(key4, tuple(s4[key4].shape), detail))

    def drop(key3: str, detail: str) -> None:
        report.dropped.append(Entry(key3, tuple(s3[key3].shape), detail))
        done3.add(key3)

    # Samples: EAGLE-3 run on the fit inputs (or synthetic inputs).
    if fit_tokens is None:
        n = max(8 * h, 512)
        fit_tokens = torch.randint(0, c3.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
        report.notes.append("no fit samples: eh_proj/q/k/v fitted on synthetic inputs (random tokens, unit-RMS "
                            "Gaussian hidden); pass fit_tokens + fit_aux from the target for a better start")
    synthetic_aux = fit_aux is None
    if synthetic_aux:
        gen = torch.Generator().manual_seed(seed + 1)
        fit_aux = [torch.randn(*fit_tokens.shape, h, generator=gen) for _ in range(3)]
    fit_aux = [a.float() for a in fit_aux]
    steps = collect_eagle3_samples(e3, fit_tokens, fit_aux, fit_attention_mask, fit_steps)
    report.metrics["fit_samples"] = float(flat_samples(steps, "g").shape[0])

    # Embedding, fusion.
    load("embed_tokens.weight", "embed_tokens.weight", detail="the target's embedding (frozen)")
    if e4.fc_norms is not None and e3.fc_norms is not None:
        for j in range(3):
            load(f"fc_norms.{j}.weight", f"fc_norms.{j}.weight")
        load("fc.weight", "fc.weight")
    elif e4.fc_norms is not None:
        load("fc.weight", "fc.weight")
        for j, a in enumerate(fit_aux):
            if synthetic_aux:
                init(f"fc_norms.{j}.weight", torch.ones(h), "ones (EAGLE-3 had no fc_norm; no samples for its scale)")
            else:
                scale = float(a.pow(2).mean(-1).sqrt()[_valid_or_all(fit_attention_mask, a)].mean())
                init(f"fc_norms.{j}.weight", torch.full((h,), scale),
                     f"mean RMS of captured state {j} ({scale:.3g}): fc(cat(s_j h_j/rms(h_j))) ~ EAGLE-3's fc(cat(h_j))")
        if synthetic_aux:
            report.notes.append("EAGLE-4 RMS-normalises the three captured states (fc_norm) and EAGLE-3 did not: "
                                "with fc_norm weights 1 the relative scale of the three inputs to fc changes")
    else:
        w = s3["fc.weight"].clone()
        if e3.fc_norms is not None:  # EAGLE-3.1 normalised, EAGLE-4 does not: fold weight / mean RMS into fc
            for j, a in enumerate(fit_aux):
                scale = a.pow(2).mean(-1).sqrt().mean()
                w[:, j * h:(j + 1) * h] *= s3[f"fc_norms.{j}.weight"][None] / scale
                drop(f"fc_norms.{j}.weight", "folded into fc (divided by the captured state's mean RMS)")
        load("fc.weight", "fc.weight", w, "verbatim" if e3.fc_norms is None else "fc_norms folded in")
    if e4_config.fc_post_norm:
        init("fc_post_norm.weight", torch.ones(h), "ones: invisible downstream (hidden_norm is scale-invariant)")
    load("embed_norm.weight", "layer.input_layernorm.weight", detail="EAGLE-3's norm on the embedding")
    load("hidden_norm.weight", "layer.hidden_norm.weight")
    load("norm.weight", "norm.weight")  # before the fit: EAGLE-4's feedback norm(x) enters its samples

    # eh_proj, pre-attention norm, q/k/v: the reduced-rank fit.
    a4 = e4_attention_inputs(e4, steps, fit_aux).double()
    a3 = flat_samples(steps, "a").double()
    attn3 = e3.layer.self_attn
    qkv = [a3 @ getattr(attn3, n).weight.double().T for n in ("q_proj", "k_proj", "v_proj")]
    eh, qkv_w, errors = fit_attention_input(a4, qkv, flat_samples(steps, "g").double(), e4_config.rms_norm_eps,
                                            residual_weight, ridge)
    report.metrics.update(errors)
    init("eh_proj.weight", eh.float(), "reduced-rank fit: z = eh_proj(a') ~ EAGLE-3 residual g; carries q/k/v inputs")
    if e4_config.pre_attn_norm:
        init("layer.input_layernorm.weight", torch.ones(h), "ones (its scale is absorbed by the q/k/v fit)")
    else:
        report.notes.append("pre_attn_norm is off: q/k/v were fitted on RMSNorm(z) but read z directly")
    for name, w in zip(("q_proj", "k_proj", "v_proj"), qkv_w):
        init(f"layer.self_attn.{name}.weight", w.float(), f"least squares from RMSNorm(z) to EAGLE-3's {name}(a)")
        drop(f"layer.self_attn.{name}.weight", "reads 2H: folded into the eh_proj + q/k/v fit")
    load("layer.self_attn.o_proj.weight", "layer.self_attn.o_proj.weight")
    load("layer.post_attention_layernorm.weight", "layer.post_attention_layernorm.weight")
    if e4_config.nope:
        report.notes.append("EAGLE-4 uses NoPE; EAGLE-3's q/k were trained with RoPE (attention scores change)")
    if e4_config.sliding_window is not None:
        report.notes.append(f"EAGLE-4 attends a sliding window of {e4_config.sliding_window} step-0 keys; EAGLE-3 "
                            f"attended the full causal context (identical for contexts up to the window)")

    # MLP: dense copy, or sparse upcycling.
    mlp_keys = [f"layer.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    if not e4_config.moe:
        for key in mlp_keys:
            load(key, key)
    else:
        _upcycle(e3, e4, e4_config, s4, steps, synthetic_aux, report, load, init)

    # LM head.
    head, level = _expand_lm_head(e3, target_lm_head, e3.norm(flat_samples(steps, "x")))
    load("lm_head.weight", "lm_head.weight", head,
         f"rows i + d2t[i] from EAGLE-3's {c3.draft_vocab_size} rows; the other "
         f"{c3.vocab_size - c3.draft_vocab_size} score ~{level:.3g} (median draft logit - {NON_DRAFT_LOGIT_MARGIN:g})")
    drop("d2t", "EAGLE-4 drafts over the full vocabulary (used to place lm_head rows)")
    drop("t2d", "EAGLE-4 drafts over the full vocabulary (used to place lm_head rows)")
    e4.load_state_dict(s4)
    if isinstance(e4.lm_head, EfficientLMHead):
        e4.lm_head.init_scorer()
        for key in ("lm_head.down", "lm_head.up"):
            init(key, None, f"truncated SVD (rank {e4_config.lm_head_rank}) of the expanded lm_head.weight")

    left3 = sorted(set(s3) - done3)
    assert not left3, f"EAGLE-3 keys neither loaded nor dropped: {left3}"
    listed = [e.key for e in report.loaded + report.initialised]
    assert sorted(listed) == sorted(e4.state_dict()), (sorted(listed), sorted(e4.state_dict()))
    e3.train(was_training)
    return e4, report


def _valid_or_all(mask: Tensor | None, a: Tensor) -> Tensor:
    return mask.bool() if mask is not None else torch.ones(a.shape[:-1], dtype=torch.bool)


# Rows of tokens outside EAGLE-3's draft vocabulary score this far below the median draft logit (on the fit
# samples): measured on SmolLM2 (CPU, an EAGLE-3 of acc_0 0.180), 2 below the median kept acc_0 at 0.180 with the
# lowest KL to the target (4.47); the target's lm_head rows there won 95% of the argmaxes (acc_0 0.002).
NON_DRAFT_LOGIT_MARGIN = 2.0


def _expand_lm_head(e3: Eagle3Drafter, target_lm_head: Tensor, normed: Tensor) -> tuple[Tensor, float]:
    """[Vd, H] draft head -> [V, H]: row i + d2t[i] = draft row i; every other row ``c * mu / |mu|^2``, mu the mean
    of EAGLE-3's normed states ``normed`` [N, H], so those tokens score ~c (like a bias: the head has none),
    c = the median draft logit on ``normed`` - NON_DRAFT_LOGIT_MARGIN. EAGLE-3 never proposes them, and
    they keep the softmax mass low. -> (head, c)."""
    c3 = e3.config
    if tuple(target_lm_head.shape) != (c3.vocab_size, c3.hidden_size):
        raise ValueError(f"eagle3_to_eagle4: target_lm_head has shape {tuple(target_lm_head.shape)}, expected "
                         f"[vocab_size, hidden_size] = [{c3.vocab_size}, {c3.hidden_size}] (EAGLE-3's config).")
    rows = e3.lm_head.weight.detach().float().cpu()
    normed = normed.detach().float().cpu()
    mu = normed.mean(0)
    sample = normed[:: max(1, normed.shape[0] // 2048)]  # the median over <= ~2K positions x Vd logits
    level = float((sample @ rows.T).median()) - NON_DRAFT_LOGIT_MARGIN
    head = (level * mu / mu.pow(2).sum().clamp(min=1e-12)).expand(c3.vocab_size, -1).clone()
    head[e3.draft_target_ids().cpu()] = rows
    return head, level


def _upcycle(e3, e4, c4: Eagle4Config, s4, steps, synthetic_aux: bool, report: ConversionReport, load, init) -> None:
    """Dense EAGLE-3 MLP -> every MoE expert (sparse upcycling)."""
    moe: MoEMLP = e4.layer.mlp
    num, k = c4.moe_num_experts, c4.moe_top_k
    for e in range(num):
        moe.load_expert(e, e3.layer.mlp)
    if not c4.moe_norm_topk_prob:
        moe.down.mul_(num / k)  # expected routed weight sum is k/E under near-uniform routing
        report.notes.append(f"moe_norm_topk_prob is off: experts' down scaled by E/k = {num / k:g} so the expected "
                            f"routed sum equals the dense MLP")
    gate, up, down = ("layer.mlp.gate_proj.weight", "layer.mlp.up_proj.weight", "layer.mlp.down_proj.weight")
    load("layer.mlp.gate_up", (gate, up), moe.gate_up.detach().clone(), f"dense gate_proj/up_proj in all {num} experts")
    load("layer.mlp.down", down, moe.down.detach().clone(),
         f"dense down_proj in all {num} experts" + ("" if c4.moe_norm_topk_prob else " (x E/k)"))
    router = torch.randn(num, c4.hidden_size, generator=torch.Generator().manual_seed(0)) * 1e-3
    init("layer.mlp.router.weight", router, "small random (std 1e-3): near-uniform routing, ties broken per token")
    init("layer.mlp.route_bias", torch.zeros(num), "zeros: no routing preference (loss-free balancing moves it)")
    if c4.moe_shared_expert:
        dense = e3.layer.mlp
        load("layer.mlp.shared_expert.gate_proj.weight", "layer.mlp.gate_proj.weight", detail="dense gate_proj")
        load("layer.mlp.shared_expert.up_proj.weight", "layer.mlp.up_proj.weight", detail="dense up_proj")
        init("layer.mlp.shared_expert.down_proj.weight", torch.zeros_like(dense.down_proj.weight),
             "zeros: the shared expert adds nothing at the start")
    if c4.moe_extra_norm:
        if synthetic_aux:
            init("layer.mlp.output_norm.weight", torch.ones(c4.hidden_size), "ones (no samples for the MLP output scale)")
            report.notes.append("moe_extra_norm RMS-normalises the MoE output; without fit samples its weight is 1, "
                                "so the MLP update's scale differs from EAGLE-3's dense MLP")
        else:
            scale = float(flat_samples(steps, "mlp").pow(2).mean(-1).sqrt().mean())
            init("layer.mlp.output_norm.weight", torch.full((c4.hidden_size,), scale),
                 f"mean RMS of EAGLE-3's MLP output ({scale:.3g}): RMSNorm(moe) ~ dense MLP")


__all__ = ["ConversionReport", "Entry", "check_compatible", "eagle3_to_eagle4", "format_report"]
