"""`tools/bench_controller.py` on CPU: the controlled pair at the tiny shape, a drafter that agrees and an
untrained one, a small sweep. Checks the rows (the issue's keys, the best fixed shape beside the controller,
its decisions), that the untrained drafter's controller verifies almost nothing, and one-line errors.
CPU times mean nothing: no speedup is asserted."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from tests.cost_tables import linear_table
from tests.tool_loader import load_tool
from torchspec.runtime.calibration import ALPHAS
from torchspec.runtime.controller_policy import RANK_BUCKETS

ARGS = ["--shape", "tiny", "--concurrency", "1,2", "--chains", "1,3", "--trees", "2x2x3,3x2x4",
        "--max-new-tokens", "12", "--prompt-len", "8", "--num-prompts", "2", "--repeats", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_controller")


@pytest.fixture(scope="module")
def result(tool, tmp_path_factory):
    """A run on a hand-built table of the tool's own engine key (CPU-measured times would make the decisions
    noise): a depth 2% and a verified node 10% of a plain step."""
    root = tmp_path_factory.mktemp("controller")
    args = tool.build_parser().parse_args([*ARGS, "--noise", "0.0", "--out", str(root / "unused.json")])
    _, engine = next(tool.engines(args, tool.check_args(args), 2, 64))
    costs = root / "costs.json"
    linear_table(engine, 0.02, 0.1, widths=[1, 2], nodes=list(range(5)), batches=(1, 2, 4, 512)).save(costs)
    out = root / "controller.json"
    tool.main([*ARGS, "--noise", "0.0,untrained", "--costs", str(costs), "--out", str(out)])
    return json.loads(out.read_text()), out


def test_rows_hold_the_issue_keys_and_the_best_fixed_shape(result):
    data, out = result
    rows = data["rows"]
    assert [(r["drafter"], r["concurrency"]) for r in rows] == [
        ("controlled_noise0.0", 1), ("controlled_noise0.0", 2), ("untrained", 1), ("untrained", 2)]
    for r in rows:
        for key in ("drafter", "target", "mode", "concurrency", "temperature", "speedup", "acceptance",
                    "best_fixed", "best_fixed_speedup", "decisions", "sweep", "chain_controller_speedup"):
            assert key in r, key
        assert r["best_fixed"] in r["sweep"] and set(r["sweep"]) == {"chain1", "chain3", "tree2x2x3", "tree3x2x4"}
        assert r["within"] == "tree3x2x4" and sum(n for _, _, n in r["decisions"]) > 0
        assert all(0 <= d <= 3 and 0 <= w <= 4 and (d > 0 or w == 0) for d, w, _ in r["decisions"])  # d 0: a plain round
        assert all(w <= 3 for _, w, _ in r["chain_decisions"])  # a chain verifies at most its depth
        assert r["controller_chain_from_batch"] is None and r["controller_drafts"] == "tree"  # the table has no rule
        assert r["requests"] == 2  # --num-prompts 2: a closed batch at c=1 and 2 (--requests-per-slot 1)
        for key in ("steady_speedup", "best_fixed_steady_speedup"):  # a closed batch of c rows runs full at first
            assert r[key] > 0, key
        assert r["controller_vs_best_fixed_steady"] == pytest.approx(r["steady_speedup"] / r["best_fixed_steady_speedup"])
        cal = r["calibration_at_end"]  # how the held controller's widths were rated
        assert cal["exponent"] in ALPHAS and len(cal["ratio_by_rank"]) == len(cal["scale_by_rank"]) == RANK_BUCKETS
        assert all(0 <= s <= 4.0 for s in cal["scale_by_rank"])  # Calibration(most=4.0)
        assert len(cal["accepted_by_rank"]) == len(cal["expected_by_rank"]) == RANK_BUCKETS
        assert cal["expected_by_rank"][0] > 0 and all(a >= 0 for a in cal["accepted_by_rank"])  # rank 0 is verified
    assert set(data["chain_from_batch"]) == {"controlled_noise0.0", "untrained"}
    assert "priced" in data["chain_from_batch_basis"]
    assert data["cuda_graphs"] is False and not out.with_suffix(".costs.json").exists()  # --costs: none measured


def test_the_untrained_drafter_is_not_verified_and_the_good_one_is(result):
    rows = {(r["drafter"], r["concurrency"]): r for r in result[0]["rows"]}
    rounds = [(w, n) for c in (1, 2) for _, w, n in rows[("untrained", c)]["decisions"]]
    plain_rounds = sum(n for w, n in rounds if w == 0)
    assert plain_rounds >= 0.7 * sum(n for _, n in rounds)  # decodes plainly once its confidence is calibrated
    assert rows[("untrained", 1)]["acceptance"] == pytest.approx(1.0, abs=0.05)
    assert rows[("controlled_noise0.0", 1)]["sweep"]["chain3"]["acceptance"] > 1.5  # the pair agrees


@pytest.mark.parametrize("bad, message", [(["--trees", "5x8"], "--trees entry"), (["--concurrency", "0"], "--concurrency"),
                                          (["--costs", "/nonexistent.json"], "--costs"), (["--repeats", "0"], "--repeats"),
                                          (["--target", "x"], "--target needs"),
                                          (["--chain-from-batch", "0"], "--chain-from-batch"),
                                          (["--requests-per-slot", "0"], "--requests-per-slot"),
                                          (["--also-plans", "held"], "how the runtime plans already"),
                                          (["--target", "x", "--drafter", "untrained"], "name=<export dir>")])
def test_bad_options_are_one_line_errors(tool, tmp_path, capsys, bad, message):
    with pytest.raises(SystemExit) as err:
        tool.main([*ARGS, *bad, "--out", str(tmp_path / "x.json")])
    assert err.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_real_target_with_its_drafter_untrained(tool, tmp_path, tiny_tokenizer):
    """--target with exported drafters, one of them re-initialised as training starts it: it is served (its rows
    exist) and its layer really differs from the export's."""
    from tests.runtime_pair import build_pair

    target, drafter = build_pair(tmp_path / "pair", tiny_tokenizer, num_layers=4)
    out = tmp_path / "real.json"
    tool.main(["--target", target, "--drafter", f"good={drafter}", "--drafter", f"untrained={drafter}",
               "--concurrency", "1", "--chains", "2", "--trees", "2x2x3", "--max-new-tokens", "8", "--prompt-len", "6",
               "--repeats", "1", "--num-prompts", "1", "--device", "cpu", "--out", str(out)])
    rows = {r["drafter"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"good", "untrained"}
    assert rows["good"]["sweep"]["chain2"]["acceptance"] > rows["untrained"]["sweep"]["chain2"]["acceptance"]


def test_without_a_table_the_costs_are_measured_and_written(tool, tmp_path, monkeypatch):
    """Measured once for the run's drafters of one architecture (two noise levels: one profile), and written;
    each drafter starts its own calibration on that one table (the last drafter's evidence says nothing of it)."""
    import torchspec.runtime.cost_profile as cost_profile
    from torchspec.runtime.engine import SpeculativeEngine

    profiles, real = [], cost_profile.profile_costs
    monkeypatch.setattr(cost_profile, "profile_costs", lambda *a, **k: profiles.append(1) or real(*a, **k))
    changed, forget = [], SpeculativeEngine.drafter_changed
    monkeypatch.setattr(SpeculativeEngine, "drafter_changed", lambda self: changed.append(1) or forget(self))
    out = tmp_path / "c.json"
    tool.main(["--shape", "tiny", "--noise", "0.0,untrained", "--concurrency", "1", "--chains", "1", "--trees",
               "2x2x3", "--max-new-tokens", "6", "--prompt-len", "6", "--repeats", "2", "--num-prompts", "1",
               "--device", "cpu", "--out", str(out)])  # two repeats: the controller's pairs end on a plain run
    assert all(len(r["calibration_at_end"]["scale_by_rank"]) == RANK_BUCKETS for r in json.loads(out.read_text())["rows"])
    table = json.loads(out.with_suffix(".costs.json").read_text())
    assert table["version"] == 2 and len(table["round_ms"]) == 1 and table["nodes"][0] == 0 and table["batches"] == [1]
    assert len(profiles) == 1 and len(json.loads(out.read_text())["rows"]) == 2
    assert len(changed) == 2


def test_chain_from_batch_is_where_the_chain_keeps_winning(tool):
    rows = [{"drafter": "d", "concurrency": c, "speedup": t, "chain_controller_speedup": ch}
            for c, t, ch in ((1, 2.0, 1.5), (8, 1.6, 1.7), (64, 1.1, 1.3))]
    assert tool.chain_from_batch(rows) == {"d": 8}
    rows[1]["chain_controller_speedup"] = 1.5  # a loss at 8: only from 64 on
    assert tool.chain_from_batch(rows) == {"d": 64}
    rows[2]["chain_controller_speedup"] = 1.0
    assert tool.chain_from_batch(rows) == {"d": None}


def test_a_closed_batch_judges_the_chain_by_its_rounds_priced(tool):
    """In a closed batch (requests < 2 x c) the rounds' priced speedups decide (the measured ones carry the
    slowest rows' tail); where slots were refilled, or at c=1, the measured ones do."""
    def row(c, requests, measured, priced):
        return {"drafter": "d", "concurrency": c, "requests": requests, "speedup": measured[0],
                "chain_controller_speedup": measured[1],
                "priced": {"controller": priced[0], "chain_controller": priced[1]}}
    closed = [row(1, 8, (1.3, 1.0), (1.3, 1.0)), row(64, 64, (1.05, 0.97), (1.21, 1.24))]
    assert tool.chain_from_batch(closed) == {"d": 64}  # the s26 H100 rows' shape: the tail hid the chain's win
    refilled = [closed[0], row(64, 256, (1.05, 0.97), (1.21, 1.24))]
    assert tool.chain_from_batch(refilled) == {"d": None}  # measured with refilled slots: the measurement decides
    assert not tool.chain_wins({**closed[1], "priced": {"controller": 1.3, "chain_controller": 1.2}})


def test_rows_say_where_the_rounds_time_goes(result):
    """Each run's rounds by kind: plain decoding's are plain steps; the controller's are its plans (a plain
    streak's rounds "plain-deferring"; under the default held plans, "held dXwY" for a plan run undecided), one
    per round it traced, each with a mean wall time."""
    for r in result[0]["rows"]:
        assert set(r["plain_round_kinds"]) == {"plain"} and set(r["best_fixed_round_kinds"]) == {"spec"}
        for kinds, decisions in ((r["round_kinds"], r["decisions"]), (r["chain_round_kinds"], r["chain_decisions"])):
            labels = {f"{held}d{d}w{w}" for d, w, _ in decisions if w for held in ("", "held ")} | {"plain-deferring"}
            assert set(kinds) <= labels and all(v["ms"] > 0 for v in kinds.values()), (kinds, decisions)
            assert sum(v["rounds"] for v in kinds.values()) == sum(n for _, _, n in decisions)
        priced = r["priced"]  # every run priced per round from these kinds (tools/price_controller_rounds.py)
        assert set(priced) == {"best_fixed", "controller", "chain_controller", "controller_vs_best_fixed"}
        assert priced["controller_vs_best_fixed"] == pytest.approx(priced["controller"] / priced["best_fixed"])


@pytest.mark.parametrize("also", ["last", "average"])
def test_the_controller_rows_draft_chains_from_the_given_batch(tool, tmp_path, also):
    """``--chain-from-batch 2``: the controller as it would serve with that rule -- the tree at c=1, a chain at c=2
    (verifying at most the chain's depth); ``--also-plans last`` / ``average``: beside it (the default, averaged
    plans held while they repeat), the controller planning from the last round's ratings alone, or deciding every
    round, timed and counted in the same rows (held rounds among the default's round kinds, priced with the rest)."""
    args = tool.build_parser().parse_args([*ARGS, "--noise", "0.0", "--out", str(tmp_path / "unused.json")])
    _, engine = next(tool.engines(args, tool.check_args(args), 2, 64))
    costs = tmp_path / "costs.json"
    linear_table(engine, 0.02, 0.1, widths=[1, 2], nodes=list(range(5)), batches=(1, 2, 4, 512)).save(costs)
    out = tmp_path / "ruled.json"
    tool.main([*ARGS, "--noise", "0.0", "--costs", str(costs), "--chain-from-batch", "2", "--also-plans", also,
               "--requests-per-slot", "2",
               "--out", str(out)])
    rows = {r["concurrency"]: r for r in json.loads(out.read_text())["rows"]}
    for r in rows.values():
        assert r["plans"] == "held" and r["also_plans"] == also
        assert r["also_plans_speedup"] > 0 and r["also_plans_acceptance"] >= 1
        assert sum(n for _, _, n in r["also_plans_decisions"]) == sum(v["rounds"] for v in
                                                                     r["also_plans_round_kinds"].values())
    assert not any(k.startswith("held") for r in rows.values() for k in r["also_plans_round_kinds"])
    assert any(k.startswith("held") for r in rows.values() for k in r["round_kinds"])  # the default holds
    assert "TORCHSPEC_CONTROLLER_PLANS" not in os.environ  # set for the runs inside only
    assert [rows[c]["controller_drafts"] for c in (1, 2)] == ["tree", "chain"]
    assert [rows[c]["requests"] for c in (1, 2)] == [2, 4]  # --requests-per-slot 2: each slot refilled once
    assert rows[2]["controller_chain_from_batch"] == 2
    assert all(w <= 3 for _, w, _ in rows[2]["decisions"])
    data = json.loads(out.read_text())
    assert "chain_from_batch" not in data and "rule was in effect" in data["chain_from_batch_note"]


def test_a_table_that_did_not_measure_a_concurrency_is_refused(tool, result, tmp_path, capsys):
    """A ``--costs`` table without one of the ``--concurrency`` levels among its batches would price that level's
    rounds from another batch's costs (the thirty-first session's c = 1 row on an H200): refused before anything
    runs, naming the file, the batches it has, those it lacks and the profile that fills them."""
    data = json.loads(pathlib.Path(result[1]).with_name("costs.json").read_text())
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({**data, "batches": [2], "depth_ms": [[row[1]] for row in data["depth_ms"]]}))
    with pytest.raises(SystemExit) as err:
        tool.main([*ARGS, "--noise", "0.0", "--costs", str(partial), "--out", str(tmp_path / "x.json")])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.value.code == 2 and str(partial) in message
    assert "measured batches [2], not --concurrency [1]" in message and "--batches 1,2)" in message
    assert not (tmp_path / "x.json").exists()
