"""The bad-input campaign's shared parts: a world of real artefacts, a runner, and the one assertion.

``world`` holds a tiny target, a conversation file, a finished training run (config.yaml,
checkpoint, drafter, metrics), its export, and an EAGLE-3 drafter in torchspec's and SGLang's
layouts. It is built once per test session (cached under pytest's base temp directory) and is
never modified: every case hashes it, with the case's own scratch directory, before and after.

``check_refused`` runs one command line and asserts what every user error must give: exit
status 2, exactly one non-empty line on stderr of the form ``torchspec-<cli>: error: ...`` that
names the culprit, no traceback, every pre-existing file byte-identical and no new path. Most
cases run in-process (an import of torch + transformers costs ~7 s per process on the 2-core dev
machine); ``run_subprocess`` cases prove the same through the installed console scripts, where
stderr holds everything the process printed (warnings included: none may appear).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "DS_ACCELERATOR": "cpu",
       "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
AUX = [1, 3, 5]


@dataclass(frozen=True)
class World:
    root: Path
    target: str
    data: str
    run: Path
    export: Path
    e3: Path
    e3_sglang: Path

    def train_args(self, output_dir: Path | str, *extra: str) -> list[str]:
        """A valid tiny training command (the world's run was made with it) plus ``extra`` overrides."""
        return [f"target.path={self.target}", "target.dtype=float32", f"target.aux_layer_ids=[{','.join(map(str, AUX))}]",
                f"data.path={self.data}", "data.max_length=64", "data.eval_size=4", "data.max_conversations=null",
                f"train.output_dir={output_dir}", "train.max_steps=1", "train.micro_batch_size=2", "train.ttt_steps=2",
                "train.warmup_steps=0", "train.precision=fp32", "train.log_every=1", "train.save_every=0",
                "train.eval_batches=1", "train.report_to=none", "train.plot=false", "train.num_threads=1", *extra]


def _build_world(root: Path) -> None:
    from conftest import make_conversations

    from recipes.export import main as export_main
    from recipes.train import main as train_main
    from torchspec.data import build_tiny_tokenizer
    from torchspec.data.vocab import build_vocab_mapping
    from torchspec.export.eagle3_layouts import save_layout
    from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter
    from torchspec.targets import build_tiny_target

    root.mkdir(parents=True)
    build_tiny_target(str(root / "target"), vocab_size=384, tokenizer=build_tiny_tokenizer(384))
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in make_conversations(40)))
    e3 = Eagle3Drafter(Eagle3Config(vocab_size=384, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                    head_dim=16, intermediate_size=128, aux_layer_ids=AUX, target_num_layers=8,
                                    draft_vocab_size=128))
    e3.set_vocab_mapping(*build_vocab_mapping(torch.randint(0, 100, (384,), generator=torch.Generator().manual_seed(0)),
                                              128))
    e3.save_pretrained(root / "e3")
    save_layout(e3, root / "e3_sglang", "sglang")
    world = world_at(root)
    train_main(world.train_args(root / "run"))
    export_main([str(root / "run"), str(root / "export"), "--dtype", "float32"])
    (root / "READY").write_text("ok\n")


def world_at(root: Path) -> World:
    return World(root, str(root / "target"), str(root / "chats.jsonl"), root / "run", root / "export", root / "e3",
                 root / "e3_sglang")


@pytest.fixture(scope="module", name="world")
def bad_input_world(tmp_path_factory) -> World:
    root = tmp_path_factory.getbasetemp() / "bad_input_world"
    if not (root / "READY").exists():  # built once per session, shared by every bad-input module
        shutil.rmtree(root, ignore_errors=True)
        _build_world(root)
    return world_at(root)


# --- running a command and checking the refusal --------------------------------------------------------


def snapshot(*roots: Path) -> dict[str, str]:
    """Every path under ``roots`` -> sha256 of its bytes (or "dir")."""
    out = {}
    for root in roots:
        for path in [root, *sorted(root.rglob("*"))] if root.exists() else []:
            out[str(path)] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def run_inprocess(cli: str, argv: list[str], capfd) -> tuple[int, str, str]:
    main = importlib.import_module(f"recipes.{cli}").main
    capfd.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capfd.readouterr()
    return code, out, err


def run_subprocess(cli: str, argv: list[str], env: dict | None = None) -> tuple[int, str, str]:
    script = Path(sysconfig.get_path("scripts")) / f"torchspec-{cli}"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", f"recipes.{cli}"]
    result = subprocess.run([*command, *argv], capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, **ENV, **(env or {})})
    return result.returncode, result.stdout, result.stderr


def check_refused(cli: str, argv: list[str], culprit: str, watched: list[Path], capfd=None,
                  absent: tuple[Path, ...] = ()) -> str:
    """Run ``torchspec-<cli> argv`` (in-process with ``capfd``, else as a subprocess) and assert a clean
    refusal that names ``culprit``; ``watched`` trees must be unchanged, ``absent`` paths not created.
    Returns the error line."""
    before = snapshot(*watched)
    code, out, err = run_inprocess(cli, argv, capfd) if capfd is not None else run_subprocess(cli, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit {code}\nstdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    line = lines[0]
    assert line.startswith(f"torchspec-{cli}: error: "), line
    assert culprit in line, f"{culprit!r} not named in: {line}"
    assert snapshot(*watched) == before, "a pre-existing file changed, or a new one appeared"
    for path in absent:
        assert not path.exists(), f"{path} was created by a refused command"
    if os.environ.get("BAD_INPUT_LOG"):  # collect the lines, to read them all at once
        with open(os.environ["BAD_INPUT_LOG"], "a") as f:
            f.write(line + "\n")
    return line


def scratch_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def engine_shard(checkpoint: Path) -> Path:
    """The biggest file of a checkpoint's engine state (engine.pt, or a DCP shard under engine/)."""
    files = [p for p in checkpoint.rglob("*") if p.is_file() and p.name not in ("state.pt", "manifest.json")]
    return max(files, key=lambda p: p.stat().st_size)
