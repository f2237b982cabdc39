"""EAGLE-4 drafter: save/load round trip, strict config (contract 6), fc-norm scale invariance,
and the drafter built from a real target config."""

from __future__ import annotations

import json

import pytest
import torch

from torchspec.config import DrafterConfig
from torchspec.models import build_drafter
from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter
from torchspec.targets import TargetDecoder
from torchspec.train.loss import TeacherHead
from torchspec.train.ttt import ttt_unroll, valid_counts

SMALL = dict(vocab_size=40, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
             intermediate_size=24, aux_layer_ids=[0, 1, 2], target_num_layers=4)


def run(model, ids, aux, steps=2):
    mask = torch.ones_like(ids)
    logits = torch.randn(*ids.shape, 40, generator=torch.Generator().manual_seed(5))
    return ttt_unroll(model, ids, mask, aux, TeacherHead.from_logits(logits), steps, 0.8, valid_counts(mask, steps))


@pytest.mark.parametrize("flags", [{}, {"fc_norm": False, "norm_output": False}, {"fc_post_norm": False}])
def test_save_load_identical_outputs(tmp_path, flags):
    torch.manual_seed(0)
    model = Eagle4Drafter(Eagle4Config(**SMALL, **flags)).eval()
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    for key in Eagle4Config.ARCH_FIELDS:
        assert key in written and key in written["flag_meanings"], key
    loaded = Eagle4Drafter.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 40, (2, 7))
    aux = [torch.randn(2, 7, 16) for _ in range(3)]
    a, b = run(model, ids, aux), run(loaded, ids, aux)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.correct, b.correct)
    for key, value in flags.items():
        assert getattr(loaded.config, key) == value


def test_unknown_and_missing_keys_are_refused(tmp_path):
    Eagle4Drafter(Eagle4Config(**SMALL)).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["use_magic"] = True
    del cfg["norm_output"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unknown keys \['use_magic'\] and missing keys \['norm_output'\]"):
        Eagle4Drafter.from_pretrained(tmp_path)


def test_incompatible_heads_refused():
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads"):
        Eagle4Config(**{**SMALL, "num_key_value_heads": 3})


def test_fc_norm_inputs_are_scale_invariant():
    torch.manual_seed(0)
    model = Eagle4Drafter(Eagle4Config(**SMALL)).eval()
    aux = [torch.randn(1, 5, 16) for _ in range(3)]
    scaled = [aux[0] * 7.0, aux[1] * 0.5, aux[2] * 300.0]  # (tiny scales would meet the eps)
    torch.testing.assert_close(model.fuse_target_states(aux), model.fuse_target_states(scaled), rtol=1e-4, atol=1e-5)
    plain = Eagle4Drafter(Eagle4Config(**SMALL, fc_norm=False, fc_post_norm=False)).eval()
    assert not torch.allclose(plain.fuse_target_states(aux), plain.fuse_target_states(scaled))


def test_built_from_target_config_and_initialised_from_target(tiny_target_dir):
    target = TargetDecoder.from_pretrained(tiny_target_dir, aux_layer_ids=[1, 3, 5])
    drafter = build_drafter(DrafterConfig(), target.config, target.aux_layer_ids)
    drafter.init_from_target(target.embed_tokens_weight, target.lm_head_weight)
    assert drafter.config.hidden_size == target.hidden_size and drafter.config.vocab_size == target.vocab_size
    assert torch.equal(drafter.embed_tokens.weight, target.embed_tokens_weight)
    assert torch.equal(drafter.lm_head.weight, target.lm_head_weight)
    assert not drafter.embed_tokens.weight.requires_grad
    assert drafter.config.aux_layer_ids == [1, 3, 5]


def test_scorer_svd_runs_where_the_targets_head_is(tiny_target_dir, monkeypatch):
    """Training builds the drafter on the CPU beside a GPU target: the efficient head's SVD runs on the
    target head's device (the GPU's is far faster), unless ``svd_device`` says otherwise."""
    from torchspec.models.lm_head import EfficientLMHead

    target = TargetDecoder.from_pretrained(tiny_target_dir, aux_layer_ids=[1, 3, 5])
    drafter = build_drafter(DrafterConfig(lm_head_rank=8, lm_head_topk=16), target.config, target.aux_layer_ids)
    seen = []
    monkeypatch.setattr(EfficientLMHead, "init_scorer", lambda self, device=None, **kw: seen.append(device))
    head = target.lm_head_weight.to("meta")  # stands for a head on another device than the drafter's
    drafter.init_from_target(target.embed_tokens_weight, target.lm_head_weight)
    drafter.init_from_target(target.embed_tokens_weight, head, init_lm_head=False)
    drafter.init_from_target(target.embed_tokens_weight, head, init_lm_head=False, svd_device="cpu")
    assert seen == [torch.device("cpu"), torch.device("meta"), "cpu"]


def test_interface_full_vocabulary_hooks_do_nothing():
    """EAGLE-4 drafts over the whole target vocabulary: no mapping to build, save or restrict to."""
    model = Eagle4Drafter(Eagle4Config(vocab_size=37, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=4, intermediate_size=24, aux_layer_ids=[0, 1, 2], target_num_layers=4,
                                       sliding_window=5))
    assert model.fit_vocab([]) is None and model.vocab_mapping() is None and model.draft_vocab_ids() is None
    ids = torch.arange(37)
    assert torch.equal(model.draft_to_target_ids(ids), ids) and model.window == 5


@pytest.mark.parametrize("arch", ["eagle3", "eagle4"])
def test_reinitialising_rope_keeps_its_buffer_on_the_models_device(arch, tiny_target_dir):
    """``_init_weights`` recomputes the rotary frequencies where the buffer lives (a served drafter re-initialised on
    the GPU once rebuilt them on the CPU: tools/bench_controller.py's ``untrained`` drafter); 'meta' stands for it."""
    from torchspec.models.layers import RotaryEmbedding

    target = TargetDecoder.from_pretrained(tiny_target_dir, aux_layer_ids=[1, 3, 5])
    model = build_drafter(DrafterConfig(arch=arch), target.config, target.aux_layer_ids)
    rope = next(m for m in model.modules() if isinstance(m, RotaryEmbedding))
    want = rope.inv_freq.clone()
    rope.inv_freq = rope.inv_freq.to("meta")
    model._init_weights(rope)
    assert rope.inv_freq.device.type == "meta"
    rope.inv_freq = torch.empty(0)
    model._init_weights(rope)
    assert torch.equal(rope.inv_freq, want)
