"""The ONE target decoder (training capture and serving), its families, TP, loading and tiny test targets.

    model.py    TargetDecoder: embedding -> family layers (pluggable attend) -> final norm; lm_head;
                capture() for training, forward(..., PagedAttend) for serving; TP over a process group
    llama.py    the Llama-family layer (llama, mistral, qwen2, qwen3): FAMILIES table and TP_PLAN
    hybrid.py   the hybrid Gated-DeltaNet family (qwen3_next, qwen3_5): GDN / gated attention layers, MoE
    gdn_ops.py  GDN's causal conv and gated delta rule (step, chunked torch reference, fla dispatch)
    layers.py   RMSNorms and the row-parallel linear every family shares; TP styles
    rope.py     RoPE tables (default, linear, dynamic, llama3, yarn; partial rotary), bit-equal to transformers
    capture.py  aux layer id contract, TargetOutput, the dense (training) attend
    loader.py   checkpoint resolution (dir, .gguf, alias), config/tokenizer, TP size check, sharded loading
    tiny.py     tiny random targets for tests
"""

from torchspec.targets.capture import (
    DenseAttend,
    TargetOutput,
    default_aux_layer_ids,
    dense_attend,
    validate_aux_layer_ids,
)
from torchspec.targets.loader import (
    BUILTIN_TARGETS,
    check_checkpoint_dir,
    check_tp_size,
    load_target_config,
    load_tokenizer,
    resolve_target_path,
)
from torchspec.targets.model import (
    ARCHITECTURES,
    DecoderOutput,
    TargetDecoder,
    family_of,
    validate_tp_for_target,
)
from torchspec.targets.tiny import TINY_FLAVOURS, TINY_HYBRID_FLAVOURS, build_tiny_target

__all__ = [
    "ARCHITECTURES",
    "BUILTIN_TARGETS",
    "TINY_FLAVOURS",
    "TINY_HYBRID_FLAVOURS",
    "DecoderOutput",
    "DenseAttend",
    "TargetDecoder",
    "TargetOutput",
    "build_tiny_target",
    "check_checkpoint_dir",
    "check_tp_size",
    "default_aux_layer_ids",
    "dense_attend",
    "family_of",
    "load_target_config",
    "load_tokenizer",
    "resolve_target_path",
    "validate_aux_layer_ids",
    "validate_tp_for_target",
]
