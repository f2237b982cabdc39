"""The steady-state rate of ``recipes/bench.py``: ``measure`` counts the rounds in which every slot of the
configured concurrency is live (``engine.full_rounds``) and the tokens they commit; a closed run's ramp-down,
where slots have emptied, is left out. ``paired_timings`` and ``steady_ratio`` carry it into rows."""

from __future__ import annotations

import pytest

from recipes.bench import measure, paired_timings, steady_ratio
from tests.runtime_pair import build_pair
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine
from torchspec.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    target, drafter = build_pair(tmp_path_factory.mktemp("steady_pair"), num_layers=4)
    return load_engine(target, drafter, device="cpu", dtype="float32", max_batch=2, max_context=64, page_size=4)


def test_one_slot_runs_full_throughout_and_commits_every_decoded_token(engine):
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    run = measure(engine, prompts, None, SamplingParams(), 6, 0, 1)
    assert run["full_rounds"] == run["engine_rounds"] == 2 * 5  # the first token of each comes from its prefill
    assert run["steady_tokens_per_s"] > 0


def test_a_closed_run_leaves_its_ramp_down_out(engine):
    """Two slots, three requests: the third runs alone once the first two are done, so its rounds are not full;
    with a draft the rounds are fewer and every full round's tokens count, the bonus token included."""
    prompts = [[5, 9, 14, 3], [7, 7, 2], [1, 2, 3, 4, 5]]
    plain = measure(engine, prompts, None, SamplingParams(), 6, 0, 2)
    assert plain["full_rounds"] == 5 and plain["engine_rounds"] == 10  # 2 x 5 full, then the third alone
    before = list(engine.full_rounds)
    spec = measure(engine, prompts, SpecConfig(shape="chain", depth=2), SamplingParams(), 6, 0, 2)
    rounds, seconds, tokens = (now - was for now, was in zip(engine.full_rounds, before))
    assert rounds == spec["full_rounds"] and 0 < rounds < spec["engine_rounds"]
    assert rounds <= tokens <= 3 * 2 * rounds  # a chain of 2 commits 1-3 tokens a row-round, 2 rows
    assert spec["steady_tokens_per_s"] == pytest.approx(tokens / seconds)


def test_paired_timings_carry_the_steady_ratio_and_none_where_a_run_had_no_full_round():
    def timed(rate, steady):
        return lambda: {"tokens_per_s": rate, "steady_tokens_per_s": steady}

    fixed = paired_timings(timed(100.0, 100.0), timed(150.0, 200.0), 1)
    assert fixed["speedup"] == pytest.approx(1.5) and fixed["steady_speedup"] == pytest.approx(2.0)
    controller = paired_timings(timed(100.0, 100.0), timed(140.0, 210.0), 3)
    assert steady_ratio(controller, fixed) == pytest.approx(2.1 / 2.0)
    empty = paired_timings(timed(100.0, None), timed(150.0, 200.0), 1)
    assert empty["steady_speedup"] is None and steady_ratio(empty, fixed) is None
