"""A run's output directory: who may write into it, and when it is finished.

* ``check_output_dir`` (before anything is written): an existing run's directory only takes the same
  run back -- its ``config.yaml`` may differ only in ``OPERATIONAL_KEYS`` (how the run is operated,
  not what it trains); anything else is refused, naming the file and the keys.
* ``claim_output_dir`` (rank 0, once every check passed): create it, write ``config.yaml``.
* ``DONE`` (last of all, after the final checkpoint and the serving export): the completion marker;
  ``finished_run`` turns a rerun of a finished run into one line and no work.
* ``WallClockLimit`` (``train.max_wall_s``): whether a run stops at this log step so that its checkpoint
  is written before the job's time limit, instead of being killed mid-interval (or mid-save).
* ``StallWatch`` (``train.stall_dump_s``): every thread's Python stack in ``stalls.txt`` when no step
  ends for that long, so a run that stops making progress without an error says where it waits.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import shutil
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from torchspec.config import Config
from torchspec.io import atomic_write_text

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # as Hydra's job logging had it


# Keys a run may change when it continues in the same output_dir: how the run is operated, not what
# it trains. max_steps may grow to continue a finished run (the cosine schedule then stretches from
# the resumed step on); output_dir differs when the run directory was moved. Any other difference is
# another run: its config.yaml would lie to torchspec-export and to the reader, so it is refused.
OPERATIONAL_KEYS = {
    "train.output_dir", "train.max_steps", "train.resume", "train.num_threads", "train.report_to",
    "train.wandb_project", "train.plot", "train.eval_every", "train.save_every", "train.keep_checkpoints",
    "parallel.dist_timeout_minutes", "target.cache_dir", "train.max_wall_s", "train.stall_dump_s",
}


def check_output_dir(raw: DictConfig, output_dir: str) -> None:
    """Refuse an output_dir that is a file, or that holds another run's config.yaml (one that differs
    outside ``OPERATIONAL_KEYS``): a run continues in its directory only with its own config."""
    out_dir = Path(output_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"train.output_dir={output_dir!r} is a file; pass a directory (new, or a run to resume).")
    existing = out_dir / "config.yaml"
    if not existing.exists():
        return
    try:
        old = _flatten(OmegaConf.to_container(OmegaConf.load(existing)))
    except (yaml.YAMLError, ValueError) as err:  # not a config this recipe wrote
        raise ValueError(f"{existing} is unreadable ({' '.join(str(err).split())}); it belongs to an earlier "
                         f"run: pass another train.output_dir, or move that file away.") from err
    new = _flatten(OmegaConf.to_container(raw, resolve=True))
    differ = sorted(k for k in old.keys() | new.keys()
                    if old.get(k, "<absent>") != new.get(k, "<absent>") and k not in OPERATIONAL_KEYS)
    if differ:
        shown = ", ".join(f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}"
                          for k in differ[:6]) + (f" (+{len(differ) - 6} more)" if len(differ) > 6 else "")
        raise ValueError(f"{existing} holds another run's config ({shown}); a run continues in its directory only "
                         f"with the same config: pass a new train.output_dir, or the same values to resume.")


def claim_output_dir(raw: DictConfig, output_dir: str) -> Path:
    """Rank 0, once everything is validated: create output_dir and write config.yaml (if it changed)."""
    out_dir, text = Path(output_dir), OmegaConf.to_yaml(raw, resolve=True)
    existing = out_dir / "config.yaml"
    if not (existing.is_file() and existing.read_text() == text):
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(existing, text)
    return out_dir


def _flatten(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}


def log_file(path: Path) -> logging.Handler:
    """The run's train.log, as Hydra's job logging wrote it (appended to when a run continues)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    return handler


DONE = "DONE"  # <output_dir>/DONE: the run is finished, its export written (JSON: step, final held-out eval)


def mark_done(out_dir: Path, step: int, final: dict[str, float]) -> None:
    """Rank 0, last of all: remove the temporaries killed writers left behind (``.NAME.*`` beside an
    existing NAME, in the run directory and under checkpoints/), then write the completion marker."""
    for folder in (out_dir, out_dir / "checkpoints"):
        names = {DONE, *(p.name for p in folder.iterdir())} if folder.is_dir() else set()
        for leftover in [p for p in folder.glob(".*") if any(p.name.startswith(f".{n}.") for n in names)]:
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
    record = {"step": step, "export": "drafter", "eval": {k: float(v) for k, v in final.items()}}
    atomic_write_text(out_dir / DONE, json.dumps(record, indent=2, sort_keys=True) + "\n")


def finished_run(cfg: Config) -> str | None:
    """The line to print when train.output_dir holds a DONE run that this launch would not extend
    (train.resume=auto and train.max_steps <= its final step); None when there is work to do."""
    done = Path(cfg.train.output_dir) / DONE
    if cfg.train.resume != "auto" or not done.is_file():
        return None
    record = json.loads(done.read_text())
    if record["step"] < cfg.train.max_steps:
        return None
    return (f"run in {cfg.train.output_dir} already finished at step {record['step']} (held-out acceptance "
            f"{record['eval']['eval/acceptance_length']:.3f}); nothing to do — raise train.max_steps to continue "
            f"or pick a new train.output_dir")


class WallClockLimit:
    """``train.max_wall_s``: stop at a log step (the only steps a resume reproduces exactly) when the next
    interval would not end in time. The estimate is the last interval's duration, plus the last held-out
    evaluation when one falls in the next interval, plus the last synchronous save, all with 25% margin.
    Before any save was timed, a save is assumed to write ``state_bytes`` (weights and optimizer state) at
    ``ASSUMED_SAVE_BYTES_PER_S``. (It once counted as a whole interval: on the H200 the first interval and the
    step-0 evaluation both carry the cold compiles, and that guess stopped four of six runs at step 25 of a
    285 s window they would have used to step ~300.)"""

    MARGIN = 1.25
    ASSUMED_SAVE_BYTES_PER_S = 2e8  # a slow disk; a timed save replaces the guess

    def __init__(self, started: float, max_wall_s: float | None, state_bytes: int = 0):
        self.deadline = None if max_wall_s is None else started + max_wall_s
        self.interval_s = self.eval_s = 0.0
        self.save_s: float | None = None
        self.assumed_save_s = state_bytes / self.ASSUMED_SAVE_BYTES_PER_S

    def should_stop(self, now: float, eval_next: bool) -> bool:
        if self.deadline is None:
            return False
        save = self.assumed_save_s if self.save_s is None else self.save_s
        need = self.interval_s + (self.eval_s if eval_next else 0.0) + save
        return now + self.MARGIN * need > self.deadline


class StallWatch:
    """``train.stall_dump_s``: ``beat()`` after every step re-arms a timer; when it fires (no step ended for
    ``seconds``) ``faulthandler`` writes every thread's Python stack to ``path``, from its own thread, so it
    works while the main thread is blocked inside a collective, a CUDA sync or a lock, and repeats each
    further period. The run itself is not touched. A no-op with ``seconds=None``. One per process
    (faulthandler keeps a single timer)."""

    def __init__(self, seconds: float | None, path: str | Path):
        self.seconds = seconds
        self.file = open(path, "a") if seconds else None  # noqa: SIM115 -- open as long as the timer may fire

    def beat(self) -> None:
        if self.file is not None:
            faulthandler.dump_traceback_later(self.seconds, repeat=True, file=self.file)  # replaces the last timer

    def close(self) -> None:
        if self.file is not None:
            faulthandler.cancel_dump_traceback_later()
            self.file.close()
            self.file = None
