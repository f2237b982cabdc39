"""torchspec-generate's and torchspec-bench's bad-input tables: every option, path and prompt file is
refused in one line (exit 2) before a model loads; no output file appears."""

from __future__ import annotations

import pytest

from tests.integration.bad_input import (
    bad_input_world,  # noqa: F401 (the world fixture)
    check_refused,
    scratch_copy,
    truncate,
)


def a_dir(tmp, world):
    (tmp / "adir").mkdir()
    return tmp / "adir"


def garbage_jsonl(tmp, world):
    (tmp / "prompts.jsonl").write_text('{"prompt": "fine"}\nnot json\n')
    return tmp / "prompts.jsonl"


def empty_prompts(tmp, world):
    (tmp / "prompts.txt").write_text("\n\n")
    return tmp / "prompts.txt"


def truncated_export(tmp, world):
    export = scratch_copy(world.export, tmp / "export")
    truncate(export / "model.safetensors")
    return export


def garbage_export_config(tmp, world):
    export = scratch_copy(world.export, tmp / "export")
    (export / "config.json").write_text("[1, 2")
    return export


# (id, extra argv (placeholders {tmp}, {made}, {e3}, {run}), culprit, setup)
GENERATE = [
    ("max_new_tokens_negative", ["--max-new-tokens", "-5"], "--max-new-tokens=-5", None),
    ("max_new_tokens_not_int", ["--max-new-tokens", "many"], "--max-new-tokens", None),
    ("num_prompts_zero", ["--num-prompts", "0"], "--num-prompts=0", None),
    ("top_p_zero", ["--top-p", "0"], "top_p", None),
    ("temperature_negative", ["--temperature", "-1"], "temperature", None),
    ("top_k_negative", ["--top-k", "-2"], "top_k", None),
    ("depth_zero", ["--depth", "0"], "depth", None),
    ("num_nodes_too_many", ["--num-nodes", "100000"], "num_nodes", None),
    ("branching_not_ints", ["--branching", "4,x"], "--branching", None),
    ("candidates_unknown", ["--candidates", "best"], "--candidates", None),
    ("max_batch_zero", ["--max-batch", "0"], "--max-batch=0", None),
    ("max_context_one", ["--max-context", "1"], "--max-context=1", None),
    ("page_size_zero", ["--page-size", "0"], "--page-size=0", None),
    ("dtype_unknown", ["--dtype", "fp8"], "--dtype", None),
    ("device_unknown", ["--device", "tpu9"], "--device='tpu9'", None),
    ("drafter_missing", ["--drafter", "{tmp}/nope"], "{tmp}/nope", None),
    ("drafter_not_an_export", ["--drafter", "{e3}"], "{e3}", None),
    ("drafter_is_a_run", ["--drafter", "{run}"], "{run}/config.json is missing", None),
    ("drafter_truncated", ["--drafter", "{made}"], "{made}/model.safetensors", truncated_export),
    ("drafter_config_garbage", ["--drafter", "{made}"], "{made}/config.json", garbage_export_config),
    ("no_drafter", ["--drafter", ""], "needs --drafter", None),
    ("prompts_file_missing", ["--prompts-file", "{tmp}/nope.txt"], "{tmp}/nope.txt", None),
    ("prompts_file_directory", ["--prompts-file", "{made}"], "is a directory", a_dir),
    ("prompts_file_garbage", ["--prompts-file", "{made}"], "{made}", garbage_jsonl),
    ("prompts_file_empty", ["--prompts-file", "{made}"], "{made}", empty_prompts),
    ("json_is_a_directory", ["--json", "{made}"], "{made}", a_dir),
    ("target_missing", ["--target", "{tmp}/no_model"], "{tmp}/no_model", None),
]
BENCH = [
    ("concurrency_zero", ["--concurrency", "0"], "--concurrency=0", None),
    ("concurrency_not_ints", ["--concurrency", "1,a"], "--concurrency='1,a'", None),
    ("concurrency_empty", ["--concurrency", ","], "--concurrency=','", None),
    ("temperature_negative", ["--temperature", "0,-1"], "temperature", None),
    ("shape_unknown", ["--shapes", "tree,star"], "star", None),
    ("top_p_too_big", ["--top-p", "2"], "top_p", None),
    ("max_new_tokens_zero", ["--max-new-tokens", "0"], "--max-new-tokens=0", None),
    ("repeats_zero", ["--repeats", "0"], "--repeats=0", None),
    ("num_prompts_zero", ["--num-prompts", "0"], "--num-prompts=0", None),
    ("prompt_set_missing", ["--prompt-set", "{tmp}/nope.txt"], "{tmp}/nope.txt", None),
    ("out_is_a_directory", ["--out", "{made}"], "{made}", a_dir),
    ("no_spec", ["--no-spec"], "--drafter", None),
    ("drafter_missing", ["--drafter", "{tmp}/nope"], "{tmp}/nope", None),
]


def _argv(cli, extra, values, world, tmp_path):
    base = ["--target", world.target, "--drafter", str(world.export), "--device", "cpu", "--max-context", "64"]
    base += (["--prompt", "hello", "--json", str(tmp_path / "out.json")] if cli == "generate"
             else ["--prompt-set", str(values["prompts"]), "--out", str(tmp_path / "out.json")])
    extra = [a.format(**values) for a in extra]
    if "--drafter" in extra and extra[extra.index("--drafter") + 1] == "":  # no --drafter at all
        i = base.index("--drafter")
        del base[i:i + 2], extra[extra.index("--drafter"):extra.index("--drafter") + 2]
    return base + extra


def _case(cli, extra, culprit, setup, world, tmp_path, capfd):
    made = setup(tmp_path, world) if setup else None
    (tmp_path / "prompts_ok.txt").write_text("hello there\none two three\n")
    values = {"tmp": tmp_path, "made": made, "e3": world.e3, "run": world.run, "prompts": tmp_path / "prompts_ok.txt"}
    check_refused(cli, _argv(cli, extra, values, world, tmp_path), culprit.format(**values), [world.root, tmp_path],
                  capfd, absent=(tmp_path / "out.json",))


@pytest.mark.parametrize("name, extra, culprit, setup", GENERATE, ids=[c[0] for c in GENERATE])
def test_generate_refuses_in_one_line(name, extra, culprit, setup, world, tmp_path, capfd):
    _case("generate", extra, culprit, setup, world, tmp_path, capfd)


@pytest.mark.parametrize("name, extra, culprit, setup", BENCH, ids=[c[0] for c in BENCH])
def test_bench_refuses_in_one_line(name, extra, culprit, setup, world, tmp_path, capfd):
    _case("bench", extra, culprit, setup, world, tmp_path, capfd)


def test_checks_run_before_any_model_loads(world, tmp_path, capfd, monkeypatch):
    """The refusals above come from the argument checks, not from a loaded model: loading is forbidden here."""
    import torchspec.runtime.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(torchspec.runtime.loading, "load_engine", no_loading)
    for cli, extra, culprit in (("generate", ["--max-new-tokens", "-5"], "--max-new-tokens=-5"),
                                ("generate", ["--drafter", str(tmp_path / "nope")], "nope"),
                                ("bench", ["--concurrency", "0"], "--concurrency=0")):
        _case(cli, extra, culprit, None, world, tmp_path, capfd)


def test_debug_shows_the_traceback(world, tmp_path):
    from recipes.generate import main

    with pytest.raises(ValueError, match="--max-new-tokens=-5"):
        main(["--target", world.target, "--no-spec", "--prompt", "x", "--max-new-tokens", "-5", "--debug"])


def test_subprocess_generate_refuses(world, tmp_path):
    check_refused("generate", ["--target", world.target, "--drafter", str(world.export), "--device", "cpu",
                               "--prompt", "hi", "--max-new-tokens", "-5"], "--max-new-tokens=-5", [world.root, tmp_path])


def test_subprocess_bench_refuses(world, tmp_path):
    check_refused("bench", ["--target", world.target, "--drafter", str(world.e3), "--device", "cpu",
                            "--out", str(tmp_path / "b.json")], str(world.e3), [world.root, tmp_path],
                  absent=(tmp_path / "b.json",))
