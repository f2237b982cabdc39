"""Packaging: a built wheel (not an editable install) ships the Hydra configs and every CLI finds them.

The wheel is built from a copy of the tracked sources (so nothing of this checkout's state leaks
in), installed with ``pip install --target`` into a temporary directory, and run from another
working directory with that directory first on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tracked_sources(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "torchspec", "recipes"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (REPO / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dst / rel)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to list the tracked sources")
    root = tmp_path_factory.mktemp("pkg")
    src, dist, site = root / "src", root / "dist", root / "site"
    _tracked_sources(src)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)], check=True)
    (wheel,) = dist.glob("torchspec-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(REPO)) for p in (REPO / "torchspec" / "conf").rglob("*.yaml")}
    assert expected and expected <= shipped, sorted(expected - shipped)
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True)
    return site


def _run(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_installed_package_is_the_wheel(installed, tmp_path):
    out = _run(installed, "-c", "import torchspec, torchspec.conf; print(torchspec.__file__)", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(installed)), out.stdout


def test_train_help_lists_the_config_groups(installed, tmp_path):
    out = _run(installed, str(installed / "bin" / "torchspec-train"), "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for group in ("drafter: ", "target: ", "data: ", "train: ", "parallel: "):
        assert group in out.stdout, out.stdout
    assert "eagle4" in out.stdout and "smollm2" in out.stdout


def test_convert_finds_the_drafter_presets(installed, tmp_path):
    # One interpreter prints both (importing recipes.convert costs ~6 s of torch + transformers).
    code = ("from recipes.convert import PRESET_DIR; print(sorted(p.stem for p in PRESET_DIR.glob('*.yaml'))); "
            "print(PRESET_DIR)")
    out = _run(installed, "-c", code, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    presets, preset_dir = out.stdout.splitlines()[-2:]
    assert "eagle4" in presets and str(installed) in preset_dir


def test_no_recipe_or_tool_shadows_a_standard_library_module():
    """``python recipes/x.py`` / ``python tools/x.py`` put that folder first on sys.path: a file named like a
    standard module (``profile.py`` once) breaks every import of it there (cProfile -> profile)."""
    root = Path(__file__).resolve().parents[2]
    clashes = [str(p.relative_to(root)) for folder in ("recipes", "tools", "data_pipelines")
               for p in (root / folder).glob("*.py") if p.stem in sys.stdlib_module_names]
    assert not clashes, f"rename {clashes}: they shadow standard-library modules"
