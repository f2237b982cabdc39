"""data_pipelines.regenerate on a tiny random target (CPU, fp32, greedy unless said otherwise).

* every assistant turn equals the engine run on that turn alone, with the REGENERATED earlier turns
  as context (an oracle written here, turn by turn, one request at a time), although the pipeline
  batches turns of several conversations; a turn whose prompt no longer fits ends its conversation;
  records keep their own format (ShareGPT / OpenAI) and ids; a record with no reply is skipped;
* a run killed after some shards resumes: intact shards' conversations are not regenerated and
  the final shards are byte-identical to the uninterrupted run's;
* a finished output: the rerun does nothing (and loads no model); other settings are refused;
* a corrupted shard (truncated line, count, bytes, sidecar) is reported by name and regenerated, and
  refused by the trainer and by data_pipelines.prepare until then;
* sampling (temperature / top_p) is reproducible for a seed.
"""

from __future__ import annotations

import json
import shutil

import pytest

from data_pipelines import regen_output
from data_pipelines import regenerate as regenerate_module
from data_pipelines.regenerate import RegenerateConfig, TurnRegenerator, main, regenerate, worker_device
from torchspec.data import build_datasets
from torchspec.data.regenerated import CorruptShard, verify_shard, write_shard
from torchspec.runtime.loading import load_engine
from torchspec.targets import build_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_CONTEXT, MAX_NEW, SHARD = 192, 5, 3


def sharegpt(i: int, turns: int, long_user: int | None = None) -> dict:
    messages = []
    for t in range(turns):
        text = f"Question {i}.{t}: what is {i} plus {t}?" + (" word" * 90 if t == long_user else "")
        messages += [{"from": "human", "value": text}, {"from": "gpt", "value": f"It is {i + t}."}]
    return {"id": f"c{i}", "conversations": messages}


def openai(i: int) -> dict:
    return {"id": i, "messages": [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}"},
                                  {"role": "user", "content": "Again?"}, {"role": "assistant", "content": f"{i}!"}]}


RECORDS = [sharegpt(0, 2), sharegpt(1, 1), openai(2), {"conversations": [{"from": "human", "value": "alone"}]},
           sharegpt(4, 3), sharegpt(5, 2, long_user=1), {"messages": [{"role": "user", "content": "No id."},
                                                                      {"role": "assistant", "content": "Fine."}]},
           sharegpt(7, 1)]
REGENERABLE = [0, 1, 2, 4, 5, 6, 7]  # record 3 has no reply


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_tokenizer):
    """Untied and with larger weights than the default tiny target, so greedy replies are varied text."""
    return build_tiny_target(str(tmp_path_factory.mktemp("regen_target")), vocab_size=384, num_layers=2,
                             tokenizer=tiny_tokenizer, initializer_range=0.2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def engine(target):
    return load_engine(target, device="cpu", dtype="float32", max_batch=3, max_context=MAX_CONTEXT, page_size=8)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("regen_src") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return str(path)


def config(target: str, source: str, out, **kw) -> RegenerateConfig:
    return RegenerateConfig(**({"target": target, "source": source, "output": str(out), "shard_size": SHARD,
                                "concurrency": 3, "max_new_tokens": MAX_NEW, "max_context": MAX_CONTEXT,
                                "device": "cpu", "page_size": 8} | kw))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, target, source, engine):
    out = tmp_path_factory.mktemp("regen") / "out"
    regenerate(config(target, source, out), engine=engine)
    return out


def shards(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard_*"))}


def written(out) -> list[dict]:
    return [json.loads(line) for name, data in shards(out).items() if name.endswith(".jsonl")
            for line in data.decode().splitlines()]


def as_messages(record: dict) -> list[dict]:
    if "messages" in record:
        return record["messages"]
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[m["from"]], "content": m["value"]} for m in record["conversations"]]


def one_turn_at_a_time(engine, tokenizer, messages: list[dict]) -> list[dict]:
    """The oracle: each turn alone through engine.generate, its context the replies made so far."""
    out = []
    for message in messages:
        if message["role"] != "assistant":
            out.append(message)
            continue
        text = tokenizer.apply_chat_template(out, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= MAX_CONTEXT:
            break
        result = engine.generate([ids], max_new_tokens=MAX_NEW, concurrency=1)[0]
        tokens = result.token_ids[:-1] if result.finish_reason == "stop" else result.token_ids
        out.append({"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)})
    while out and out[-1]["role"] != "assistant":
        out.pop()
    return out


def test_every_turn_equals_the_engine_on_that_turn_alone(finished, engine, tiny_tokenizer):
    got = written(finished)
    assert [r.get("id") for r in got] == ["c0", "c1", 2, "c4", "c5", None, "c7"]
    assert ["messages" in r for r in got] == [False, False, True, False, False, True, False]  # own formats kept
    context_matters = False
    for record, regenerated in zip([RECORDS[i] for i in REGENERABLE], got):
        want = one_turn_at_a_time(engine, tiny_tokenizer, as_messages(record))
        assert as_messages(regenerated) == want, record.get("id")
        replies = [i for i, m in enumerate(want) if m["role"] == "assistant"]
        if len(replies) > 1:  # the 2nd turn, had it seen the ORIGINAL 1st reply, would differ
            original = as_messages(record)[: replies[1]]
            text = tiny_tokenizer.apply_chat_template(original, tokenize=False, add_generation_prompt=True)
            alt = engine.generate([tiny_tokenizer(text, add_special_tokens=False)["input_ids"]], max_new_tokens=MAX_NEW)[0]
            alt_ids = alt.token_ids[:-1] if alt.finish_reason == "stop" else alt.token_ids
            context_matters |= tiny_tokenizer.decode(alt_ids, skip_special_tokens=True) != want[replies[1]]["content"]
    assert context_matters  # so the comparison above tells regenerated context from the original one
    assert len(as_messages(got[4])) == 2 and as_messages(RECORDS[5])[2]["content"].endswith("word")  # c5 stopped
    sidecar = json.loads((finished / "shard_00001.json").read_text())
    assert sidecar["records"] == SHARD and sidecar["skipped"] == {"no_assistant_turn": 1, "stopped_prompt_too_long": 1}
    generation = json.loads((finished / "generation.json").read_text())
    assert generation["complete"] and generation["conversations"] == 7 and generation["records"] == 8
    assert generation["identity"]["temperature"] == 0.0 and generation["identity"]["dtype"] == "float32"
    assert {"target_fingerprint", "torchspec_version", "created", "settings"} <= set(generation)


def spy(monkeypatch) -> set[int]:
    """The record indices whose turns the next run submits."""
    seen: set[int] = set()

    class Spy(TurnRegenerator):
        def _submit(self, conversation, in_flight):
            seen.add(conversation.index)
            return super()._submit(conversation, in_flight)

    monkeypatch.setattr(regenerate_module, "TurnRegenerator", Spy)
    return seen


def test_resume_after_a_kill_skips_finished_shards(monkeypatch, finished, target, source, engine, tmp_path, capsys):
    out, writes = tmp_path / "out", []

    def killed_at_the_second_shard(*args, **kwargs):
        writes.append(args[1])
        if len(writes) == 2:
            raise KeyboardInterrupt
        return write_shard(*args, **kwargs)

    monkeypatch.setattr(regen_output, "write_shard", killed_at_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        regenerate(config(target, source, out), engine=engine)
    assert not engine.has_work and engine.free_pages == engine.total_pages  # requests in flight were cancelled
    monkeypatch.undo()
    intact = {int(p.stem.split("_")[1]) for p in out.glob("shard_*.jsonl")}
    assert len(intact) == 1 and not json.loads((out / "generation.json").read_text())["complete"]

    seen = spy(monkeypatch)
    regenerate(config(target, source, out))  # loads the target itself this time
    assert seen == {i for i in REGENERABLE if i // SHARD not in intact}
    assert shards(out) == shards(finished)
    assert "regenerated" in capsys.readouterr().out


def test_finished_output_does_nothing_and_other_settings_are_refused(monkeypatch, finished, target, source, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in finished.iterdir()}
    monkeypatch.setattr("torchspec.runtime.loading.load_engine", lambda *a, **k: pytest.fail("loaded a model"))
    args = ["--config", "regenerate_sharegpt", f"target={target}", f"source={source}", f"output={finished}",
            f"shard_size={SHARD}", "concurrency=3", f"max_new_tokens={MAX_NEW}", f"max_context={MAX_CONTEXT}",
            "device=cpu", "page_size=8"]
    main(args)
    assert f"regeneration in {finished} is complete (7 conversations in 3 shards); nothing to do" in \
        capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in finished.iterdir()} == before
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "temperature=0.7"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"data_pipelines.regenerate: error: output={finished} was generated with other "
                             "settings: temperature=0.0 (this run: 0.7)"), err


def truncate_a_line(shard):
    data = shard.read_bytes()
    shard.write_bytes(data[: data.index(b"\n") + 10])


CORRUPTIONS = {
    "truncated line": (truncate_a_line, "line 2 is not a JSON object"),
    "dropped line": (lambda s: s.write_bytes(s.read_bytes().split(b"\n", 1)[1]), "holds 1 conversations, its sidecar says 2"),
    "edited byte": (lambda s: s.write_bytes(s.read_bytes().replace(b"Question", b"Questiom", 1)), "size / sha256"),
    "no sidecar": (lambda s: s.with_suffix(".json").unlink(), "has no sidecar shard_00000.json"),
    "garbled sidecar": (lambda s: s.with_suffix(".json").write_text("{"), "is not a valid sidecar"),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_verify_shard_names_the_problem(tmp_path, kind):
    records = [{"id": 1, "messages": []}, {"id": 2, "messages": [{"role": "user", "content": "Question"}]}]
    write_shard(tmp_path, 0, records, {"ids": [1, 2]})
    assert verify_shard(tmp_path / "shard_00000.jsonl")[0] == records
    corrupt, message = CORRUPTIONS[kind]
    corrupt(tmp_path / "shard_00000.jsonl")
    with pytest.raises(CorruptShard, match=message.replace("(", r"\(")) as err:
        verify_shard(tmp_path / "shard_00000.jsonl")
    assert "shard_00000" in str(err.value)


def test_corrupted_shard_is_refused_then_regenerated(monkeypatch, finished, target, source, engine, tmp_path,
                                                     tiny_tokenizer, capsys):
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    kwargs = {"max_length": 256, "eval_size": 2, "seed": 0, "max_conversations": None}
    train, held_out, _ = build_datasets(str(out), tiny_tokenizer, **kwargs)  # an intact output is training data
    assert len(train) + len(held_out) == 7
    truncate_a_line(out / "shard_00001.jsonl")

    with pytest.raises(ValueError, match=r"shard_00001.jsonl line 2 is not a JSON object .*not read as training"):
        build_datasets(str(out), tiny_tokenizer, **kwargs)
    from data_pipelines.prepare import main as prepare_main

    with pytest.raises(SystemExit) as exit_info:
        prepare_main([f"target={target}", f"output={tmp_path / 'prepared'}", f"data.path={out}", "data.eval_size=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "shard_00001.jsonl line 2" in err[0], err
    assert not (tmp_path / "prepared").exists()

    seen = spy(monkeypatch)
    regenerate(config(target, source, out), engine=engine)
    assert f"{out / 'shard_00001.jsonl'} line 2 is not a JSON object (truncated or garbled): regenerating it" in \
        capsys.readouterr().out
    assert seen == {i for i in REGENERABLE if i // SHARD == 1}
    assert shards(out) == shards(finished)


def test_sampled_regeneration_is_reproducible(target, source, engine, tmp_path):
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        regenerate(config(target, source, out, temperature=0.8, top_p=0.9, seed=3, max_conversations=3), engine=engine)
    assert shards(outs[0]) == shards(outs[1]) and len(written(outs[0])) == 3
    assert json.loads((outs[0] / "generation.json").read_text())["identity"]["top_p"] == 0.9


def test_two_workers_deal_the_shards_and_write_the_same_output(finished, target, source, tmp_path, capsys):
    """num_workers=2 (two CPU processes here, one per GPU on CUDA): worker w owns shards k % 2 == w; the
    shards and totals equal the one-process run's, and a rerun finds the output complete."""
    out = tmp_path / "out"
    regenerate(config(target, source, out, num_workers=2))
    assert shards(out) == shards(finished)
    done, one = (json.loads((d / "generation.json").read_text()) for d in (out, finished))
    assert done["complete"] and done["shards"] == one["shards"] and done["generated_tokens"] == one["generated_tokens"]
    assert "regenerated 7 conversations" in capsys.readouterr().out
    regenerate(config(target, source, out, num_workers=2))
    assert "nothing to do" in capsys.readouterr().out


def test_workers_share_the_gpus_round_robin():
    """More workers than GPUs share them (one's host work overlaps another's forwards): worker w on cuda:(w % GPUs)."""
    assert [str(worker_device(w, "cuda", 2)) for w in range(5)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert [str(worker_device(w, "cuda", 1)) for w in range(2)] == ["cuda:0", "cuda:0"]
    assert str(worker_device(3, "cpu", 0)) == "cpu"


def test_workers_on_a_named_gpu_are_refused(target, source, tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(ValueError, match=r"device=cuda:1 with num_workers=3: worker w uses cuda:\(w % GPUs\)"):
        regenerate(config(target, source, tmp_path / "o", device="cuda:1", num_workers=3))
    assert not (tmp_path / "o").exists()


def test_a_workers_error_reaches_the_caller(finished, target, source, tmp_path):
    """A resumed output made by other weights: each worker refuses it, and the ValueError (exit 2 from the
    command line) reaches the caller; the intact shards are left as they were."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    generation = json.loads((out / "generation.json").read_text())
    (out / "generation.json").write_text(json.dumps({**generation, "complete": False, "target_fingerprint": "0" * 16}))
    for p in out.glob("shard_00002*"):
        p.unlink()
    before = shards(out)
    with pytest.raises(ValueError, match="was generated by a target with weights fingerprint 0000000000000000"):
        regenerate(config(target, source, out, num_workers=2))
    assert shards(out) == before
