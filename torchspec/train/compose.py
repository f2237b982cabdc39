"""Composing the training config from the Hydra groups shipped in the package (``pkg://torchspec.conf``).

``torchspec-train`` composes with Hydra's compose API rather than ``@hydra.main``: hydra.main creates
its run directory before the recipe validates anything and reports its own errors in several lines
with exit 1; here a malformed override is one ``ValueError`` naming it, and a ``+key=value`` that adds
a key the schema lacks is refused instead of being carried along unread.
"""

from __future__ import annotations

import dataclasses
import functools

from omegaconf import DictConfig, OmegaConf

from torchspec.cli import valid_keys_hint
from torchspec.config import Config, register_configs, validate_config

CONF_MODULE = "torchspec.conf"  # the configs ship inside the package (pip install . works)


def build_config(raw: DictConfig) -> Config:
    """The typed, validated config of a composed one; keys added with ``+`` are refused, named."""
    cfg: Config = OmegaConf.to_object(raw)
    for key in _added_keys(cfg):  # "+train.foo=1" composes, and would be carried along unread
        parent, _, name = key.rpartition(".")
        node = functools.reduce(getattr, parent.split("."), cfg) if parent else cfg
        raise ValueError(f"{key}: no such key in {type(node).__name__}; "
                         f"{valid_keys_hint(name, [f.name for f in dataclasses.fields(node)])}")
    validate_config(cfg)
    return cfg


def _added_keys(node, prefix: str = "") -> list[str]:
    """Attributes of the config dataclasses that are not fields (added with a + override)."""
    names = [f.name for f in dataclasses.fields(node)]
    added = [prefix + k for k in vars(node) if k not in names]
    for name in names:
        if dataclasses.is_dataclass(value := getattr(node, name)):
            added += _added_keys(value, f"{prefix}{name}.")
    return added


def compose_config(overrides: list[str]) -> DictConfig:
    """torchspec/conf/train.yaml with ``overrides``; a malformed override is named before composing."""
    from hydra import compose, initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        if override.startswith("-"):
            raise ValueError(f"{override}: torchspec-train takes no options, only overrides (group=option, "
                             f"key=value); see torchspec-train --help")
        try:
            parser.parse_overrides([override])
        except OverrideParseException as err:
            problem = "; ".join(line for line in str(err).splitlines()
                                if line.strip() and not line.startswith(("Error parsing override", "See https")))
            raise ValueError(f"override {override!r}: {problem}; write group=option or key=value "
                             f"(torchspec-train --help lists them)") from err
    register_configs()  # the typed schemas the groups' defaults lists name
    with initialize_config_module(CONF_MODULE, version_base=None):
        return compose("train", overrides=overrides)


def train_help(doc: str) -> str:
    """The recipe's usage, every config group with its options, and the default config."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    with initialize_config_module(CONF_MODULE, version_base=None):
        loader = GlobalHydra.instance().config_loader()
        groups = [f"{g}: {', '.join(o for o in loader.get_group_options(g) if not o.endswith('_schema'))}"
                  for g in loader.list_groups("") if g != "hydra"]
        defaults = OmegaConf.to_yaml(compose("train"))
    return "\n".join([doc.split("\n\n")[0], doc.split("\n\n")[1], "",
                      "== Configuration groups (group=option) ==", *groups, "",
                      "== Config (override any key: key=value) ==", defaults.rstrip(), "",
                      "User errors print one line and exit 2; TORCHSPEC_DEBUG=1 (or --debug) shows the traceback."])
