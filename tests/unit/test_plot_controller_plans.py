"""``tools/plot_controller_plans.py``: one group of bars per (drafter, concurrency) from bench JSONs, a later file's
row replacing an earlier one's, and a one-line exit 2 for files without controller rows or not JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from plot_controller_plans import controller_rows, main  # noqa: E402


def row(drafter: str, c: int, speedup: float) -> dict:
    return {"drafter": drafter, "concurrency": c, "mode": "controller", "plans": "average", "also_plans": "held",
            "speedup": speedup, "acceptance": 2.0, "also_plans_speedup": speedup + 0.05,
            "also_plans_acceptance": 2.1, "best_fixed": "chain3", "best_fixed_speedup": 1.1,
            "best_fixed_acceptance": 2.0}


def bench(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "rows": rows}))
    return path


def test_rows_per_drafter_and_concurrency_and_the_png(tmp_path):
    first = bench(tmp_path / "a.json", [row("noise0.0", 64, 1.0), row("noise0.0", 1, 2.0),
                                        {"mode": "plain", "drafter": "noise0.0", "concurrency": 64}])
    later = bench(tmp_path / "b.json", [row("noise0.0", 64, 1.2), row("untrained", 8, 0.97)])
    rows, device = controller_rows([first, later])
    assert [(r["drafter"], r["concurrency"], r["speedup"]) for r in rows] == [
        ("noise0.0", 1, 2.0), ("noise0.0", 64, 1.2), ("untrained", 8, 0.97)]  # b's c=64 replaces a's
    assert device == "NVIDIA H100 80GB HBM3"
    out = tmp_path / "img" / "plans.png"
    main([str(out), str(first), str(later)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_exits_2_naming_the_file(tmp_path, capsys):
    empty = bench(tmp_path / "empty.json", [{"mode": "plain", "drafter": "x", "concurrency": 1}])
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    for path, says in ((empty, "--also-plans"), (broken, "is not JSON")):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path / "out.png"), str(path)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and str(path.name) in err and says in err and "\n" not in err
    assert not (tmp_path / "out.png").exists()
