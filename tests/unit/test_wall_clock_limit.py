"""train.max_wall_s: when ``WallClockLimit`` stops a run, and the config's refusal of a bad value."""

from __future__ import annotations

import pytest

from torchspec.train.run_dir import OPERATIONAL_KEYS, WallClockLimit


def test_no_limit_never_stops():
    assert not WallClockLimit(0.0, None).should_stop(1e12, eval_next=True)


def test_stops_when_the_next_interval_and_its_save_would_not_fit():
    limit = WallClockLimit(started=100.0, max_wall_s=60.0, state_bytes=int(2e9))  # deadline 160
    limit.interval_s = 10.0  # before any save was timed, a save writes 2 GB at 0.2 GB/s: need 1.25 * 20 = 25
    assert not limit.should_stop(134.0, eval_next=False)
    assert limit.should_stop(136.0, eval_next=False)
    limit.save_s = 2.0  # need 1.25 * 12 = 15
    assert not limit.should_stop(144.0, eval_next=False)
    assert limit.should_stop(146.0, eval_next=False)
    limit.eval_s = 8.0  # an evaluation in the next interval: need 1.25 * 20 = 25
    assert not limit.should_stop(144.0, eval_next=False) and limit.should_stop(144.0, eval_next=True)


def test_the_limit_is_operational_and_must_be_positive(tmp_path):
    """Changing it when a run continues is allowed (it is how the run is operated); 0 or less is refused."""
    from omegaconf import OmegaConf

    from torchspec.train.compose import build_config, compose_config

    assert "train.max_wall_s" in OPERATIONAL_KEYS
    raw = compose_config(["train.max_wall_s=0", f"train.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"train.max_wall_s=0.* must be > 0"):
        build_config(raw)
    assert build_config(compose_config(["train.max_wall_s=30.5"])).train.max_wall_s == 30.5
    assert OmegaConf.select(compose_config([]), "train.max_wall_s") is None


def test_a_cold_first_interval_does_not_stop_a_run_with_time_left():
    """The H200 case: the first 25 steps took 50 s with the compiles, the step-0 evaluation 43 s, 123 s had gone
    of a 285 s window, and no save was timed yet (40M parameters): the run goes on (it stopped here before)."""
    limit = WallClockLimit(started=0.0, max_wall_s=285.0, state_bytes=3 * 4 * 40_000_000)
    limit.interval_s, limit.eval_s = 50.0, 43.0
    assert not limit.should_stop(123.0, eval_next=True)
    assert limit.should_stop(170.0, eval_next=True)
