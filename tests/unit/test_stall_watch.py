"""train.stall_dump_s: ``StallWatch`` writes every thread's stack when no step ends in time, and not before."""

import threading
import time

import pytest

from torchspec.train.run_dir import OPERATIONAL_KEYS, StallWatch


def blocked_in_a_named_wait(release: threading.Event) -> None:
    release.wait(10)


def test_a_stall_dumps_every_threads_stack_and_a_beat_postpones_it(tmp_path):
    path = tmp_path / "stalls.txt"
    watch = StallWatch(0.6, path)
    release = threading.Event()
    worker = threading.Thread(target=blocked_in_a_named_wait, args=(release,))
    worker.start()
    try:
        for _ in range(4):  # steps that end in time: no dump
            watch.beat()
            time.sleep(0.2)
        assert path.read_text() == ""
        time.sleep(1.5)  # a stall: dumped, and again a period later
        text = path.read_text()
    finally:
        watch.close()
        release.set()
        worker.join()
    assert "blocked_in_a_named_wait" in text  # the other thread's frame
    assert "test_a_stall_dumps_every_threads_stack_and_a_beat_postpones_it" in text  # the main thread's
    assert text.count("Current thread") + text.count("Thread 0x") >= 2
    size = path.stat().st_size
    time.sleep(0.8)
    assert path.stat().st_size == size  # closed: the timer is gone


def test_off_by_default_operational_and_positive(tmp_path):
    from omegaconf import OmegaConf

    from torchspec.train.compose import build_config, compose_config

    watch = StallWatch(None, tmp_path / "stalls.txt")
    watch.beat()
    watch.close()
    assert not (tmp_path / "stalls.txt").exists()
    assert "train.stall_dump_s" in OPERATIONAL_KEYS
    assert OmegaConf.select(compose_config([]), "train.stall_dump_s") is None
    with pytest.raises(ValueError, match=r"train.stall_dump_s=-1.* must be > 0"):
        build_config(compose_config(["train.stall_dump_s=-1"]))
    assert build_config(compose_config(["train.stall_dump_s=90"])).train.stall_dump_s == 90
