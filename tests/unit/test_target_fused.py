"""Serving's fused decoder (`TargetDecoder.fuse_for_serving`) computes what the loaded one computes.

Fusing q|k|v and gate|up into one GEMM each moves weights, never values: on CPU (where the
elementwise chains stay eager) the fused decoder's hidden states and logits equal the unfused
one's to fp32 rounding, for every family with its quirks (biases, q/k norms, GQA, hybrid GDN
layers with dense or MoE MLPs). The fused modules hold the same bytes (no copy kept), and
fusing twice is a no-op.
"""

import pytest
import torch

from torchspec.targets import TargetDecoder, build_tiny_target
from torchspec.targets.tiny import TINY_FLAVOURS, TINY_HYBRID_FLAVOURS


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.mark.parametrize("flavour", sorted(TINY_FLAVOURS) + sorted(TINY_HYBRID_FLAVOURS))
def test_fused_decoder_equals_loaded(tmp_path, flavour):
    path = build_tiny_target(str(tmp_path / flavour), flavour)
    plain = TargetDecoder.from_pretrained(path)
    fused = TargetDecoder.from_pretrained(path).fuse_for_serving()
    assert _param_bytes(fused) == _param_bytes(plain)
    attention = fused.layers[fused.attention_layer_ids[0]]
    if fused.args.recurrent is None:
        assert attention.self_attn.qkv_proj is not None and not hasattr(attention.self_attn, "q_proj")
    assert all(m.fused for m in fused.modules() if hasattr(m, "fused"))
    fused.fuse_for_serving()  # idempotent
    assert _param_bytes(fused) == _param_bytes(plain)
    ids = torch.randint(0, plain.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    want, got = plain.capture(ids), fused.capture(ids)
    for a, b in zip(want.aux_hidden_states + [want.last_hidden_state], got.aux_hidden_states + [got.last_hidden_state]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.logits(got.last_hidden_state), plain.logits(want.last_hidden_state),
                               rtol=1e-5, atol=1e-5)
