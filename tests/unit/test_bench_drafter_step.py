"""CPU smoke test of tools/bench_drafter_step.py at the tiny shape: the rows, their FLOP count
(recomputed here from the sizes), the merge into --out, the markdown table and --profile."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tool_loader import load_tool

KEYS = {"shape", "drafter", "head", "seq", "step_ms", "tokens_per_s", "tflops", "mfu", "peak_gib", "device",
        "ttt_steps", "batch", "git", "torch"}


@pytest.fixture(scope="module")
def bench():
    return load_tool("bench_drafter_step")


def expected_flops(shape: dict, drafter: str, head: str, t: int, k: int = 7) -> int:
    """The module docstring's formula, written out from the shape (window 4096 > t: full causal)."""
    h, v, i = shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"]
    heads, kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    attn_in = 2 * h if drafter == "eagle3" else h  # EAGLE-3's attention reads cat(embedding, hidden)
    n_step = attn_in * d * (heads + 2 * kv) + heads * d * h + 3 * h * i
    if drafter == "eagle3":
        n_step += shape["draft_vocab_size"] * h
    else:
        n_step += 2 * h * h + v * h  # eh_proj, full-vocabulary head
        if head == "efficient":
            n_step += shape["lm_head_rank"] * (h + v)
    return 6 * t * (3 * h * h + k * n_step) + k * 3 * 2 * 2 * (t * (t + 1) // 2) * heads * d


def test_tiny_rows_flops_merge_and_table(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)  # auto: fp32 on any CPU
    out = tmp_path / "rows.json"
    common = ["--shape", "tiny", "--seq", "32", "--warmup", "1", "--iters", "1", "--out", str(out)]
    rows = bench.main([*common, "--drafter", "eagle3", "eagle4", "--head", "full", "efficient"])
    assert [(r["drafter"], r["head"]) for r in rows] == [("eagle3", "full"), ("eagle4", "full"), ("eagle4", "efficient")]
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["device"] == "cpu" and r["mfu"] is None and r["peak_gib"] is None and r["precision"] == "fp32"
        # the tool rounds tokens/s to 0.1: on a slow (shared) CPU that is more than 1e-3 of ~13 tokens/s
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(32 / (r["step_ms"] / 1e3), rel=1e-3, abs=0.05)
        assert r["flops"] == expected_flops(bench.SHAPES["tiny"], r["drafter"], r["head"], 32)
        assert r["tflops"] == pytest.approx(r["flops"] / (r["step_ms"] / 1e3) / 1e12, abs=0.01)
    text = capsys.readouterr().out
    assert "skip tiny eagle3 efficient" in text
    assert "| shape | drafter | head | seq | step ms |" in text and "| tiny | eagle4 | efficient | 32 |" in text
    assert json.loads(out.read_text()) == rows

    again = bench.main([*common, "--drafter", "eagle4", "--head", "full", "--profile", "--profile-steps", "1"])
    assert "head_loss share" in capsys.readouterr().out
    assert 0 < again[0]["head_loss_share"] < 1  # ttt.py's record_function("head_loss") was found
    saved = json.loads(out.read_text())
    assert len(saved) == 3 and saved[-1] == again[0]  # the same case is replaced, not duplicated


def test_merge_rows_keeps_other_cases(bench, tmp_path):
    out = tmp_path / "rows.json"
    row = {"shape": "tiny", "drafter": "eagle4", "head": "full", "seq": 32, "batch": 1, "ttt_steps": 7,
           "precision": "fp32", "device": "cpu", "step_ms": 1.0}
    bench.merge_rows(out, [row])
    bench.merge_rows(out, [{**row, "seq": 64}, {**row, "step_ms": 2.0}])
    assert json.loads(out.read_text()) == [{**row, "seq": 64}, {**row, "step_ms": 2.0}]
    assert not list(tmp_path.glob(".rows.json.*"))  # no temporary file left behind
