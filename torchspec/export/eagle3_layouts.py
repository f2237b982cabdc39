"""EAGLE-3 checkpoint layouts of the field: torchspec's ``Eagle3Drafter`` <-> SGLang / vLLM.

Two layouts, each a ``config.json`` + ``model.safetensors`` pair (``save_layout`` / ``load_layout``):

``"sglang"`` -- the SpecForge / SGLang layout (``LlamaForCausalLMEagle3``)
    weights  ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
             ``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
             ``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, optional
             ``embed_tokens.weight``. (sglang ``python/sglang/srt/models/llama_eagle3.py``: the
             loader prefixes ``model.`` to everything but ``lm_head``; ``d2t`` becomes
             ``hot_token_id = d2t + arange`` -- offsets; ``t2d`` is skipped; names it does not know
             are skipped silently, which is why this module checks them.)
    config   a flat Llama config: ``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``,
             ``draft_vocab_size``, ``target_hidden_size`` (fc input is 3 * target_hidden_size), and
             ``eagle_config: {"eagle_aux_hidden_state_layer_ids": [...], "use_aux_hidden_state": true}``.
             SGLang reads the ids only from ``eagle_config`` (``model_executor/model_runner.py``:
             ``eagle_config["eagle_aux_hidden_state_layer_ids"]``), SpecForge likewise
             (``set_aux_hidden_states_layers(draft_model_config.eagle_config[...])``).

``"vllm"`` -- the RedHat ``speculators`` layout, which vLLM detects by ``speculators_model_type``
    weights  ``layers.0.*`` instead of ``midlayer.*``, the rest as above (vllm
             ``vllm/model_executor/models/llama_eagle3.py``: ``LlamaModel.load_weights`` also maps
             ``midlayer.`` -> ``layers.0.``; ``d2t`` -> ``draft_id_to_target_id``, used as offsets in
             ``compute_logits``: ``targets = arange(Vd) + draft_id_to_target_id``; ``t2d`` skipped;
             ``embed_tokens`` optional; unknown names fail in ``AutoWeightsLoader``).
    config   ``architectures: ["Eagle3Speculator"]``, ``speculators_model_type: "eagle3"``, the layer's
             Llama config under ``transformer_layer_config``, top-level ``draft_vocab_size``,
             ``target_hidden_size``, ``norm_before_residual``, ``eagle_aux_hidden_state_layer_ids``, and
             ``speculators_config`` (algorithm, proposal_methods[0].speculative_tokens, verifier.name_or_path:
             required by vllm ``transformers_utils/configs/speculators/base.py``). vLLM's eagle3 updater
             (``.../speculators/algos.py``) defaults a MISSING ``norm_before_residual`` to True, so it is
             always written (False: torchspec's residual is the un-normalised incoming hidden).
             vLLM reads aux ids from the top-level key, newer versions also from ``eagle_config``
             (``v1/worker/gpu_model_runner.py: _get_eagle3_aux_layers_from_config``).

Aux layer ids (contract 1: torchspec id i = residual stream after decoder layer i). Both engines
capture ``hidden_states + residual`` on ENTRY to target layer j (sglang ``models/llama.py``, vllm
``models/llama.py``: ``if idx in aux_hidden_state_layers: aux.append(hidden_states + residual)``
before calling layer idx), i.e. the output of layer j - 1. SGLang's ``set_eagle3_layers_to_capture``
adds 1 to the configured ids (``layers_to_capture = [val + 1 for val in layer_ids]``), so an SGLang id
equals the torchspec id. vLLM uses the ids unshifted, so vLLM id j = torchspec id j - 1. Consequences:
the same number means different layers in the two engines; torchspec id L - 1 (the last layer's output)
is captured by neither engine (no layer L to enter) and is refused; vLLM id 0 (the embedding output) has
no torchspec id and is refused. With no explicit ids both engines use entries (2, L//2, L-3), i.e.
torchspec [1, L//2 - 1, L - 4]; exports always write the ids explicitly.

Vocab mapping (contract 7): every engine reads ``d2t`` as offsets (target id = i + d2t[i]), exactly
torchspec's buffer, so d2t/t2d travel bit for bit. Neither engine stores the target's layer count;
exports add ``"torchspec": {"target_num_layers": L}`` (engines ignore it) and imports of foreign
checkpoints take ``target_num_layers=`` instead.

EAGLE-3.1 flags. Neither upstream engine model file above reads ``fc_norm`` (per-stream RMSNorm
before fc) or ``norm_output`` (normalised feedback); a checkpoint carrying them would be served as plain
EAGLE-3 (SGLang drops unknown weights silently) -- so both are refused on export and import. vLLM's
``norm_before_fc`` (one RMSNorm over the 3H concatenation) is a different operation, not fc_norm.

Import reads ``config.json`` strictly in ``eagle3_layout_config`` (no weight is read there) and the
weights here (``_build``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from torchspec.cli import check_safetensors, read_json
from torchspec.export.eagle3_layout_config import (
    CONFIG_PARSERS,
    eagle3_config,
    parse_sglang_config,
    parse_vllm_config,
)
from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter

LAYOUTS = ("sglang", "vllm")

# --- key renames: torchspec name -> engine name (data, not code) ---------------------------------

_LAYER_PARAMS = (
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
_SAME_NAME = ("embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
_LAYER_PREFIX = {"sglang": "midlayer.", "vllm": "layers.0."}
KEY_RENAMES: dict[str, dict[str, str]] = {
    layout: {**{f"layer.{p}": prefix + p for p in _LAYER_PARAMS}, **{k: k for k in _SAME_NAME}}
    for layout, prefix in _LAYER_PREFIX.items()
}
# Prefixes a loader also accepts, as the engine's own loader does (vLLM maps ``midlayer.`` -> ``layers.0.``).
KEY_ALIASES: dict[str, dict[str, str]] = {"sglang": {}, "vllm": {"midlayer.": "layers.0."}}
EMBED_KEY = "embed_tokens.weight"  # optional in both engines (they share the target's embedding)


# --- export -----------------------------------------------------------------------------------------


def _check_exportable(drafter: Eagle3Drafter, layout: str) -> None:
    cfg = drafter.config
    flags = [name for name in ("fc_norm", "norm_output") if getattr(cfg, name)]
    if flags:
        raise ValueError(
            f"to_{layout}: the drafter sets EAGLE-3.1 flags {flags}, which the {layout} EAGLE-3 layout "
            f"cannot express (the engine's llama_eagle3.py reads neither fc_norm nor norm_output and would "
            f"serve a different network). Export it in torchspec's own format instead."
        )
    num_layers = cfg.target_num_layers
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i < num_layers - 1]
    if bad:
        raise ValueError(
            f"to_{layout}: aux_layer_ids {bad} cannot be captured by the engine: it captures the residual "
            f"stream on entry to a layer, so only outputs of layers 0..{num_layers - 2} of the "
            f"{num_layers}-layer target exist for it."
        )


def _export_state_dict(drafter: Eagle3Drafter, layout: str, include_embedding: bool) -> dict[str, torch.Tensor]:
    renames = KEY_RENAMES[layout]
    state = drafter.state_dict()
    unknown = sorted(set(state) - set(renames))
    assert not unknown, f"no {layout} name for torchspec keys {unknown}"
    return {renames[k]: v.detach() for k, v in state.items() if include_embedding or k != EMBED_KEY}


def _llama_layer_config(cfg: Eagle3Config) -> dict[str, Any]:
    """The decoder layer as a Llama config dict (what both engines build their layer from)."""
    return {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def to_sglang(drafter: Eagle3Drafter, include_embedding: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Drafter -> (state_dict, config_dict) in the SpecForge / SGLang layout (see module docstring)."""
    _check_exportable(drafter, "sglang")
    cfg = drafter.config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        # SGLang adds 1 to these ids itself, so they are torchspec's ids unchanged.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True},
        "torchspec": {"target_num_layers": cfg.target_num_layers},
    }
    return _export_state_dict(drafter, "sglang", include_embedding), config


def to_vllm(drafter: Eagle3Drafter, include_embedding: bool = True, speculative_tokens: int = 3,
            verifier: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Drafter -> (state_dict, config_dict) in the speculators layout vLLM loads (see module docstring).
    ``speculative_tokens`` and ``verifier`` (the target's name or path) only fill the serving defaults
    vLLM requires in ``speculators_config``; they are not part of the drafter."""
    _check_exportable(drafter, "vllm")
    cfg = drafter.config
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _llama_layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": False,
        # vLLM uses these ids unshifted (entry of layer j = output of layer j - 1).
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "torchspec": {"target_num_layers": cfg.target_num_layers},
    }
    return _export_state_dict(drafter, "vllm", include_embedding), config


# --- import (config.json: eagle3_layout_config) -----------------------------------------------------


def from_sglang(state_dict: dict[str, torch.Tensor], config: dict, target_num_layers: int | None = None,
                embed_weight: torch.Tensor | None = None) -> Eagle3Drafter:
    """SpecForge / SGLang (state_dict, config_dict) -> Eagle3Drafter, strictly (see ``_build``)."""
    fields, aux, num_layers = parse_sglang_config(config, target_num_layers)
    return _build(fields, config, aux, num_layers, state_dict, "sglang", embed_weight)


def from_vllm(state_dict: dict[str, torch.Tensor], config: dict, target_num_layers: int | None = None,
              embed_weight: torch.Tensor | None = None) -> Eagle3Drafter:
    """speculators / vLLM (state_dict, config_dict) -> Eagle3Drafter, strictly (see ``_build``)."""
    fields, aux, num_layers = parse_vllm_config(config, target_num_layers)
    return _build(fields, config, aux, num_layers, state_dict, "vllm", embed_weight)


def _build(fields: dict[str, Any], config: dict, aux: list[int], num_layers: int,
           state_dict: dict[str, torch.Tensor], layout: str, embed_weight: torch.Tensor | None) -> Eagle3Drafter:
    where = f"from_{layout}"
    cfg = eagle3_config(fields, config, aux, num_layers, where)
    draft_vocab = cfg.draft_vocab_size

    # Engine names -> torchspec names; report problems in the engine's names (what the file holds).
    to_internal = {engine: ours for ours, engine in KEY_RENAMES[layout].items()}
    for alias, prefix in KEY_ALIASES[layout].items():
        for key in [k for k in state_dict if k.startswith(alias)]:
            canonical = prefix + key[len(alias):]
            if canonical in state_dict:
                raise ValueError(f"{where}: both {key} and {canonical} are present (the same weight twice).")
            state_dict = {**state_dict, canonical: state_dict[key]}
            del state_dict[key]
    unknown = sorted(set(state_dict) - set(to_internal))
    state = {to_internal[k]: v for k, v in state_dict.items() if k in to_internal}
    if EMBED_KEY not in state and embed_weight is not None:
        state[EMBED_KEY] = embed_weight
    if "d2t" not in state and "t2d" not in state and draft_vocab == cfg.vocab_size:
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)  # full vocabulary: identity mapping
        state["t2d"] = torch.ones(draft_vocab, dtype=torch.bool)

    for name, size, field in (("d2t", draft_vocab, "draft_vocab_size"), ("t2d", cfg.vocab_size, "vocab_size")):
        if name in state and tuple(state[name].shape) != (size,):
            raise ValueError(f"{where}: vocab mapping {name} has shape {tuple(state[name].shape)} but the config's "
                             f"{field}={size}; the mapping and the config disagree.")

    model = Eagle3Drafter(cfg)
    expected = model.state_dict()
    missing = sorted(KEY_RENAMES[layout][k] for k in set(expected) - set(state))
    shapes = sorted(f"{KEY_RENAMES[layout][k]} {tuple(v.shape)} (expected {tuple(expected[k].shape)})"
                    for k, v in state.items() if k in expected and v.shape != expected[k].shape)
    problems = [f"{label} {items}" for label, items in
                (("unknown keys", unknown), ("missing keys", missing), ("mis-shaped keys", shapes)) if items]
    if problems:
        hint = " (pass embed_weight= the target's embedding)" if KEY_RENAMES[layout][EMBED_KEY] in missing else ""
        raise ValueError(f"{where}: {'; '.join(problems)}{hint}.")

    float_dtypes = {v.dtype for k, v in state.items() if v.is_floating_point()}
    if len(float_dtypes) != 1:
        raise ValueError(f"{where}: weights mix dtypes {sorted(map(str, float_dtypes))}; export one dtype.")
    model.to(float_dtypes.pop())  # keep the checkpoint's dtype, so loading copies bit for bit
    model.load_state_dict(state)  # checks the vocab mapping (check_vocab_mapping) and locks it
    return model.eval()


# --- files ------------------------------------------------------------------------------------------

_TO = {"sglang": to_sglang, "vllm": to_vllm}
_FROM = {"sglang": from_sglang, "vllm": from_vllm}


def detect_layout(config: dict, where: str = "config.json") -> str:
    """Which layout a config.json belongs to: ``speculators_model_type`` -> vllm,
    ``LlamaForCausalLMEagle3`` -> sglang."""
    if "speculators_model_type" in config:
        return "vllm"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
        return "sglang"
    own = str(config.get("model_type", "")).startswith("torchspec_")
    raise ValueError(f"{where} is neither speculators (speculators_model_type) nor SGLang (architectures "
                     f"LlamaForCausalLMEagle3) but architectures={config.get('architectures')}"
                     + ("; it is torchspec's own format: load it as that (torchspec-convert --layout torchspec)."
                        if own else "; pass an EAGLE-3 checkpoint of one of the layouts."))


def save_layout(drafter: Eagle3Drafter, out_dir: str | Path, layout: str = "sglang", **kwargs: Any) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of ``layout`` to ``out_dir``; ``kwargs`` go to
    ``to_<layout>`` (include_embedding, and for vllm speculative_tokens, verifier)."""
    if layout not in LAYOUTS:
        raise ValueError(f"save_layout: layout={layout!r}, expected one of {LAYOUTS}.")
    state, config = _TO[layout](drafter, **kwargs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _read_dir(path: Path, layout: str | None) -> tuple[dict, str]:
    """config.json of a layout directory and its layout; the weights file's header is checked too. Every
    problem (no directory, a missing, garbled or truncated file, another layout) names the file."""
    fix = (f"pass a directory holding an EAGLE-3 checkpoint in the {layout or 'sglang or vllm'} layout "
           f"(config.json + model.safetensors)")
    if not path.is_dir():
        raise ValueError(f"{path} {'is a file' if path.exists() else 'does not exist'}; {fix}.")
    config = read_json(path / "config.json", fix + ".")
    detected = detect_layout(config, str(path / "config.json"))
    if layout is not None and layout != detected:
        raise ValueError(f"load_layout: asked for layout={layout!r} but {path}/config.json is {detected!r}; "
                         f"pass --layout {detected}.")
    check_safetensors(path / "model.safetensors", fix + ".")
    return config, detected


def read_layout_config(path: str | Path, layout: str | None = None,
                       target_num_layers: int | None = None) -> Eagle3Config:
    """The drafter config of a layout directory, strictly, without reading a weight: what a caller checks
    (against the target) before anything large loads."""
    path = Path(path)
    config, detected = _read_dir(path, layout)
    where = str(path / "config.json")
    fields, aux, num_layers = CONFIG_PARSERS[detected](config, target_num_layers, where)
    return eagle3_config(fields, config, aux, num_layers, where)


def load_layout(path: str | Path, layout: str | None = None, **kwargs: Any) -> Eagle3Drafter:
    """Read a ``save_layout`` directory (or a field checkpoint of either layout); ``layout=None``
    detects it from config.json. ``kwargs`` go to ``from_<layout>`` (target_num_layers, embed_weight)."""
    path = Path(path)
    config, detected = _read_dir(path, layout)
    return _FROM[detected](load_file(path / "model.safetensors"), config, **kwargs)
