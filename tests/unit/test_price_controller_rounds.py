"""tools/price_controller_rounds.py: speedups priced per round (acceptance x plain round ms / round ms, means
weighted by each kind's rounds), on hand-made rows whose answers are worked out here; repricing bench files;
one-line errors for files that are not bench output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tool_loader import load_tool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    return load_tool("price_controller_rounds")


def _row(**extra) -> dict:
    """A bench row: plain rounds of 2 ms; the best fixed shape 1.5 tokens a round at 2.5 ms; the controller 10
    plain-deferring rounds at 2 ms and 30 drafting ones at 3 ms (mean 2.75 ms), 1.65 tokens a round."""
    return {"drafter": "d", "concurrency": 64, "requests": 256, "best_fixed": "chain1", "speedup": 1.1,
            "acceptance": 1.65, "best_fixed_speedup": 1.0, "best_fixed_acceptance": 1.5,
            "plain_round_kinds": {"plain": {"rounds": 100, "ms": 2.0}},
            "best_fixed_round_kinds": {"spec": {"rounds": 80, "ms": 2.5}},
            "round_kinds": {"plain-deferring": {"rounds": 10, "ms": 2.0}, "d2w2": {"rounds": 30, "ms": 3.0}},
            **extra}


def test_a_run_is_priced_at_its_rounds_mean_time(tool):
    priced = tool.priced_fields(_row())
    assert set(priced) == {"best_fixed", "controller", "controller_vs_best_fixed"}  # no chain run in this row
    assert priced["best_fixed"] == pytest.approx(1.5 * 2.0 / 2.5)  # 1.2
    assert priced["controller"] == pytest.approx(1.65 * 2.0 / 2.75)  # 1.2: the plain rounds lower the mean
    assert priced["controller_vs_best_fixed"] == pytest.approx(1.0)
    assert tool.priced_speedup(1.0, {"plain": {"rounds": 3, "ms": 2.0}}, {"plain": {"rounds": 9, "ms": 2.0}}) == 1.0


def test_every_timed_run_is_priced(tool):
    row = _row(chain_round_kinds={"d1w1": {"rounds": 5, "ms": 2.2}}, chain_controller_acceptance=1.1,
               chain_controller_speedup=0.9, also_plans_round_kinds={"d1w1": {"rounds": 5, "ms": 2.2}},
               also_plans_acceptance=1.32, also_plans_speedup=1.0)
    priced = tool.priced_fields(row)
    assert priced["chain_controller"] == pytest.approx(1.0) and priced["also_plans"] == pytest.approx(1.2)


def test_files_are_repriced_and_written(tool, tmp_path, capsys):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"rows": [_row(), _row(concurrency=8)]}))
    out = tmp_path / "priced" / "out.json"
    entries = tool.main([str(src), "--out", str(out)])
    assert [e["concurrency"] for e in entries] == [64, 8]
    assert entries[0]["measured"] == {"best_fixed": 1.0, "controller": 1.1}
    assert entries[0]["priced"]["controller"] == pytest.approx(1.2)
    written = json.loads(out.read_text())
    assert written["rows"] == json.loads(json.dumps(entries)) and "refilled" in written["method"]
    assert "c=64" in capsys.readouterr().out


def test_the_committed_rows_reprice_and_plot(tool, tmp_path):
    """The twenty-sixth session's files: the averaged plans (its ``also_plans``) priced at c=1 within 2% of their
    measured speedup (one row, no closed-batch tail), and the plot of measured against priced is drawn."""
    bench = REPO / "docs" / "bench" / "controller_s26"
    png = tmp_path / "priced.png"
    entries = tool.main([str(bench / "controller_eagle4_h100.json"), str(bench / "controller_untrained_h100.json"),
                         "--plot", str(png)])
    first = next(e for e in entries if e["drafter"] == "eagle4" and e["concurrency"] == 1)
    assert first["also_plans"] == "average"
    assert first["priced"]["also_plans"] == pytest.approx(first["measured"]["also_plans"], rel=0.02)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("content, message", [
    (None, "is missing"),
    ("{not json", "is not valid JSON"),
    (json.dumps({"rows": [{"drafter": "d"}]}), "row 0 lacks"),
    (json.dumps({"rows": []}), "no rows to price"),
    (json.dumps({"rows": [_row(round_kinds={})]}), "hold no rounds"),
])
def test_bad_files_are_one_line_errors(tool, tmp_path, capsys, content, message):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as e:
        tool.main([str(path), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1
    assert not out.exists()
