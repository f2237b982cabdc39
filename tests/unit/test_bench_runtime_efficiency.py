"""`tools/bench_runtime_efficiency.py` runs end to end on CPU (tiny shape) and writes the contract's row keys.

The H200 numbers come from the same script with ``--device cuda``; this smoke run guards its
plumbing: every row carries the issue's keys, a round's cost in plain steps is round_ms /
plain_step_ms, and ``hbm_fraction`` is None where no copy rate was measured (CPU).
"""

import json
import subprocess
import sys
from pathlib import Path

KEYS = {"shape", "noise", "concurrency", "mode", "plain_tokens_per_s", "tokens_per_s", "speedup", "mean_acceptance",
        "efficiency", "identical_to_plain", "plain_step_ms", "round_ms", "round_cost_plain_steps", "hbm_fraction"}


def test_bench_runtime_efficiency_smoke(tmp_path):
    out = tmp_path / "eff.json"
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench_runtime_efficiency.py"
    subprocess.run([sys.executable, str(tool), "--shape", "tiny", "--device", "cpu", "--noise", "0.0",
                    "--concurrency", "1", "--max-new-tokens", "6", "--prompt-len", "8", "--repeats", "2", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["copy_rate_gb_per_s"] is None
    assert {r["mode"] for r in data["rows"]} == {"chain", "tree"}
    for row in data["rows"]:
        assert KEYS <= set(row)
        assert row["plain_step_ms"] > 0 and row["round_ms"] > 0 and row["hbm_fraction"] is None
        assert abs(row["round_cost_plain_steps"] - row["round_ms"] / row["plain_step_ms"]) < 1e-9
        assert len(row["speedup_repeats"]) == 2 and row["speedup"] == min(row["speedup_repeats"])  # lower middle
        assert abs(row["speedup"] - row["tokens_per_s"] / row["plain_tokens_per_s"]) < 1e-9
