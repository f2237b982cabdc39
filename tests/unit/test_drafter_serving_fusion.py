"""The served drafter step runs through its compiled regions once fused (``DrafterRunner.fuse_for_serving``), and
computes what the unfused step computes. On the CPU the regions run their eager chains (they compile on CUDA only:
``tests/gpu/test_drafter_fused_gpu.py``), so here the step's output is bit-identical and each region must be
called: a region a refactor stops calling would silently cost its kernels again on the GPU."""

from __future__ import annotations

import collections

import pytest
import torch

import torchspec.models.layers as layers
import torchspec.targets.layers as target_layers
from tests.runtime_pair import build_pair
from torchspec.export.serving import load_exported_drafter
from torchspec.runtime.drafter_runner import DrafterRunner
from torchspec.runtime.loading import decoder_identity
from torchspec.runtime.paged_kv import build_attention_meta
from torchspec.targets import TargetDecoder

PAGE = 8
REGIONS = [(layers, "rope_tables_fused"), (layers, "rope_qk_fused"), (layers, "embed_hidden_fused"),
           (layers, "silu_mul_fused"), (target_layers, "add_rms_norm_fused"), (target_layers, "rms_norm_fused")]


@pytest.mark.parametrize("arch", ["eagle4", "eagle3"])
@torch.no_grad()
def test_fused_step_calls_every_region_and_equals_the_unfused_step(tmp_path, tiny_tokenizer, monkeypatch, arch):
    target_dir, export = build_pair(tmp_path, tiny_tokenizer)
    if arch == "eagle3":
        from torchspec.config import DrafterConfig
        from torchspec.export.serving import export_drafter, target_identity
        from torchspec.models import build_drafter

        target = TargetDecoder.from_pretrained(target_dir, aux_layer_ids=[1, 2, 3])
        torch.manual_seed(0)
        model = build_drafter(DrafterConfig(arch="eagle3", draft_vocab_size=None), target.config, [1, 2, 3])
        model.init_from_target(target.embed_tokens_weight, target.lm_head_weight)
        export = str(tmp_path / "eagle3_export")
        export_drafter(model, export, dtype=torch.float32, target_identity=target_identity(target))
    target = TargetDecoder.from_pretrained(target_dir, aux_layer_ids=[1, 2, 3])
    runners = [DrafterRunner(load_exported_drafter(export, target=decoder_identity(target)), target.vocab_size)
               for _ in range(2)]
    runners[1].fuse_for_serving()
    calls = collections.Counter()
    for module, name in REGIONS:
        region = getattr(module, name)

        def counted(*args, _region=region, _name=name, **kwargs):
            calls[_name] += 1
            return _region(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    rows, ctx = 3, 5
    tokens = torch.randint(0, target.vocab_size, (rows, 2))
    hidden = torch.randn(rows, 2, runners[0].hidden_size)
    positions = ctx + torch.arange(2).expand(rows, 2)
    pages = -(-(ctx + 2) // PAGE)
    block_table = torch.arange(1, rows * pages + 1).view(rows, pages)
    meta = build_attention_meta(block_table, torch.full((rows,), ctx), torch.ones(2, 2, dtype=torch.bool).tril()
                                .expand(rows, 2, 2), PAGE)
    outs = []
    for runner in runners:
        cache = runner.make_kv_cache(rows * pages + 1, PAGE)
        cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(1)))
        cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(2)))
        outs.append(runner.forward(tokens, hidden, positions, cache, meta))
        if runner is runners[0]:
            assert not calls, calls  # the unfused step calls no region
    for want, got in zip(*outs):  # normed, feedback: the same ops, so the same bits
        assert torch.equal(want, got)
    # rms_norm alone: EAGLE-4's pre-attention norm when it has one; EAGLE-3's attention reads the step's input
    input_norm = arch == "eagle4" and runners[1].config.pre_attn_norm
    want_calls = {"rope_tables_fused": 1, "rope_qk_fused": 1, "embed_hidden_fused": 1, "add_rms_norm_fused": 2,
                  "silu_mul_fused": 1, "rms_norm_fused": int(input_norm)}
    assert {k: calls[k] for k in want_calls} == want_calls, calls
