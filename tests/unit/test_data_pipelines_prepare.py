"""data_pipelines.prepare: prepared Arrow sets equal the trainer's in-process examples, fingerprint reuse
and rebuilds, restart after a kill, and the trainer's refusal of a prepared set made for other settings.

* ``build_datasets`` on a prepared directory gives exactly the train / held-out examples (ids, masks,
  order) and skip counts of ``build_datasets`` on the source file, with and without
  ``max_conversations``, with the source's exact copies dropped (``data.dedup``) or kept; the stored
  packed rows are ``pack_examples`` of those training examples;
* an unchanged run prints "reused <dir>" and touches nothing; a changed max_length, chat template,
  pack, dedup or source rebuilds;
* a run killed while tokenising (or while writing) leaves no ``output``; the rerun reuses the finished
  chunks and ends with the same directory as an uninterrupted run;
* ``torchspec-train`` on a prepared directory whose max_length or chat template differs exits 2 with
  one line naming the directory, the key and the fix; another tokenizer is refused too.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import make_conversations

from data_pipelines import prepare as prepare_module
from data_pipelines.prepare import PrepareConfig, main, prepare
from torchspec.config import DataConfig
from torchspec.data import CHATML_TEMPLATE, build_datasets, build_tiny_tokenizer
from torchspec.data.packing import pack_examples
from torchspec.data.prepared import MANIFEST, load_prepared, load_train_rows

pytestmark = pytest.mark.usefixtures("one_thread")
EVAL = 6
OTHER_TEMPLATE = CHATML_TEMPLATE.replace("You are a helpful assistant.", "You help.")
MAX_LENGTH = 256  # conversations of ~90 tokens: packed rows hold two or more
COPIES = 2  # exact copies in the source: 61 distinct examples, 63 tokenised conversations


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """60 conversations, one with no reply, one malformed line, one far too long, and two exact copies
    (``COPIES``): one before the 25th example (the capped case), one after."""
    lines = [json.dumps(c) for c in make_conversations(60, seed=3)]
    lines.insert(7, json.dumps({"messages": [{"role": "user", "content": "no reply"}]}))
    lines.insert(20, "{broken")
    lines.insert(33, json.dumps({"messages": [{"role": "user", "content": "long"},
                                              {"role": "assistant", "content": "word " * 300}]}))
    lines.insert(12, lines[2])
    lines.append(lines[40])
    path = tmp_path_factory.mktemp("prepare_src") / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def config(target: str, src: str, out, **data) -> PrepareConfig:
    settings = {"path": src, "max_length": MAX_LENGTH, "eval_size": EVAL, "pack": True, "max_conversations": None} | data
    return PrepareConfig(target=target, output=str(out), num_proc=1, chunk_size=16, data=DataConfig(**settings))


def in_process(src: str, tokenizer, **kwargs):
    settings = {"max_length": MAX_LENGTH, "eval_size": EVAL, "seed": 0, "max_conversations": None} | kwargs
    return build_datasets(src, tokenizer, **settings)


def rows(examples) -> list[tuple]:
    return [(e.input_ids.tolist(), e.loss_mask.tolist(), e.document_lengths) for e in examples]


def tree(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_llama_dir, source):
    out = tmp_path_factory.mktemp("prepared") / "set"
    cfg = config(tiny_llama_dir, source, out)
    cfg.num_proc = 2  # the several-process path once
    prepare(cfg)
    return out


@pytest.mark.parametrize("cap, dedup", [(None, True), (25, True), (None, False)])
def test_prepared_set_equals_the_in_process_examples(prepared, tmp_path, tiny_llama_dir, source, tiny_tokenizer, cap,
                                                     dedup):
    path = prepared if (cap, dedup) == (None, True) else \
        prepare(config(tiny_llama_dir, source, tmp_path / "other", max_conversations=cap, dedup=dedup))
    train, held_out, stats = build_datasets(str(path), tiny_tokenizer, max_length=MAX_LENGTH, eval_size=EVAL, seed=0,
                                            max_conversations=cap, dedup=dedup)
    want_train, want_eval, want_stats = in_process(source, tiny_tokenizer, max_conversations=cap, dedup=dedup)
    assert rows(train) == rows(want_train) and rows(held_out) == rows(want_eval)
    assert len(held_out) == EVAL and len(train) == (cap or 61 + (0 if dedup else COPIES)) - EVAL
    assert stats.duplicates == want_stats.duplicates == (0 if not dedup else 1 if cap else COPIES)
    assert all(e.input_ids.dtype == e.loss_mask.dtype == torch.long for e in train + held_out)
    if cap is None:  # a cap stops in-process reading early; the prepared counts then differ in reading skips
        assert stats.summary() == want_stats.summary()
    stored = load_train_rows(path)
    assert rows(stored) == rows(pack_examples(want_train, MAX_LENGTH))  # the trainer's packing of the same examples
    assert any(len(r.document_lengths) > 1 for r in stored)


def test_unchanged_is_reused_and_changes_rebuild(prepared, tiny_llama_dir, source, tmp_path, capsys):
    before = tree(prepared)
    prepare(config(tiny_llama_dir, source, prepared))
    assert f"reused {prepared}" in capsys.readouterr().out
    assert tree(prepared) == before

    out = tmp_path / "set"
    prepare(config(tiny_llama_dir, source, out))
    capsys.readouterr()
    fingerprints = {json.loads((out / MANIFEST).read_text())["fingerprint"]}
    changed_source = tmp_path / "more.jsonl"
    changed_source.write_text(open(source).read() + json.dumps(make_conversations(1, seed=9)[0]) + "\n")
    changes = [({"max_length": 200}, "data.max_length"), ({"chat_template": OTHER_TEMPLATE}, "chat template"),
               ({"pack": False}, "data.pack"), ({"dedup": False}, "data.dedup"),
               ({"path": str(changed_source)}, "source data")]
    for change, why in changes:  # each one change away from the base config (and so from the previous build)
        prepare(config(tiny_llama_dir, source, out, **change))
        first, *rest = capsys.readouterr().out.splitlines()
        assert first.startswith(f"rebuilding {out}: ") and why in first and rest[-1].startswith("prepared"), first
        fingerprints.add(json.loads((out / MANIFEST).read_text())["fingerprint"])
    assert len(fingerprints) == 6
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no work or temp dir left


def test_killed_run_restarts_cleanly(monkeypatch, prepared, tiny_llama_dir, source, tmp_path, capsys):
    out = tmp_path / "set"
    real, calls = prepare_module._tokenize_batch, []

    def dies_in_the_third_chunk(batch, *args, **kwargs):
        calls.append(len(batch["messages"]))
        if sum(calls) > 40:
            raise KeyboardInterrupt  # a kill
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(prepare_module, "_tokenize_batch", dies_in_the_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        prepare(config(tiny_llama_dir, source, out))
    assert not out.exists()
    work = [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.work-")]
    assert len(work) == 1 and len(list(work[0].glob("chunk_*.arrow"))) == 2  # the finished chunks

    calls.clear()
    monkeypatch.setattr(prepare_module, "save_rows", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):  # killed while writing: still no output
        prepare(config(tiny_llama_dir, source, out))
    assert not out.exists() and sum(calls) == 61 + COPIES - 32  # chunks 0 and 1 came from the cache

    monkeypatch.undo()
    prepare(config(tiny_llama_dir, source, out))
    manifest, want = json.loads((out / MANIFEST).read_text()), json.loads((prepared / MANIFEST).read_text())
    assert manifest["fingerprint"] == want["fingerprint"] and manifest["counts"] == want["counts"]
    assert {k: v for k, v in tree(out).items() if k != MANIFEST} == \
        {k: v for k, v in tree(prepared).items() if k != MANIFEST}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]


def train_refusal(target: str, data: str, tmp_path, capsys, *overrides: str) -> str:
    from recipes.train import main as train_main

    out = tmp_path / "run"
    args = [f"target.path={target}", "target.dtype=float32", "target.aux_layer_ids=[1,3,5]", "data=jsonl",
            f"data.path={data}", f"data.max_length={MAX_LENGTH}", f"data.eval_size={EVAL}", "data.pack=true",
            f"train.output_dir={out}", "train.max_steps=1", "train.ttt_steps=2", "train.report_to=none", *overrides]
    with pytest.raises(SystemExit) as exit_info:
        train_main(args)
    assert exit_info.value.code == 2 and not out.exists()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchspec-train: error: "), lines
    return lines[0]


@pytest.mark.parametrize("override, named", [
    ("data.max_length=200", f"it was prepared with data.max_length={MAX_LENGTH}, this run has data.max_length=200"),
    ("data.seed=1", "data.seed=0, this run has data.seed=1"),
])
def test_trainer_refuses_a_set_prepared_for_other_settings(prepared, tiny_llama_dir, tmp_path, capsys, override, named):
    line = train_refusal(tiny_llama_dir, str(prepared), tmp_path, capsys, override)
    assert f"data.path={prepared}" in line and named in line and "data_pipelines.prepare" in line, line


def test_another_tokenizer_or_template_is_refused(prepared):
    settings = {"format": "auto", "max_length": MAX_LENGTH, "on_too_long": "truncate", "max_conversations": None,
                "eval_size": EVAL, "seed": 0, "dedup": True}
    tokenizer = build_tiny_tokenizer(384)
    assert len(load_prepared(prepared, tokenizer, settings).train) == 61 - EVAL
    with pytest.raises(ValueError, match="another tokenizer"):
        load_prepared(prepared, build_tiny_tokenizer(320), settings)
    tokenizer.chat_template = OTHER_TEMPLATE  # what data.chat_template does
    with pytest.raises(ValueError, match=f"data.path={prepared}: its chat template .* differs"):
        load_prepared(prepared, tokenizer, settings)
    with pytest.raises(ValueError, match="prepared with data.dedup=true, this run has data.dedup=false"):
        load_prepared(prepared, build_tiny_tokenizer(384), settings | {"dedup": False})


def test_command_line(prepared, tiny_llama_dir, source, tmp_path, capsys):
    main(["--config", "prepare_sharegpt", f"target={tiny_llama_dir}", f"output={prepared}", f"data.path={source}",
          f"data.max_length={MAX_LENGTH}", f"data.eval_size={EVAL}", "num_proc=1", "chunk_size=16"])
    assert f"reused {prepared}" in capsys.readouterr().out
    for argv, named in [(["data.max_lenght=3"], "data.max_lenght: no such key in DataConfig; did you mean 'max_length'?"),
                        (["--config", "nope"], "--config nope: no such YAML file or config name"),
                        ([f"data.path={tmp_path / 'missing.jsonl'}", f"output={tmp_path / 'o'}"], "missing.jsonl")]:
        with pytest.raises(SystemExit) as exit_info:
            main([f"target={tiny_llama_dir}", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and named in err[0], err
        assert err[0].startswith("data_pipelines.prepare: error: ")
    assert not os.path.exists(tmp_path / "o")


def test_trainer_reads_packed_rows_instead_of_packing_again(prepared, monkeypatch, tiny_tokenizer, source):
    """recipes/train.py's pack_train_set: a packed prepared dir's stored rows are used as they are
    (== pack_examples of its training examples); a plain conversation file is still packed."""
    import recipes.train as train_recipe

    train_set, _, _ = in_process(str(prepared), tiny_tokenizer)
    expected = rows(pack_examples(train_set, MAX_LENGTH))
    monkeypatch.setattr(train_recipe, "pack_examples", lambda *a, **k: pytest.fail("packed again"))
    assert rows(train_recipe.pack_train_set(str(prepared), train_set, MAX_LENGTH)) == expected
    monkeypatch.setattr(train_recipe, "pack_examples", lambda examples, n: ["packed"])
    assert train_recipe.pack_train_set(source, train_set, MAX_LENGTH) == ["packed"]
