"""The frozen target model: checkpoint resolution, explicit hidden-state capture, tiny test targets."""

from torchspec.target.capture import (
    TargetModel,
    TargetOutput,
    default_aux_layer_ids,
    validate_aux_layer_ids,
)
from torchspec.target.loader import (
    BUILTIN_TARGETS,
    check_checkpoint_dir,
    load_target_config,
    load_tokenizer,
    resolve_target_path,
)
from torchspec.target.tiny import TINY_FLAVOURS, build_tiny_target

__all__ = [
    "BUILTIN_TARGETS",
    "TINY_FLAVOURS",
    "TargetModel",
    "TargetOutput",
    "build_tiny_target",
    "check_checkpoint_dir",
    "default_aux_layer_ids",
    "load_target_config",
    "load_tokenizer",
    "resolve_target_path",
    "validate_aux_layer_ids",
]
