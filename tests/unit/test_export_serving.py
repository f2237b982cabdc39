"""Serving export (torchspec.export.serving): exact round trip per preset, strict loading, target
pairing by fingerprint, atomic writes, and export from a real training run's checkpoint
(torchspec.export.checkpoint_export)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from torchspec.config import DrafterConfig
from torchspec.data.vocab import build_vocab_mapping
from torchspec.export import serving
from torchspec.export.checkpoint_export import export_from_checkpoint
from torchspec.export.serving import (
    export_drafter,
    load_exported_drafter,
    read_target_embeddings,
    target_identity,
    weights_fingerprint,
)
from torchspec.models import build_drafter
from torchspec.targets import TargetDecoder, build_tiny_target
from torchspec.train.loss import TeacherHead
from torchspec.train.ttt import ttt_unroll, valid_counts

REPO = Path(__file__).resolve().parents[2]
AUX = [1, 3, 5]
PRESETS = {
    "eagle4": DrafterConfig(lm_head_rank=0, sliding_window=4),
    "eagle4_efficient_head": DrafterConfig(lm_head_rank=8, lm_head_topk=16, nope=True),
    "eagle4_moe": DrafterConfig(lm_head_rank=0, moe=True, moe_num_experts=4, moe_top_k=2, moe_shared_expert=True,
                                moe_intermediate_size=32),
    "eagle3": DrafterConfig(arch="eagle3", draft_vocab_size=100, fc_norm=False, norm_output=False,
                            fc_post_norm=False, pre_attn_norm=False, sliding_window=None),
}


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return TargetDecoder.from_pretrained(tiny_llama_dir, aux_layer_ids=AUX)


def make_drafter(target, preset: str, seed: int = 0):
    torch.manual_seed(seed)
    drafter = build_drafter(PRESETS[preset], target.config, AUX)
    if preset == "eagle3":
        freqs = torch.randint(0, 50, (target.vocab_size,), generator=torch.Generator().manual_seed(seed))
        drafter.set_vocab_mapping(*build_vocab_mapping(freqs, 100))
    drafter.init_from_target(target.embed_tokens_weight, target.lm_head_weight)
    with torch.no_grad():  # move every trainable weight off its init (norms off 1) so a dropped one shows
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return drafter.eval()


def unroll(drafter, vocab: int, steps: int = 3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    aux = [torch.randn(2, 10, 64, generator=g) for _ in range(3)]
    logits = torch.randn(2, 10, vocab, generator=g) * 3
    with torch.no_grad():
        result = ttt_unroll(drafter, ids, mask, aux, TeacherHead.from_logits(logits), steps, 0.8, valid_counts(mask, steps))
        normed, _ = drafter.step(ids, drafter.fuse_target_states(aux), torch.arange(10).expand(2, 10), drafter.ttt_attend())
        return result, drafter.compute_logits(normed)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_fp32_round_trip_is_exact_and_bf16_casts(tmp_path, target, preset):
    drafter = make_drafter(target, preset)
    summary = export_drafter(drafter, tmp_path / "fp32", dtype=torch.float32, target_identity=target_identity(target))
    assert summary["num_tensors"] == len(drafter.state_dict())
    written = json.loads((tmp_path / "fp32" / "config.json").read_text())
    for key in type(drafter.config).ARCH_FIELDS:  # contract 6: every flag and its meaning
        assert written[key] == getattr(drafter.config, key) and key in written["flag_meanings"], key
    assert written["target"] == target_identity(target) and written["torchspec_export_version"] == 1

    loaded = load_exported_drafter(tmp_path / "fp32", target=target)
    assert type(loaded) is type(drafter) and loaded.config.to_dict() == drafter.config.to_dict()
    (a, logits_a), (b, logits_b) = unroll(drafter, target.vocab_size), unroll(loaded, target.vocab_size)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.kl_sum, b.kl_sum) and torch.equal(a.correct, b.correct)
    assert torch.equal(logits_a, logits_b)
    assert torch.equal(loaded.embed_tokens.weight, target.embed_tokens_weight)  # the frozen embedding ships
    if preset == "eagle3":
        assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
        with pytest.raises(ValueError, match="mapping changes under loaded weights"):
            loaded.set_vocab_mapping(torch.zeros(100, dtype=torch.long), torch.arange(384) < 100)

    export_drafter(drafter, tmp_path / "bf16", dtype="bfloat16", target_identity=target_identity(target))
    small = load_exported_drafter(tmp_path / "bf16")
    original = drafter.state_dict()
    for name, tensor in small.state_dict().items():
        want = original[name].to(torch.bfloat16) if original[name].is_floating_point() else original[name]
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), name
    assert small.rotary.inv_freq.dtype == torch.float32  # RoPE tables are not weights: they stay fp32
    assert os.path.getsize(tmp_path / "bf16" / "model.safetensors") < os.path.getsize(tmp_path / "fp32" / "model.safetensors")


@pytest.fixture
def exported(tmp_path, target):
    path = tmp_path / "export"
    export_drafter(make_drafter(target, "eagle4"), path, dtype=torch.float32, target_identity=target_identity(target))
    return path


def edit_tensors(path: Path, fn) -> None:
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")


def edit_config(path: Path, fn) -> None:
    config = json.loads((path / "config.json").read_text())
    fn(config)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update({"layer.extra.weight": torch.zeros(3, 4)}), r"unknown tensors: \['layer.extra.weight \[3, 4\]'\]"),
    (lambda t: t.pop("fc.weight"), r"missing tensors: \['fc.weight \[64, 192\]'\]"),
    (lambda t: t.update({"norm.weight": torch.ones(63)}), r"mis-shaped tensors: \['norm.weight \[63\] \(expected \[64\]\)'\]"),
])
def test_loader_refuses_tensor_mismatches_by_name(exported, edit, message):
    edit_tensors(exported, edit)
    with pytest.raises(ValueError, match=message):
        load_exported_drafter(exported)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update({"use_magic": True}), r"unknown keys \['use_magic'\]"),
    (lambda c: c.pop("nope"), r"missing keys \['nope'\]"),
    (lambda c: c.update({"model_type": "llama"}), r"model_type='llama' is not a torchspec drafter"),
    (lambda c: c.pop("target"), r"'target' block must hold"),
])
def test_loader_refuses_config_mismatches_by_name(exported, edit, message):
    edit_config(exported, edit)
    with pytest.raises(ValueError, match=message):
        load_exported_drafter(exported)


def test_target_pairing_by_fingerprint(tmp_path, exported, target, tiny_tokenizer):
    other_dir = build_tiny_target(str(tmp_path / "other"), flavour="llama", vocab_size=384, seed=1,
                                  tokenizer=tiny_tokenizer)
    other = TargetDecoder.from_pretrained(other_dir, aux_layer_ids=AUX)
    mine, theirs = target_identity(target)["fingerprint"], target_identity(other)["fingerprint"]
    assert mine != theirs
    with pytest.raises(ValueError, match=f"target with fingerprint {mine}; got a target with fingerprint {theirs}"):
        load_exported_drafter(exported, target=other)
    with pytest.raises(ValueError, match="vocab_size 384.*got a target with vocab_size 49152"):
        load_exported_drafter(exported, target={**target_identity(target), "vocab_size": 49152})
    assert load_exported_drafter(exported, target=target) is not None
    assert load_exported_drafter(exported, target=target_identity(target)) is not None


def test_fingerprint_is_value_based_and_sensitive():
    torch.manual_seed(0)
    embed = torch.randn(1000, 32)
    tied = weights_fingerprint(embed, embed)
    assert weights_fingerprint(embed, embed.clone()) == tied  # tied storage or equal copies: same target
    assert weights_fingerprint(embed.to(torch.bfloat16), embed.to(torch.bfloat16)) == tied  # fp32 vs bf16 load
    untied = embed.clone()
    untied[-1] += 1.0  # the last row is always sampled
    assert weights_fingerprint(embed, untied) != tied
    assert weights_fingerprint(embed[:999], embed[:999]) != tied


def forbid_building_a_target(monkeypatch) -> None:
    """Building a target model raises from here on: ours, or a transformers one of the tiny targets'
    families (any way: from_pretrained, from_config, the class itself)."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the target model was built; an export reads only its embedding and lm_head")

    monkeypatch.setattr(TargetDecoder, "__init__", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    for decoder in (transformers.LlamaModel, transformers.Qwen3Model):
        monkeypatch.setattr(decoder, "__init__", refuse)


@pytest.mark.parametrize("tied", [True, False])
def test_target_embeddings_from_the_files_equal_the_loaded_target(tmp_path, tiny_target_dir, tiny_tokenizer,
                                                                   monkeypatch, tied):
    path = tiny_target_dir if tied else build_tiny_target(str(tmp_path / "untied"), vocab_size=384, seed=2,
                                                          tie_word_embeddings=False, tokenizer=tiny_tokenizer)
    loaded = TargetDecoder.from_pretrained(path, aux_layer_ids=AUX)
    forbid_building_a_target(monkeypatch)
    read = read_target_embeddings(path, AUX, torch.float32)
    assert target_identity(read) == target_identity(loaded)
    assert torch.equal(read.embed_tokens_weight, loaded.embed_tokens_weight)
    assert torch.equal(read.lm_head_weight, loaded.lm_head_weight)
    assert (read.lm_head_weight is read.embed_tokens_weight) == tied
    half = read_target_embeddings(path, AUX, torch.bfloat16)  # as TargetDecoder.from_pretrained(dtype=bf16) casts
    assert half.embed_tokens_weight.dtype == torch.bfloat16
    assert torch.equal(half.embed_tokens_weight, loaded.embed_tokens_weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"outside \[0, 7\]"):
        read_target_embeddings(path, [1, 3, 9], torch.float32)


def test_export_refuses_a_foreign_target_identity(tmp_path, target):
    identity = {**target_identity(target), "aux_layer_ids": [0, 3, 6]}
    with pytest.raises(ValueError, match=r"aux_layer_ids drafter \[1, 3, 5\] vs target \[0, 3, 6\]"):
        export_drafter(make_drafter(target, "eagle4"), tmp_path / "x", dtype=torch.float32, target_identity=identity)
    assert not (tmp_path / "x").exists()


def test_failed_write_leaves_nothing_and_keeps_an_older_export(tmp_path, monkeypatch, target):
    drafter, identity = make_drafter(target, "eagle4"), target_identity(target)

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(serving, "save_file", broken_save)
    root = tmp_path / "exports"
    with pytest.raises(OSError, match="disk full"):
        export_drafter(drafter, root / "new", dtype=torch.float32, target_identity=identity)
    assert list(root.iterdir()) == []  # no out_dir, no temp dir

    monkeypatch.undo()
    export_drafter(drafter, root / "old", dtype=torch.float32, target_identity=identity)
    before = load_file(root / "old" / "model.safetensors")
    monkeypatch.setattr(serving, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        export_drafter(make_drafter(target, "eagle4", seed=1), root / "old", dtype=torch.float32,
                       target_identity=identity)
    assert [p.name for p in root.iterdir()] == ["old"]
    after = load_file(root / "old" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_refuses_to_overwrite_a_directory_that_is_not_an_export(tmp_path, target):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a torchspec export; refusing to overwrite"):
        export_drafter(make_drafter(target, "eagle4"), precious, dtype=torch.float32,
                       target_identity=target_identity(target))
    assert (precious / "notes.txt").read_text() == "keep me"


# --- from a training run ---------------------------------------------------------------------------

def run_recipe(out_dir: Path, target_dir: str, data_path: str, *extra: str):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    args = [
        sys.executable, str(REPO / "recipes" / "train.py"),
        f"target.path={target_dir}", "target.dtype=float32", "target.aux_layer_ids=[1,3,5]",
        f"data.path={data_path}", "data.max_length=64", "data.eval_size=8", "data.max_conversations=null",
        f"train.output_dir={out_dir}", "train.max_steps=2", "train.micro_batch_size=4", "train.grad_accum=1",
        "train.ttt_steps=2", "train.lr=3e-3", "train.warmup_steps=0", "train.precision=fp32",
        "train.log_every=1", "train.save_every=0", "train.eval_batches=1", "train.report_to=none",
        "train.plot=false", "train.num_threads=1", *extra,
    ]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # runs the training recipe (2 steps) in a subprocess
@pytest.mark.parametrize("preset, extra", [
    ("eagle3", ["drafter.draft_vocab_size=128"]),
    ("eagle4", ["drafter.lm_head_rank=8", "drafter.lm_head_topk=16"]),
])
def test_export_from_checkpoint_equals_the_runs_drafter(tmp_path, tiny_llama_dir, tiny_chat_jsonl, capsys,
                                                        preset, extra):
    from recipes.export import main

    run = tmp_path / "run"
    result = run_recipe(run, tiny_llama_dir, tiny_chat_jsonl, f"drafter={preset}", *extra)
    assert result.returncode == 0, result.stderr[-3000:]

    with pytest.MonkeyPatch.context() as patch:
        forbid_building_a_target(patch)  # torchspec-export reads only the target's embedding and lm_head
        main([str(run), str(tmp_path / "export"), "--dtype", "float32"])
    printed = capsys.readouterr().out
    assert "exported step 2" in printed and "fingerprint" in printed
    exported = load_file(tmp_path / "export" / "model.safetensors")
    saved = load_file(run / "drafter" / "model.safetensors")  # the run's own serving export (fp32 run: fp32)
    assert sorted(exported) == sorted(saved)
    for name in saved:
        assert exported[name].dtype == saved[name].dtype and torch.equal(exported[name], saved[name]), name
    assert (tmp_path / "export" / "config.json").read_text() == (run / "drafter" / "config.json").read_text()
    loaded = load_exported_drafter(tmp_path / "export", target=TargetDecoder.from_pretrained(tiny_llama_dir))
    assert loaded.config.aux_layer_ids == AUX

    summary = export_from_checkpoint(run, tmp_path / "export_bf16", step=2)
    assert summary["dtype"] == "bfloat16" and summary["step"] == 2
    if preset != "eagle3":
        return
    # The same checkpoint in the SGLang layout, through the CLI, reloads to identical tensors.
    from torchspec.export.eagle3_layouts import load_layout

    main([str(run), str(tmp_path / "sglang"), "--dtype", "float32", "--layout", "sglang"])
    in_sglang = load_layout(tmp_path / "sglang", target_num_layers=loaded.config.target_num_layers)
    for name, value in loaded.state_dict().items():
        assert torch.equal(in_sglang.state_dict()[name], value), name
    # A missing step and a DeepSpeed checkpoint are refused with a message (exit 2, no traceback).
    with pytest.raises(SystemExit) as exit_info:
        main([str(run), str(tmp_path / "x"), "--step", "7"])
    assert exit_info.value.code == 2 and "['step_000002']" in capsys.readouterr().err
    from torchspec.train.checkpoint import write_manifest

    ckpt = run / "checkpoints" / "step_000002"
    state = torch.load(ckpt / "state.pt", weights_only=False)
    torch.save({**state, "engine": "deepspeed"}, ckpt / "state.pt")
    write_manifest(ckpt)  # an intact checkpoint of the other engine, not a damaged one
    with pytest.raises(SystemExit) as exit_info:
        main([str(run), str(tmp_path / "x")])
    assert exit_info.value.code == 2 and "zero_to_fp32" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("flavour", ["qwen3_next", "qwen3_5"])
def test_target_embeddings_of_a_hybrid_target(tmp_path, flavour):
    """Qwen3.5 checkpoints are multimodal: the decoder's weights sit under model.language_model."""
    path = build_tiny_target(str(tmp_path / flavour), flavour)
    loaded = TargetDecoder.from_pretrained(path)
    read = read_target_embeddings(path, loaded.aux_layer_ids, torch.float32)
    assert target_identity(read) == target_identity(loaded)
    assert torch.equal(read.embed_tokens_weight, loaded.embed_tokens_weight)
    assert torch.equal(read.lm_head_weight, loaded.lm_head_weight)
