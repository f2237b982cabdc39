"""One-line user errors, the same for every torchspec command line.

Every recipe runs its work inside ``user_errors(prog)``. An error a user can cause becomes ONE
line on stderr and exit status 2 (argparse's status for bad usage)::

    torchspec-<cli>: error: <what file/key>, <the problem>, <the fix>

User errors are ``ValueError`` (the codebase's convention for them, STYLE 13; JSON and Unicode
decode errors are ValueErrors too), ``OSError`` about a path (missing, a directory, no
permission, disk full), ``MemoryError`` (a KV cache that does not fit), unreadable
safetensors/YAML files, and the config errors of OmegaConf and Hydra (unknown key, wrong type,
missing value, unknown group option). Anything else is a bug and keeps its traceback (exit 1).
``--debug`` (or ``TORCHSPEC_DEBUG=1``, the switch of ``torchspec-train``, whose arguments are
Hydra overrides) lets a user error raise with its traceback too.

``ArgumentParser`` is argparse's, with its usage errors in the same one-line form (a pointer to
``--help`` instead of the usage block) and the ``--debug`` flag added. ``read_json`` and
``check_safetensors`` read the files users hand over (config.json, model.safetensors) so that a
missing, garbled or truncated one is refused by name, before any model loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

DEBUG_ENV = "TORCHSPEC_DEBUG"


def debug_requested(debug: bool = False) -> bool:
    return debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _user_error_types() -> tuple[type[BaseException], ...]:
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from safetensors import SafetensorError

    return ValueError, OSError, MemoryError, OmegaConfBaseException, HydraException, SafetensorError, yaml.YAMLError


def valid_keys_hint(key: str, valid: list[str]) -> str:
    """``did you mean 'max_steps'?`` if one is close, else the list of valid keys."""
    close = difflib.get_close_matches(key, valid, n=1)
    return f"did you mean {close[0]!r}?" if close else f"valid keys: {sorted(valid)}"


def _omegaconf_message(err) -> str:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, ValidationError

    key = err.full_key or err.key
    problem = str(err.msg).splitlines()[0] if err.msg else type(err).__name__
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and dataclasses.is_dataclass(err.object_type):
        valid = [f.name for f in dataclasses.fields(err.object_type)]
        return f"{key}: no such key in {err.object_type.__name__}; {valid_keys_hint(str(err.key), valid)}"
    if isinstance(err, MissingMandatoryValue):
        return f"{key}: has no value (???), set it, e.g. {key}=..."
    if isinstance(err, ValidationError):
        return f"{key}: {problem}; give a value of the key's type"
    return f"{key}: {problem}" if key else problem


def one_line(err: BaseException) -> str:
    """The error as one line: the culprit first (file or key), then the problem and the fix."""
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, name = err.missing_cfg_file.rsplit("/", 1)
        options = [o for o in err.options or [] if not o.endswith("_schema")]
        text = f"{group}={name}: config group {group!r} has no option {name!r}; choose one of {options}"
    elif isinstance(err, ConfigCompositionException) and isinstance(err.__cause__, OmegaConfBaseException):
        text = _omegaconf_message(err.__cause__)
    elif isinstance(err, OmegaConfBaseException):
        text = _omegaconf_message(err)
    elif isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.filename}: {err.strerror.lower()}; check the path and its permissions"
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    sys.exit(2)


@contextmanager
def user_errors(prog: str, debug: bool = False) -> Iterator[None]:
    """Run the body; a user error (module docstring) prints one line and exits 2, unless debugging."""
    try:
        yield
    except _user_error_types() as err:
        if debug_requested(debug):
            raise
        fail(prog, one_line(err))


def check_at_least(flag: str, value: int | None, low: int) -> None:
    """A count option (``--max-new-tokens``...) that must be at least ``low``; None means unset."""
    if value is not None and value < low:
        raise ValueError(f"{flag}={value} must be >= {low}.")


def read_json(path: str | Path, fix: str) -> dict:
    """A JSON object file a user handed over (a config.json); every failure names the file and ``fix``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is missing; {fix}")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); {fix}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object; {fix}")
    return data


def check_safetensors(path: str | Path, fix: str) -> list[str]:
    """The tensor names of a safetensors file, reading only its header (truncation shows there)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is missing; {fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except SafetensorError as err:
        raise ValueError(f"{path} is truncated or not a safetensors file ({err}); {fix}") from err


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2) and a ``--debug`` flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", help="show the Python traceback of an error")

    def error(self, message: str) -> NoReturn:
        fail(self.prog, f"{message}; see {self.prog} --help")
