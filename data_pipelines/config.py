"""Configs of the data pipelines: a dataclass schema, a YAML file, ``key=value`` overrides, one-line errors.

``python -m data_pipelines.<pipeline> [--config NAME|FILE.yaml] [key=value ...]``: the YAML file
(a name is looked up in ``data_pipelines/configs/``) is merged over the pipeline's dataclass schema,
then the overrides (OmegaConf dot-list syntax, as the trainer's Hydra overrides: ``data.max_length=1024``,
``chat_template=null``). Unknown keys, wrong types and missing values (``???``) are refused before
anything loads, as every user error of torchspec is: one line on stderr, exit status 2
(``torchspec.cli.user_errors``; ``--debug`` shows the traceback).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from omegaconf import OmegaConf

from torchspec.cli import ArgumentParser, user_errors

CONFIG_DIR = Path(__file__).parent / "configs"
T = TypeVar("T")


def config_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def load_config(schema: type[T], config: str, overrides: list[str]) -> T:
    """``schema`` <- the YAML file ``config`` <- ``overrides``, as a typed dataclass instance."""
    path = Path(config)
    if not path.is_file():
        path = CONFIG_DIR / f"{config}.yaml"
    if not path.is_file():
        raise ValueError(f"--config {config}: no such YAML file or config name; pass a .yaml path or one of "
                         f"{config_names()}")
    for override in overrides:
        if "=" not in override or override.startswith("="):
            raise ValueError(f"override {override!r}: write key=value (e.g. output=outputs/data/x)")
    merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def run_pipeline(prog: str, doc: str, schema: type[T], default_config: str, body: Callable[[T], object],
                 argv: list[str] | None = None) -> None:
    """Parse ``[--config X] [key=value ...]``, build the config and run ``body`` under one-line user errors."""
    parser = ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--config", default=default_config,
                        help=f"a YAML file, or a name in data_pipelines/configs/ ({', '.join(config_names())}); "
                             f"default {default_config}")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config, e.g. output=DIR")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    with user_errors(prog, args.debug):
        body(load_config(schema, args.config, args.overrides))
