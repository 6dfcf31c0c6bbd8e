"""What `conf/` offers: every config group, its options, and the keys each option sets.

Read from the config files themselves — each option's YAML merged over the schema its defaults
list names (`- /schema/<group>/<name>@_here_`), as Hydra composes it — so `python run.py --help`
and the hints of `validate` cannot drift from what a run really composes.

Primary groups (`model`, `data`, ...) are those `conf/config.yaml` picks a default of; the others
(`experiment`, `rung`, `hydra/launcher`) are added on the command line and set keys of other
groups, pick their options and may sweep (`hydra.sweeper.params`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from accelexp.config.schema import SCHEMAS
from accelexp.keys import helps

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# composed and validated, never offered to users: test hooks, and what the sweeper sets per job
# (who may set them, not what they affect: no Affects kind)
HIDDEN_KEYS = frozenset({"debug", "repeat_index"})
_SCHEMA_ENTRY = re.compile(r"^/schema/(?P<group>.+)/(?P<name>\w+)@_here_$")


@dataclass(frozen=True)
class Option:
    """One `conf/<group>/<name>.yaml`."""

    group: str  # "data", "hydra/launcher"
    name: str  # "fashion_mnist"
    summary: str  # the file's first comment line
    keys: dict[str, Any]  # flat, in schema order: {"batch_size": 128, ...}; add-ons: dotted keys
    picks: dict[str, str] = field(default_factory=dict)  # add-ons: {"model": "simple_cnn"}
    sweeps: dict[str, str] = field(default_factory=dict)  # {"precision": "fp32,amp,bf16"}
    helps: dict[str, str] = field(default_factory=dict)  # its schema's: {"batch_size": "..."}


def primary_groups(conf_dir: Path = CONF_DIR) -> list[str]:
    """The groups `config.yaml` picks a default option of, in its order (not Hydra's own, which
    a config it includes overrides: conf/default_sweeper.yaml's `override /hydra/sweeper`)."""
    defaults = OmegaConf.load(conf_dir / "config.yaml").defaults
    keys = [next(iter(entry)) for entry in defaults if isinstance(entry, DictConfig)]
    return [key for key in keys if not key.startswith("override ")]


@cache
def options(conf_dir: Path = CONF_DIR) -> tuple[Option, ...]:
    """Every option of every group: primary groups first (in `config.yaml`'s order), then the
    add-on groups by name, Hydra's own (`hydra/...`) last."""
    primary = primary_groups(conf_dir)
    files = [path for path in conf_dir.rglob("*.yaml") if path.parent != conf_dir]

    def order(path: Path) -> tuple:
        group = path.parent.relative_to(conf_dir).as_posix()
        rank = (
            primary.index(group) if group in primary else len(primary) + group.startswith("hydra/")
        )
        return rank, group, path.stem

    return tuple(_read_option(path, conf_dir) for path in sorted(files, key=order))


def options_declaring(group: str, key: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The options of `group` that have `key` (`data`, `num_train` -> ["synthetic"])."""
    return [o.name for o in options(conf_dir) if o.group == group and key in o.keys]


def _read_option(path: Path, conf_dir: Path) -> Option:
    group = path.parent.relative_to(conf_dir).as_posix()
    body = OmegaConf.load(path)
    defaults = body.pop("defaults", [])
    schema, picks = None, {}
    for entry in defaults:
        if isinstance(entry, str) and (match := _SCHEMA_ENTRY.match(entry)):
            schema = SCHEMAS[match["group"]][match["name"]]
        elif isinstance(entry, DictConfig):  # `override /model: simple_cnn`
            picks.update({k.removeprefix("override ").lstrip("/"): v for k, v in entry.items()})
    if schema is not None:
        body = OmegaConf.merge(OmegaConf.structured(schema), body)
    flat = flatten(OmegaConf.to_container(body, resolve=False))
    params = "hydra.sweeper.params."  # a study's sweep: {"hydra.sweeper.params.precision": ...}
    sweeps = {k.removeprefix(params): v for k, v in flat.items() if k.startswith(params)}
    keys = {k: v for k, v in flat.items() if not k.startswith(params)}
    key_helps = helps(schema) if schema is not None else {}
    return Option(group, path.stem, _summary(path), keys, picks, sweeps, key_helps)


def flatten(values: Mapping[str, Any], prefix: str = "", empty: bool = True) -> dict[str, Any]:
    """{"mlflow": {"tags": {"rung": "amp"}}} -> {"mlflow.tags.rung": "amp"}; {} stays a value
    (`empty=False`: it has no key, as in a run's MLflow params)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and (value or not empty):
            flat.update(flatten(value, f"{name}.", empty))
        else:
            flat[name] = value
    return flat


def _summary(path: Path) -> str:
    """The first comment line of an option file, not counting `# @package ...`."""
    for line in path.read_text().splitlines():
        if line.startswith("#") and not line.startswith("# @package"):
            return line.lstrip("# ").rstrip()
        if line.strip() and not line.startswith("#"):
            break
    return ""
