"""An EAGLE-3 layout's ``config.json`` -> ``Eagle3Config``, strictly: the config half of the import in
``eagle3_layouts`` (which describes both layouts, the engines' aux-id conventions and why EAGLE-3.1 flags
are refused).

Every key of a field config is either interpreted, on a short list of keys with no architecture meaning
(ignored), or refused by name (contract 6). ``parse_sglang_config`` / ``parse_vllm_config`` return the
Llama layer's ``Eagle3Config`` fields, the torchspec aux ids and the target's layer count;
``eagle3_config`` completes them into the drafter config. Nothing here reads a weight, so a caller can
check a checkpoint against its target before anything large loads.
"""

from __future__ import annotations

from typing import Any

from torchspec.models.eagle3 import Eagle3Config

# Config keys of the field that carry no architecture meaning for an EAGLE-3 drafter; accepted and
# ignored on import. Anything else this module does not interpret is refused by name (contract 6).
_IGNORED_CONFIG_KEYS = {
    "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "transformers_version",
    "initializer_range", "use_cache", "pretraining_tp", "attention_dropout", "_name_or_path",
    "embed_requires_grad", "enable_sp_ulysses", "speculators_version", "num_aux_hidden_states",
}
_UNSUPPORTED_FLAGS = ("fc_norm", "norm_output", "norm_before_fc")


def _refuse_unknown(keys: set[str], known: set[str], where: str) -> None:
    unknown = sorted(keys - known - _IGNORED_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown config keys {unknown}; torchspec does not know what they change "
                         f"in the network, so it will not load the checkpoint while ignoring them.")


def _refuse_flags(config: dict, where: str) -> None:
    on = [name for name in _UNSUPPORTED_FLAGS if config.get(name)]
    if on:
        raise ValueError(f"{where}: flags {on} are set; torchspec's EAGLE-3 import supports plain EAGLE-3 only "
                         f"(the SGLang/vLLM layouts carry no torchspec-equivalent fc_norm/norm_output).")


_LLAMA_KEYS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "max_position_embeddings", "attention_bias", "mlp_bias", "tie_word_embeddings",
    *_UNSUPPORTED_FLAGS,
}


def _parse_llama_layer(layer: dict, where: str) -> dict[str, Any]:
    """Llama config dict of the one decoder layer -> Eagle3Config fields, refusing what torchspec's
    layer cannot reproduce."""
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
    missing = [k for k in required if layer.get(k) is None]
    if missing:
        raise ValueError(f"{where}: missing config keys {missing}.")
    _refuse_flags(layer, where)
    checks = {
        "model_type": (layer.get("model_type", "llama"), "llama"),
        "num_hidden_layers": (layer.get("num_hidden_layers", 1), 1),
        "hidden_act": (layer.get("hidden_act", "silu"), "silu"),
        "attention_bias": (bool(layer.get("attention_bias", False)), False),
        "mlp_bias": (bool(layer.get("mlp_bias", False)), False),
        "tie_word_embeddings": (bool(layer.get("tie_word_embeddings", False)), False),
    }
    wrong = {k: got for k, (got, want) in checks.items() if got != want}
    if wrong:
        raise ValueError(f"{where}: unsupported values {wrong}; torchspec's EAGLE-3 drafter is one Llama layer "
                         f"(silu MLP, no biases, untied head).")
    rope_theta = layer.get("rope_theta")
    for rope in (layer.get("rope_scaling"), layer.get("rope_parameters")):
        if rope:
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raise ValueError(f"{where}: rope {rope} is not default RoPE; torchspec's drafter has no scaling.")
            rope_theta = rope.get("rope_theta", rope_theta)
    heads = layer["num_attention_heads"]
    return {
        "vocab_size": layer["vocab_size"],
        "hidden_size": layer["hidden_size"],
        "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": layer.get("num_key_value_heads") or heads,
        "head_dim": layer.get("head_dim") or layer["hidden_size"] // heads,
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
        "rope_theta": 10000.0 if rope_theta is None else rope_theta,
        "max_position_embeddings": layer.get("max_position_embeddings", 4096),
    }


def _target_num_layers(config: dict, target_num_layers: int | None, where: str) -> int:
    stored = (config.get("torchspec") or {}).get("target_num_layers")
    if stored is not None and target_num_layers is not None and stored != target_num_layers:
        raise ValueError(f"{where}: config says target_num_layers={stored} but {target_num_layers} was passed.")
    num_layers = stored if stored is not None else target_num_layers
    if num_layers is None:
        raise ValueError(f"{where}: the checkpoint does not record the target's layer count; pass "
                         f"target_num_layers= (the target config's num_hidden_layers) to place its aux ids.")
    return num_layers


def _aux_ids(engine_ids: list[int] | None, shift: int, num_layers: int, where: str) -> list[int]:
    """Engine ids -> torchspec ids (torchspec = engine - shift); no ids -> the engines' shared default."""
    if not engine_ids:
        engine_ids = [1 + shift, num_layers // 2 - 1 + shift, num_layers - 4 + shift]
    ids = [int(j) - shift for j in engine_ids]
    bad = [j for j, i in zip(engine_ids, ids) if not 0 <= i < num_layers]
    if bad or len(ids) != 3 or sorted(set(ids)) != ids:
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {list(engine_ids)} (torchspec ids {ids}) "
                         f"must be 3 distinct increasing outputs of layers 0..{num_layers - 1}; offending {bad}.")
    return ids


def parse_sglang_config(config: dict, target_num_layers: int | None,
                        where: str = "from_sglang") -> tuple[dict, list[int], int]:
    """SpecForge / SGLang config -> (layer fields, torchspec aux ids, target layer count); SGLang's
    ids are torchspec's unchanged."""
    known = _LLAMA_KEYS | {"architectures", "draft_vocab_size", "target_hidden_size", "eagle_config", "torchspec"}
    _refuse_unknown(set(config), known, where)
    if "LlamaForCausalLMEagle3" not in (config.get("architectures") or []):
        raise ValueError(f"{where}: architectures={config.get('architectures')}, expected LlamaForCausalLMEagle3.")
    fields = _parse_llama_layer(config, where)
    eagle = config.get("eagle_config") or {}
    _refuse_unknown(set(eagle), {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"}, f"{where} eagle_config")
    if not eagle.get("use_aux_hidden_state", True):
        raise ValueError(f"{where}: eagle_config.use_aux_hidden_state=false (EAGLE-1 style), not EAGLE-3.")
    num_layers = _target_num_layers(config, target_num_layers, where)
    aux = _aux_ids(eagle.get("eagle_aux_hidden_state_layer_ids"), 0, num_layers, where)
    return fields, aux, num_layers


def parse_vllm_config(config: dict, target_num_layers: int | None,
                      where: str = "from_vllm") -> tuple[dict, list[int], int]:
    """speculators / vLLM config -> (layer fields, torchspec aux ids, target layer count); vLLM id j
    is torchspec id j - 1."""
    known = {"architectures", "speculators_model_type", "transformer_layer_config", "draft_vocab_size",
             "target_hidden_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
             "speculators_config", "torchspec", *_UNSUPPORTED_FLAGS}
    _refuse_unknown(set(config), known, where)
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{where}: speculators_model_type={config.get('speculators_model_type')!r}, expected 'eagle3'.")
    _refuse_flags(config, where)
    if config.get("norm_before_residual", True):  # vLLM's default when the key is missing is True
        raise ValueError(f"{where}: norm_before_residual={config.get('norm_before_residual', 'missing -> True')}: the "
                         f"residual is the normalised hidden; torchspec's EAGLE-3 adds the raw hidden.")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: transformer_layer_config must be a dict, got {type(layer).__name__}.")
    _refuse_unknown(set(layer), _LLAMA_KEYS, f"{where} transformer_layer_config")
    fields = _parse_llama_layer(layer, f"{where} transformer_layer_config")
    num_layers = _target_num_layers(config, target_num_layers, where)
    aux = _aux_ids(config.get("eagle_aux_hidden_state_layer_ids"), 1, num_layers, where)
    return fields, aux, num_layers


def eagle3_config(fields: dict[str, Any], config: dict, aux: list[int], num_layers: int, where: str) -> Eagle3Config:
    """The parsed fields completed into the drafter config (a missing draft_vocab_size means the full
    vocabulary, as in both engines); a width other than the target's is refused."""
    hidden = fields["hidden_size"]
    if config.get("target_hidden_size", hidden) != hidden:
        raise ValueError(f"{where}: target_hidden_size={config['target_hidden_size']} != hidden_size={hidden}; "
                         f"torchspec's EAGLE-3 drafter works at the target's width.")
    draft_vocab = config.get("draft_vocab_size") or fields["vocab_size"]  # engines: missing -> full vocab
    return Eagle3Config(**fields, draft_vocab_size=draft_vocab, aux_layer_ids=aux, target_num_layers=num_layers)


CONFIG_PARSERS = {"sglang": parse_sglang_config, "vllm": parse_vllm_config}
