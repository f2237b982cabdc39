"""Strict drafter configs: every architecture flag is documented, written to config.json with
its meaning, and read back; unknown or missing keys are errors that name them (contract 6).

A drafter config subclasses ``StrictDrafterConfig`` and declares ``ARCH_FIELDS``: an ordered
mapping ``name -> Flag(default, meaning, type)``. ``to_dict`` adds ``flag_meanings`` (the same
meanings, for humans and other runtimes reading the export); ``from_dict`` rejects keys it does not
know and keys it needs but does not find, instead of silently dropping or defaulting them.

``ARCH_FIELDS`` is the ONE declaration of an architecture's flags: the training config's
``drafter.*`` keys (``torchspec.config.DrafterConfig``, typed by ``Flag.type``), the mapping from
those keys to the model config (``torchspec.models.drafter_config_from_target``) and the check that
refuses a key the chosen architecture does not use are all derived from it. The fields that come
from the target (``FROM_TARGET``) are not ``drafter.*`` keys.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from transformers import PretrainedConfig

# Keys transformers itself writes into every config.json; they are accepted and ignored.
_HF_BOOKKEEPING = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "auto_map", "flag_meanings", "return_dict", "output_hidden_states", "use_cache", "tie_word_embeddings",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "tokenizer_class", "prefix", "bos_token_id", "pad_token_id", "eos_token_id", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "output_attentions",
    "torchscript", "pruned_heads", "cross_attention_hidden_size", "add_cross_attention",
    "tf_legacy_loss", "use_bfloat16", "_attn_implementation_autoset", "_attn_implementation",
    "_experts_implementation", "is_decoder", "output_scores", "return_dict_in_generate", "_commit_hash",
    "target", "torchspec_export_version", "training",  # written by torchspec-export (checked by its own loader)
}


class Flag(NamedTuple):
    """One architecture flag: its default, its meaning (written to config.json) and its type in the
    training config (default: the default's type; say ``int | None`` where null is allowed)."""

    default: Any
    meaning: str
    type: Any = None

    @property
    def annotation(self) -> Any:
        return self.type if self.type is not None else type(self.default)


# Fields every drafter shares: sizes from the target, positions, and the target's identity. The
# four sizes are drafter.* keys too (null: the target's value); the others always come from the target.
SHARED_ARCH_FIELDS: dict[str, Flag] = {
    "vocab_size": Flag(None, "target vocabulary size V; the frozen embedding covers all of it", int),
    "hidden_size": Flag(None, "drafter width H, equal to the target hidden size", int),
    "num_attention_heads": Flag(None, "query heads of the decoder layer", int | None),
    "num_key_value_heads": Flag(None, "key/value heads of the decoder layer (GQA)", int | None),
    "head_dim": Flag(None, "per-head dimension", int | None),
    "intermediate_size": Flag(None, "SwiGLU MLP inner width", int | None),
    "rms_norm_eps": Flag(1e-6, "epsilon of every RMSNorm"),
    "rope_theta": Flag(10000.0, "RoPE base; positions of TTT step k at base position t are t + k"),
    "max_position_embeddings": Flag(4096, "longest context the drafter is configured for"),
    "aux_layer_ids": Flag(None, "target layers captured, 0-indexed, residual stream AFTER the layer", list),
    "target_num_layers": Flag(None, "decoder layers of the target the drafter was trained on", int),
}
# Shared fields that always come from the target (or the capture), never from a drafter.* key.
FROM_TARGET = ("vocab_size", "hidden_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
               "aux_layer_ids", "target_num_layers")
SHARED_REQUIRED = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "intermediate_size", "aux_layer_ids", "target_num_layers")


class StrictDrafterConfig(PretrainedConfig):
    ARCH_FIELDS: ClassVar[dict[str, Flag]] = {}
    # Fields that must be given explicitly (no sensible default: they come from the target).
    REQUIRED: ClassVar[tuple[str, ...]] = ()
    # transformers' own flag for such configs: without it, 5.17's save_pretrained builds ``type(self)()``
    # to diff against (``_get_generation_parameters``), which a strict config refuses (torchspec-convert
    # failed so on the H200 machine; 5.24 reads the dataclass fields instead).
    has_no_defaults_at_init: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any):
        # transformers >= 5 turns every config subclass into a dataclass with a generated
        # __init__; keep ours, which is what makes ARCH_FIELDS the single source of truth.
        super().__init_subclass__(**kwargs)
        cls.__init__ = StrictDrafterConfig.__init__

    def __init__(self, **kwargs: Any):
        arch = {name: kwargs.pop(name, flag.default) for name, flag in self.ARCH_FIELDS.items()}
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        for name, value in arch.items():
            setattr(self, name, value)
        self.validate()

    def to_diff_dict(self) -> dict[str, Any]:
        """Every key, not a diff against defaults: config.json must hold every architecture flag
        (contract 6), and some transformers versions build the diff from ``type(self)()``, which a
        strict config without its required sizes refuses."""
        return self.to_dict()

    def validate(self) -> None:
        """Checks every drafter shares; subclasses extend it (call super) for their own flags."""
        name = type(self).__name__
        missing = [key for key in self.REQUIRED if getattr(self, key) is None]
        if missing:
            raise ValueError(f"{name}: {missing} must be set (they come from the target and drafter config).")
        # PretrainedConfig keeps unknown kwargs as attributes; they would be written to config.json and
        # make it unloadable (contract 6), so refuse them here.
        unknown = sorted(set(self.to_dict()) - set(self.ARCH_FIELDS) - _HF_BOOKKEEPING)
        if unknown:
            raise ValueError(f"{name}: unknown keys {unknown}; it takes {sorted(self.ARCH_FIELDS)}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{name}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; choose heads that divide."
            )
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"{name}: aux_layer_ids={self.aux_layer_ids} must hold 3 layer ids.")

    @classmethod
    def check_keys(cls, config_dict: dict[str, Any], source: str) -> None:
        keys = set(config_dict)
        unknown = sorted(keys - set(cls.ARCH_FIELDS) - _HF_BOOKKEEPING)
        missing = sorted(set(cls.ARCH_FIELDS) - keys)
        problems = []
        if unknown:
            problems.append(f"unknown keys {unknown}")
        if missing:
            problems.append(f"missing keys {missing}")
        if problems:
            raise ValueError(
                f"{cls.__name__} from {source}: {' and '.join(problems)}. This config was written by a "
                f"different torchspec version or edited by hand; fix the keys (see the config "
                f"reference in docs/configuration.md) rather than relying on defaults."
            )

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any):
        cls.check_keys(config_dict, source="config dict")
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["flag_meanings"] = {name: flag.meaning for name, flag in self.ARCH_FIELDS.items()}
        return out
