"""EAGLE-3 export layouts (SGLang / vLLM speculators) and post-hoc vocab pruning: bit-exact round trips,
pinned key names, aux-id conventions per engine, strict loaders, pruning rows selected by target id."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from torchspec.data.vocab import build_vocab_mapping
from torchspec.export.eagle3_layouts import (
    from_sglang,
    from_vllm,
    load_layout,
    save_layout,
    to_sglang,
    to_vllm,
)
from torchspec.export.prune import prune_vocab
from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter

V, VD, H, L = 40, 24, 16, 8
SMALL = dict(vocab_size=V, draft_vocab_size=VD, hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
             head_dim=4, intermediate_size=24, aux_layer_ids=[1, 3, 4], target_num_layers=L, rope_theta=5e5,
             rms_norm_eps=1e-5, max_position_embeddings=2048)


def tiny(seed: int = 0, **overrides) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(Eagle3Config(**{**SMALL, **overrides})).eval()
    freqs = torch.randint(0, 100, (V,), generator=torch.Generator().manual_seed(seed))
    model.set_vocab_mapping(*build_vocab_mapping(freqs, model.config.draft_vocab_size))
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def assert_same(a: Eagle3Drafter, b: Eagle3Drafter) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    for k in Eagle3Config.ARCH_FIELDS:
        assert getattr(a.config, k) == getattr(b.config, k), k


SGLANG_KEYS = {
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "embed_tokens.weight",
}
VLLM_KEYS = {k.replace("midlayer.", "layers.0.") for k in SGLANG_KEYS}


# --- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trips_are_bit_exact(dtype):
    model = tiny().to(dtype)
    assert_same(model, from_sglang(*to_sglang(model)))
    assert_same(model, from_vllm(*to_vllm(model)))
    assert_same(model, from_vllm(*to_vllm(from_sglang(*to_sglang(model)))))  # sglang -> vllm via internal
    assert_same(model, from_sglang(*to_sglang(from_vllm(*to_vllm(model)))))


def test_files_round_trip_with_auto_detect_and_same_forward(tmp_path):
    model = tiny()
    save_layout(model, tmp_path / "sg", "sglang")
    from_sg = load_layout(tmp_path / "sg")
    save_layout(from_sg, tmp_path / "vl", "vllm", speculative_tokens=5, verifier="org/target")
    from_vl = load_layout(tmp_path / "vl")
    assert_same(model, from_sg)
    assert_same(model, from_vl)
    sg, vl = load_file(tmp_path / "sg" / "model.safetensors"), load_file(tmp_path / "vl" / "model.safetensors")
    for key in sg:  # the same bytes under the renamed key
        assert torch.equal(sg[key], vl[key.replace("midlayer.", "layers.0.")]), key
    assert sg["d2t"].dtype == torch.int64 and sg["t2d"].dtype == torch.bool

    g = torch.Generator().manual_seed(1)
    ids, aux = torch.randint(0, V, (2, 6), generator=g), [torch.randn(2, 6, H, generator=g) for _ in range(3)]
    pos = torch.arange(6).expand(2, 6)
    ref = model.step(ids, model.fuse_target_states(aux), pos, model.ttt_attend())[0]
    for loaded in (from_sg, from_vl):
        out = loaded.step(ids, loaded.fuse_target_states(aux), pos, loaded.ttt_attend())[0]
        assert torch.equal(loaded.draft_to_target_ids(loaded.compute_logits(out).argmax(-1)),
                           model.draft_to_target_ids(model.compute_logits(ref).argmax(-1)))
        assert torch.equal(out, ref)


def test_written_key_names_and_config_fields_are_pinned(tmp_path):
    model = tiny()
    save_layout(model, tmp_path / "sg", "sglang")
    save_layout(model, tmp_path / "vl", "vllm")
    assert set(load_file(tmp_path / "sg" / "model.safetensors")) == SGLANG_KEYS
    assert set(load_file(tmp_path / "vl" / "model.safetensors")) == VLLM_KEYS

    sg = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["num_hidden_layers"] == 1
    assert sg["draft_vocab_size"] == VD and sg["vocab_size"] == V and sg["target_hidden_size"] == H
    assert sg["head_dim"] == 4 and sg["rope_theta"] == 5e5 and sg["tie_word_embeddings"] is False
    # SGLang adds 1 itself (layers_to_capture = [i + 1 for i in ids]): its ids ARE torchspec's.
    assert sg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}

    vl = json.loads((tmp_path / "vl" / "config.json").read_text())
    assert vl["architectures"] == ["Eagle3Speculator"] and vl["speculators_model_type"] == "eagle3"
    # vLLM captures on entry to layer j unshifted: vLLM id j = torchspec id j - 1.
    assert vl["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert vl["norm_before_residual"] is False  # vLLM defaults a missing key to True
    assert vl["draft_vocab_size"] == VD and vl["transformer_layer_config"]["vocab_size"] == V
    assert vl["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert "name_or_path" in vl["speculators_config"]["verifier"]


def test_embedding_can_be_left_out_and_supplied_on_load(tmp_path):
    model = tiny()
    save_layout(model, tmp_path, "vllm", include_embedding=False)
    assert "embed_tokens.weight" not in load_file(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing keys \['embed_tokens.weight'\].*embed_weight="):
        load_layout(tmp_path)
    assert_same(model, load_layout(tmp_path, embed_weight=model.embed_tokens.weight.detach()))


# --- aux ids and unsupported flags -------------------------------------------------------------------


def test_foreign_checkpoint_needs_target_layers_and_defaults_aux_ids():
    state, config = to_sglang(tiny())
    del config["torchspec"]
    with pytest.raises(ValueError, match="pass target_num_layers="):
        from_sglang(state, config)
    assert from_sglang(state, config, target_num_layers=L).config.aux_layer_ids == [1, 3, 4]
    del config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]  # engines' default entries (2, L//2, L-3)
    assert from_sglang(state, config, target_num_layers=L).config.aux_layer_ids == [1, L // 2 - 1, L - 4]
    state, config = to_vllm(tiny())
    del config["eagle_aux_hidden_state_layer_ids"], config["torchspec"]
    assert from_vllm(state, config, target_num_layers=L).config.aux_layer_ids == [1, L // 2 - 1, L - 4]


def test_uncapturable_aux_ids_refused():
    with pytest.raises(ValueError, match=r"aux_layer_ids \[7\] cannot be captured"):
        to_sglang(tiny(aux_layer_ids=[1, 3, L - 1]))
    state, config = to_vllm(tiny())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 4, 5]  # vLLM id 0 = the embedding output
    with pytest.raises(ValueError, match=r"offending \[0\]"):
        from_vllm(state, config)


@pytest.mark.parametrize("flag", ["fc_norm", "norm_output"])
@pytest.mark.parametrize("to", [to_sglang, to_vllm])
def test_eagle31_flags_refused_on_export(flag, to):
    with pytest.raises(ValueError, match=rf"EAGLE-3.1 flags \['{flag}'\]"):
        to(tiny(**{flag: True}))


def test_config_the_engine_would_read_differently_refused():
    state, config = to_vllm(tiny())
    del config["norm_before_residual"]
    with pytest.raises(ValueError, match="norm_before_residual=missing -> True"):
        from_vllm(state, config)
    state, config = to_sglang(tiny())
    config["fc_norm"] = True
    with pytest.raises(ValueError, match=r"flags \['fc_norm'\]"):
        from_sglang(state, config)
    state, config = to_sglang(tiny())
    config["sliding_window"] = 4096
    with pytest.raises(ValueError, match=r"unknown config keys \['sliding_window'\]"):
        from_sglang(state, config)


# --- strict loaders -----------------------------------------------------------------------------------


def _corrupt(tmp_path, layout, edit):
    save_layout(tiny(), tmp_path, layout)
    weights = load_file(tmp_path / "model.safetensors")
    edit(weights)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


def _shorten(weights, key):
    weights[key] = weights[key][:-1].clone()


@pytest.mark.parametrize("layout,edit,message", [
    ("sglang", lambda w: w.__setitem__("midlayer.self_attn.q_norm.weight", torch.ones(4)),
     r"unknown keys \['midlayer.self_attn.q_norm.weight'\]"),
    ("sglang", lambda w: w.pop("midlayer.hidden_norm.weight"), r"missing keys \['midlayer.hidden_norm.weight'\]"),
    ("vllm", lambda w: w.pop("layers.0.mlp.up_proj.weight"), r"missing keys \['layers.0.mlp.up_proj.weight'\]"),
    ("vllm", lambda w: w.__setitem__("layers.1.hidden_norm.weight", torch.ones(H)),
     r"unknown keys \['layers.1.hidden_norm.weight'\]"),
    ("vllm", lambda w: w.__setitem__("midlayer.norm.weight", torch.ones(H)),  # alias of layers.0.norm.weight
     r"unknown keys \['layers.0.norm.weight'\]"),
    ("vllm", lambda w: w.__setitem__("midlayer.fc.weight", torch.ones(H)), r"unknown keys \['layers.0.fc.weight'\]"),
    ("sglang", lambda w: _shorten(w, "fc.weight"), r"mis-shaped keys \['fc.weight \(15, 48\) \(expected \(16, 48\)\)'\]"),
    ("sglang", lambda w: _shorten(w, "d2t"), rf"d2t has shape \({VD - 1},\) but the config's draft_vocab_size={VD}"),
    ("vllm", lambda w: _shorten(w, "t2d"), rf"t2d has shape \({V - 1},\) but the config's vocab_size={V}"),
    ("vllm", lambda w: w["t2d"].__setitem__(int(w["t2d"].nonzero()[0]), False),
     f"t2d marks {VD - 1} target ids but draft_vocab_size={VD}"),
])
def test_strict_loader_names_the_problem(tmp_path, layout, edit, message):
    with pytest.raises(ValueError, match=message):
        load_layout(_corrupt(tmp_path, layout, edit))


def test_vllm_loader_accepts_midlayer_names_like_vllm():
    """vLLM's LlamaModel.load_weights maps ``midlayer.`` -> ``layers.0.``; so does from_vllm."""
    model = tiny()
    state, config = to_vllm(model)
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in state.items()}
    assert_same(model, from_vllm(renamed, config))
    with pytest.raises(ValueError, match="both midlayer.hidden_norm.weight and layers.0.hidden_norm.weight"):
        from_vllm({**state, "midlayer.hidden_norm.weight": state["layers.0.hidden_norm.weight"]}, config)


def test_layout_mismatch_refused(tmp_path):
    save_layout(tiny(), tmp_path, "sglang")
    with pytest.raises(ValueError, match="asked for layout='vllm' but .* is 'sglang'"):
        load_layout(tmp_path, layout="vllm")


# --- vocabulary pruning ---------------------------------------------------------------------------------


def hand_made() -> Eagle3Drafter:
    """V = 10, draft ids -> target ids [1, 3, 4, 7, 9]; lm_head row i is filled with its target id."""
    cfg = dict(SMALL, vocab_size=10, draft_vocab_size=5, aux_layer_ids=[1, 3, 4])
    model = Eagle3Drafter(Eagle3Config(**cfg)).eval()
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 3, 4, 7, 9]] = True
    model.set_vocab_mapping(torch.tensor([1, 2, 2, 4, 5]), t2d)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.tensor([1.0, 3, 4, 7, 9])[:, None].expand(5, H))
    return model


def test_prune_selects_lm_head_rows_by_target_id():
    model = hand_made()
    freqs = torch.tensor([0, 1, 0, 50, 2, 0, 0, 40, 0, 30])
    pruned = prune_vocab(model, freqs, 3)
    assert pruned.d2t.tolist() == [3, 6, 7] and pruned.draft_target_ids().tolist() == [3, 7, 9]
    assert pruned.lm_head.weight[:, 0].tolist() == [3.0, 7.0, 9.0]  # old rows 1, 3, 4
    assert model.lm_head.weight[:3, 0].tolist() == [1.0, 3.0, 4.0]  # what new-draft-id selection would give
    for name, value in model.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(pruned.state_dict()[name], value), name
    with pytest.raises(ValueError, match="mapping changes under loaded weights are refused"):
        other = torch.zeros(10, dtype=torch.bool)
        other[[1, 3, 4]] = True
        pruned.set_vocab_mapping(torch.tensor([1, 2, 2]), other)  # the pruned mapping is locked


def test_prune_refuses_ids_outside_the_current_vocab_unless_restricted():
    model = hand_made()
    freqs = torch.tensor([0, 1, 99, 50, 2, 0, 0, 40, 0, 30])  # id 2 is frequent but not draftable now
    with pytest.raises(ValueError, match=r"target ids \[2\] .* outside the drafter's current draft vocabulary"):
        prune_vocab(model, freqs, 3)
    pruned = prune_vocab(model, freqs, 3, restrict_to_current=True)
    assert pruned.draft_target_ids().tolist() == [3, 7, 9]
    assert pruned.lm_head.weight[:, 0].tolist() == [3.0, 7.0, 9.0]
    with pytest.raises(ValueError, match="new_draft_vocab_size=6 must lie in"):
        prune_vocab(model, freqs, 6, restrict_to_current=True)


def test_prune_preserves_draft_argmax_target_on_kept_tokens(tmp_path):
    model = tiny()
    freqs = torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(5))
    pruned = prune_vocab(model, freqs, 12, restrict_to_current=True)
    kept = pruned.t2d
    assert bool((kept <= model.t2d).all()) and int(kept.sum()) == 12

    g = torch.Generator().manual_seed(2)
    ids, aux = torch.randint(0, V, (4, 16), generator=g), [torch.randn(4, 16, H, generator=g) for _ in range(3)]
    pos = torch.arange(16).expand(4, 16)
    normed = model.step(ids, model.fuse_target_states(aux), pos, model.ttt_attend())[0]
    assert torch.equal(normed, pruned.step(ids, pruned.fuse_target_states(aux), pos, pruned.ttt_attend())[0])
    old_logits, new_logits = model.compute_logits(normed), pruned.compute_logits(normed)
    rows = (torch.cumsum(model.t2d.long(), 0) - 1)[pruned.draft_target_ids()]
    assert torch.equal(new_logits, old_logits[..., rows])  # same scores, selected by target id
    old_target = model.draft_to_target_ids(old_logits.argmax(-1))
    new_target = pruned.draft_to_target_ids(new_logits.argmax(-1))
    on_kept = kept[old_target]
    assert bool(on_kept.any()) and bool((~on_kept).any())  # both cases occur in this example
    assert torch.equal(new_target[on_kept], old_target[on_kept])

    save_layout(pruned, tmp_path, "sglang")  # the pruned drafter exports and reloads exactly
    assert_same(pruned, load_layout(tmp_path))
