"""The measured cost table (torchspec/runtime/cost_table.py) and ``torchspec-profile`` on CPU.

The CLI profiles the tiny target/drafter pair of ``tests/runtime_pair.py`` on a small grid and must
write a complete table keyed like the engine the runtime would load; a table of another setup is
refused naming both keys; the lookups interpolate batches, nodes and contexts, clamp contexts and
batches below the first (warned); bad input exits 2 leaving an existing table as it was; profiling leaves an engine as it
found it. (CPU times mean nothing: only their presence and shape are checked.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from recipes.profile_costs import main as profile_main
from tests.runtime_pair import build_pair
from torchspec.runtime.cost_profile import profile_costs
from torchspec.runtime.cost_table import TABLE_VERSION, CostKey, CostTable, cost_key, drafter_identity
from torchspec.runtime.loading import load_engine

GRID = {"--batches": "2,1", "--widths": "1,2", "--nodes": "0,1,3", "--contexts": "8,24", "--repeats": "2"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("cost_pair"), num_layers=4)


@pytest.fixture(scope="module")
def profiled(pair, tmp_path_factory):
    """The CLI run once over an existing output file: (table path, plot path)."""
    out_dir = tmp_path_factory.mktemp("costs")
    out, png = out_dir / "costs.json", out_dir / "costs.png"
    out.write_text("an older table")
    argv = ["--target", pair[0], "--drafter", pair[1], "--out", str(out), "--plot", str(png), "--chain-from-batch", "2"]
    profile_main(argv + [x for kv in GRID.items() for x in kv])
    return out, png


def cli_args(pair, out, **changes) -> list[str]:
    args = {"--target": pair[0], "--drafter": pair[1], "--out": str(out), **GRID, **changes}
    return [x for kv in args.items() for x in kv]


def test_cli_writes_a_complete_table(profiled):
    out, png = profiled
    data = json.loads(out.read_text())  # replaced: the older content is gone
    assert data["version"] == TABLE_VERSION
    assert set(data) == {"version", "key", "widths", "nodes", "batches", "contexts", "depth_ms", "verify_ms", "round_ms",
                         "overhead_ms", "round_extra_ms", "chain_from_batch", "meta"}
    assert set(data["key"]) == {"device", "tp", "target", "drafter", "dtype"}
    assert data["key"]["device"] == "cpu" and data["key"]["tp"] == 1 and data["key"]["dtype"] == "float32"
    assert (data["batches"], data["widths"], data["nodes"], data["contexts"]) == ([1, 2], [1, 2], [0, 1, 3], [8, 24])
    table = CostTable.load(out, None)
    assert list(table.depth.shape) == [2, 2, 2] and list(table.verify.shape) == [2, 2, 3]
    assert (table.depth > 0).all() and (table.verify > 0).all()
    assert table.meta["repeats"] == 2 and "wall-clock" in table.meta["timing"]
    assert table.chain_from_batch == 2  # --chain-from-batch: the controller's chain rule, recorded
    assert list(table.overhead.shape) == [2] and (table.overhead >= 0).all() and "plain decode" in table.meta["overhead"]
    assert list(table.round_extra.shape) == [2] and (table.round_extra >= 0).all()  # depth 0 as served
    assert "fixed depth-1 rounds (top-2" in table.meta["round_extra"]
    assert table.depth_ms(2, 16).shape == (2,) and table.verify_ms(1, 8).shape == (4,)
    assert table.round.shape == (2, 2) and table.round_ms(2, 16).dim() == 0 and float(table.round_ms(2, 16)) > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["costs.json", "costs.png"]  # no temporary left


def test_table_key_is_the_loaded_engines_and_a_mismatch_is_refused(profiled, pair):
    engine = load_engine(pair[0], pair[1], device="cpu", dtype="float32", max_batch=1, max_context=32)
    key = cost_key(engine.decoder, engine.runner)
    assert CostTable.load(profiled[0], key).key == key
    export_config = json.loads((Path(pair[1]) / "config.json").read_text())
    assert key.drafter == drafter_identity(type(engine.runner.config)(**{
        k: v for k, v in export_config.items() if k in engine.runner.config.ARCH_FIELDS}))
    other = dataclasses.replace(key, device="NVIDIA H200", dtype="bfloat16")
    with pytest.raises(ValueError) as err:
        CostTable.load(profiled[0], other)
    message = str(err.value)
    assert "\n" not in message and "torchspec-profile" in message and "differ: device, dtype" in message
    for k in (key, other):  # both keys, field by field
        assert k.describe() in message


def hand_table() -> CostTable:
    """depth = ctx/100 + batch + width/10; verify = ctx/100 + batch + node; round = ctx/100 + batch + 0.5 (exactly
    linear in each)."""
    contexts, batches, widths, nodes = [100, 300], [1, 4, 8], [1, 2], [0, 2, 6]
    depth = [[[c / 100 + b + w / 10 for w in widths] for b in batches] for c in contexts]
    verify = [[[c / 100 + b + n for n in nodes] for b in batches] for c in contexts]
    key = CostKey(device="cpu", tp=1, target="t", drafter="d", dtype="float32")
    whole = [[c / 100 + b + 0.5 for b in batches] for c in contexts]
    return CostTable(key=key, widths=widths, nodes=nodes, batches=batches, contexts=contexts, depth=depth,
                     verify=verify, round=whole, meta={"timing": "by hand"}, overhead=[0.125, 0.25, 0.5])


def test_lookups_interpolate_batches_nodes_and_contexts_and_clamp_contexts():
    table = hand_table()
    close = dict(rtol=0, atol=1e-5)
    torch.testing.assert_close(table.depth_ms(3, 200), torch.tensor([2 + 3 + 0.1, 2 + 3 + 0.2]), **close)  # b 3
    torch.testing.assert_close(table.depth_ms(4, 100), torch.tensor([1 + 4 + 0.1, 1 + 4 + 0.2]), **close)
    torch.testing.assert_close(table.depth_ms(1, 10), table.depth_ms(1, 100), **close)  # below: the first bucket
    torch.testing.assert_close(table.depth_ms(8, 5000), table.depth_ms(8, 300), **close)  # above: the last bucket
    verify = table.verify_ms(5, 250)  # b 5, ctx 250 -> 2.5
    assert verify.dtype == torch.float32 and verify.shape == (7,)  # node counts 0..6
    torch.testing.assert_close(verify, torch.tensor([2.5 + 5 + n for n in range(7)]), **close)
    torch.testing.assert_close(table.round_ms(6, 300), torch.tensor(3 + 6 + 0.5), **close)
    assert table.overhead_ms(6) == pytest.approx(0.25 + 0.5 * 0.25, abs=1e-9)  # halfway from b 4 to b 8
    for bad in (0, 9):
        with pytest.raises(ValueError, match=r"batch=\d+ is outside .*\[1, 4, 8\].*--batches"):
            table.depth_ms(bad, 100)
    with pytest.raises(ValueError, match="ctx=-1"):
        table.verify_ms(1, -1)


def test_a_batch_below_the_first_measured_reads_as_the_first_and_is_warned_once(caplog):
    """A table measured from batch 4 prices a lone row at batch 4's costs (not a guess below what was measured),
    and says so once per table and batch, naming the fix."""
    full = hand_table()
    from4 = dataclasses.replace(full, key=dataclasses.replace(full.key, target="from4"), batches=[4, 8],
                                depth=full.depth[:, 1:], verify=full.verify[:, 1:], round=full.round[:, 1:],
                                overhead=full.overhead[1:])
    with caplog.at_level("WARNING", logger="torchspec.runtime.cost_table"):
        torch.testing.assert_close(from4.verify_ms(1, 100), full.verify_ms(4, 100), rtol=0, atol=1e-6)
        torch.testing.assert_close(from4.depth_ms(2, 100), full.depth_ms(4, 100), rtol=0, atol=1e-6)
        from4.round_ms(1, 300), from4.overhead_ms(1)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned  # batch 1 once, batch 2 once
    assert "no batch 1" in warned[0] and "batch 4's costs" in warned[0] and "--batches from 1" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="torchspec.runtime.cost_table"):
        full.verify_ms(1, 100), from4.verify_ms(4, 100)  # measured batches: nothing to say
    assert not caplog.records


def test_table_round_trips_and_bad_tables_are_refused(tmp_path):
    table = hand_table()
    table.save(tmp_path / "t.json")
    again = CostTable.load(tmp_path / "t.json", table.key)
    torch.testing.assert_close(again.depth, table.depth, rtol=1e-3, atol=0)  # 4 significant digits
    assert (again.widths, again.nodes, again.batches, again.contexts) == (table.widths, table.nodes, table.batches,
                                                                          table.contexts)
    good = table.to_dict()
    torch.testing.assert_close(again.round, table.round, rtol=1e-3, atol=0)
    torch.testing.assert_close(table.round_ms(5, 250), torch.tensor(2.5 + 5 + 0.5), rtol=0, atol=1e-5)
    torch.testing.assert_close(again.overhead, table.overhead, rtol=1e-3, atol=1e-4)
    before = CostTable.from_dict({k: v for k, v in good.items() if k != "overhead_ms"})  # written before the column
    assert before.overhead.tolist() == [0.0] * 3 and before.overhead_ms(5) == 0.0
    assert again.overhead_ms(3) == pytest.approx(0.125 + 2 / 3 * 0.125, abs=1e-4)  # b 3: between 1 and 4
    assert before.chain_from_batch is None and again.chain_from_batch is None  # no rule: the tree throughout
    ruled = CostTable.from_dict({**good, "chain_from_batch": 64})
    ruled.save(tmp_path / "ruled.json")
    assert CostTable.load(tmp_path / "ruled.json", None).chain_from_batch == 64
    old = {k: v for k, v in good.items() if k != "round_ms"}
    cases = {"version": ({**good, "version": 3}, "version 3"),
             "version 1": ({**old, "version": 1}, "version 1, this torchspec reads version 2; re-run"),
             "round shape": ({**good, "round_ms": good["round_ms"][:1]}, "round_ms has shape"),
             "overhead": ({**good, "overhead_ms": [0.1, -0.2, 0.3]}, "overhead_ms=.* one time >= 0 a batch"),
             "chain rule": ({**good, "chain_from_batch": 0}, "chain_from_batch=0 must be an int >= 1 or null"),
             "chain rule type": ({**good, "chain_from_batch": "64"}, "chain_from_batch='64' must be an int"),
             "unknown key": ({**good, "extra": 1}, "unknown \\['extra'\\]"),
             "missing field": ({**good, "key": {k: v for k, v in good["key"].items() if k != "tp"}}, "missing \\['tp'\\]"),
             "shape": ({**good, "verify_ms": [r[:1] for r in good["verify_ms"]]}, "verify_ms has shape"),
             "time": ({**good, "depth_ms": [[[0.0] * 2] * 3] * 2}, "not a positive number"),
             "nodes": ({**good, "nodes": [1, 2, 6]}, "must start at 0"),
             "order": ({**good, "batches": [4, 1, 8]}, "strictly ascending")}
    for data, pattern in cases.values():
        with pytest.raises(ValueError, match=pattern):
            CostTable.from_dict(data)


@pytest.mark.parametrize("change, flag", [
    ({"--batches": "1,x"}, "--batches"), ({"--widths": "0,2"}, "--widths"), ({"--nodes": "1,2"}, "--nodes"),
    ({"--contexts": "8,8"}, "--contexts"), ({"--repeats": "0"}, "--repeats"), ({"--tp": "2"}, "--tp"),
    ({"--target": "/no/such/target"}, "--target"), ({"--drafter": "/no/such/export"}, "--drafter"),
    ({"--dtype": "float16"}, "--dtype"), ({"--out": "DIR"}, "--out"), ({"--timing": "host"}, "--timing"),
    ({"--chain-from-batch": "0"}, "--chain-from-batch")])
def test_bad_cli_input_exits_2_and_writes_nothing(pair, tmp_path, capsys, change, flag):
    out = tmp_path / "costs.json"
    out.write_text("an older table")
    change = {k: str(tmp_path) if v == "DIR" else v for k, v in change.items()}
    with pytest.raises(SystemExit) as err:
        profile_main(cli_args(pair, out, **change))
    assert err.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("torchspec-profile: error:") and "\n" not in line and flag in line, line
    assert out.read_text() == "an older table" and sorted(p.name for p in tmp_path.iterdir()) == ["costs.json"]


def test_failed_profile_keeps_the_older_table(pair, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("the device fell over mid-profile")

    monkeypatch.setattr("torchspec.runtime.cost_profile.verify_fn", fail)
    out = tmp_path / "costs.json"
    out.write_text("an older table")
    with pytest.raises(RuntimeError, match="fell over"):
        profile_main(cli_args(pair, out))
    assert out.read_text() == "an older table" and sorted(p.name for p in tmp_path.iterdir()) == ["costs.json"]


def test_profiling_leaves_the_engine_as_it_found_it(pair):
    engine = load_engine(pair[0], pair[1], device="cpu", dtype="float32", max_batch=2, max_context=48, page_size=4)
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    from torchspec.runtime.drafting import SpecConfig

    spec = SpecConfig(depth=3, topk=2, num_nodes=4)
    before = [r.token_ids for r in engine.generate(prompts, max_new_tokens=8, spec=spec)]
    free = engine.free_pages
    table = profile_costs(engine, batches=[2], contexts=[20], widths=[2], nodes=[0, 4], repeats=1)
    assert table.key == cost_key(engine.decoder, engine.runner)
    assert engine.free_pages == free and (engine.block_table == 0).all()
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=8, spec=spec)] == before
    with pytest.raises(ValueError, match="max_batch and max_context"):
        profile_costs(engine, batches=[4], contexts=[20], widths=[2], nodes=[0], repeats=1)


def test_the_hosts_time_a_round_leaves_a_generate_calls_fixed_cost_out(monkeypatch):
    """``decode_round_ms`` on a fake engine and clock: a call costs 10 ms once (set-up, prefill, results) and 1.5 ms
    a round. The long run less the short one gives the round's 1.5 ms; one run over its rounds would give
    1.5 + 10 / rounds."""
    import torchspec.runtime.cost_profile as cp

    clock = [0.0]
    monkeypatch.setattr(cp.time, "perf_counter", lambda: clock[0])

    class Engine:
        decode_rounds = 0
        decoder = type("D", (), {"vocab_size": 50})()

        def generate(self, prompts, max_new_tokens, concurrency, ignore_eos, spec=None):
            rounds = max_new_tokens - 1 if spec is None else (max_new_tokens - 1 + 1) // 2  # a round commits 2
            self.decode_rounds += rounds
            clock[0] += 0.010 + (0.0015 if spec is None else 0.002) * rounds
            return []

    assert cp.decode_round_ms(Engine(), 4, 16) == pytest.approx(1.5)
    assert cp.decode_round_ms(Engine(), 4, 16, spec="a fixed shape") == pytest.approx(2.0)  # a round, not a token


def test_depth_0_is_priced_as_served_where_the_table_measured_it(tmp_path):
    """``round_extra_ms``: depth 0's served cost at the first context bucket replaces the standalone width-0 round's
    there, and longer contexts keep the standalone round's growth; a table without it prices depth 0 as before,
    and ``RoundCosts.lookup`` and ``break_even_tokens`` read it through ``spec_extra_ms``."""
    from torchspec.runtime.calibration import Calibration
    from torchspec.runtime.drafting import SpecConfig
    from torchspec.runtime.round_costs import RoundCosts, break_even_tokens

    plain = hand_table()  # round - verify[0] = 0.5 at every (batch, ctx)
    assert float(plain.spec_extra_ms(4, 100)) == pytest.approx(0.5) and plain.round_extra is None
    grows = hand_table()
    grows.round = grows.round + torch.tensor([[0.0], [0.2]], dtype=torch.float64)  # the last bucket's round: +0.2
    served = dataclasses.replace(grows, round_extra=[0.125, 0.25, 0.375])
    close = dict(rel=0, abs=1e-5)
    assert float(served.spec_extra_ms(4, 100)) == pytest.approx(0.25, **close)  # the first bucket: as served
    assert float(served.spec_extra_ms(6, 100)) == pytest.approx(0.3125, **close)  # between batches 4 and 8
    assert float(served.spec_extra_ms(4, 300)) == pytest.approx(0.25 + 0.2, **close)  # the standalone growth kept
    assert float(served.spec_extra_ms(4, 200)) == pytest.approx(0.25 + 0.1, **close)
    spec = SpecConfig(shape="tree", depth=3, topk=2, num_nodes=6)
    for table in (plain, served):
        costs = RoundCosts.lookup(table, spec, 4, 300, Calibration(torch.device("cpu")))
        assert float(costs.depth_ms[0]) == pytest.approx(float(table.spec_extra_ms(4, 300)), **close)
    deeper = break_even_tokens(served, spec, 6, 4, 100) - break_even_tokens(plain, spec, 6, 4, 100)
    assert deeper == pytest.approx((0.25 - 0.5) / float(plain.verify_ms(4, 100)[0] + plain.overhead_ms(4)), **close)
    served.save(tmp_path / "served.json")
    again = CostTable.load(tmp_path / "served.json", None)
    assert again.round_extra.tolist() == [0.125, 0.25, 0.375]
    good = served.to_dict()
    assert CostTable.from_dict({k: v for k, v in good.items() if k != "round_extra_ms"}).round_extra is None
    assert CostTable.from_dict({**good, "round_extra_ms": None}).round_extra is None
    for bad in ([0.1, 0.2], [0.1, -0.2, 0.3], [0.1, float("nan"), 0.3]):
        with pytest.raises(ValueError, match=r"round_extra_ms=.* one time >= 0 a batch \[1, 4, 8\], or be left out"):
            CostTable.from_dict({**good, "round_extra_ms": bad})
