"""A run's identity: which config keys decide what it computes (`training_config`,
`config_hash`, `config_id`: a checkpoint resumes only its own training, `resume=auto` looks runs
up by the hash), what a verdict's advice is drawn for (`setting_id`), and which keys the report's
like-for-like comparisons ignore (`ignored_for_speed`).

Both follow from what each key of the schema says it affects (`accelexp.keys`):
- results and speed (the default): part of the training, compared;
- results only (`seed`, `data.root`, `device`...): part of the training, not compared — the same
  speed with other numbers, or an input named differently (`auto`: the device used is compared,
  as `device_type` and the tag `device`);
- speed only (`threads`, `profile`...): not part of the training, compared;
- nothing (`mlflow`, `resume`, `repeats`...): neither.
A section's or an option's key stands for all its keys (`mlflow`: `mlflow.tracking_uri`...).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from accelexp.config.schema import SCHEMAS
from accelexp.keys import Affects, affects
from accelexp.record import DERIVED_PARAMS, REPEAT_INDEX
from accelexp.schema import Config


def declared_kinds() -> dict[str, Affects]:
    """Every key that declares what it affects, but results and speed: {"seed": RESULTS,
    "mlflow": NOTHING, "data.root": RESULTS, ...}."""
    kinds: dict[str, Affects] = {}
    for declared in dataclasses.fields(Config):
        kind = affects(declared)
        if kind is not None:
            kinds[declared.name] = kind
        section = declared.default_factory
        if isinstance(section, type) and dataclasses.is_dataclass(section):  # `mlflow`, `speed`
            inner = _marks(section, f"{declared.name}.")
            assert kind is None or not inner, f"{declared.name}'s keys: {inner} within its own"
            kinds |= inner
    for group, schemas in SCHEMAS.items():
        for schema in schemas.values():
            for name, kind in _marks(schema, f"{group}.").items():
                assert kinds.setdefault(name, kind) is kind, f"{name}: {kind} in {schema} only"
    return {name: kind for name, kind in kinds.items() if kind is not Affects.RESULTS_AND_SPEED}


def _marks(schema: type, prefix: str) -> dict[str, Affects]:
    return {
        prefix + declared.name: kind
        for declared in dataclasses.fields(schema)
        if (kind := affects(declared)) is not None
    }


def keys_affecting(*kinds: Affects) -> frozenset[str]:
    """The keys that declare one of `kinds` (a section's name stands for all its keys)."""
    return frozenset(name for name, kind in declared_kinds().items() if kind in kinds)


# how a run is watched or how fast it goes, not what it computes: a resumed run may differ in them,
# and neither config_hash nor config_id sees them
NOT_TRAINING = keys_affecting(Affects.SPEED, Affects.NOTHING)
# what cannot change a run's speed (what it computes, names as input, or nothing), and the params
# that follow from the config (which is compared)
IGNORED_FOR_SPEED = keys_affecting(Affects.RESULTS, Affects.NOTHING) | DERIVED_PARAMS


def ignored_for_speed(key: str) -> bool:
    """A param (a flattened config key, `mlflow.tracking_uri`) that cannot change a run's speed."""
    return key in IGNORED_FOR_SPEED or key.partition(".")[0] in IGNORED_FOR_SPEED


# what the sweeper sets per repeat of one configuration (`accelexp.sweeper.repeated`: the index,
# and with repeat_seed=vary the seed); not an Affects kind: other keys affect results only too
REPEAT_KEYS = frozenset({"seed", REPEAT_INDEX})


def training_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a resolved config that decide what a run computes (all but `NOT_TRAINING`)."""
    return _without(config, NOT_TRAINING)


def _without(config: Mapping[str, Any], keys: frozenset[str], prefix: str = "") -> dict[str, Any]:
    kept = {}
    for name, value in config.items():
        path = prefix + name
        if path in keys:
            continue
        if isinstance(value, Mapping) and any(key.startswith(f"{path}.") for key in keys):
            value = _without(value, keys, f"{path}.")
        kept[name] = value
    return kept


def config_hash(resolved: Mapping[str, Any]) -> str:
    """Identifies the training a config describes (`resume=auto` looks runs up by it)."""
    return _digest(training_config(resolved))


def config_id(resolved: Mapping[str, Any]) -> str:
    """Identifies a configuration across its repeats: the training it describes less its seed
    and repeat index, with the user's own tags (`mlflow.tags`: an A/A test's two sides, say).
    The report groups a sweep's runs of one `config_id` into one row."""
    training = training_config(resolved)
    training = {k: v for k, v in training.items() if k not in REPEAT_KEYS}
    return _digest({"training": training, "tags": resolved.get("mlflow", {}).get("tags") or {}})


# how long a run trains: a short trial and the full run of one configuration share its advice
# (not an Affects kind: epochs changes results and speed, target_accuracy results only)
RUN_LENGTH = frozenset({"epochs", "max_steps_per_epoch", "target_accuracy"})


def setting_id(resolved: Mapping[str, Any]) -> str:
    """Identifies what a verdict's advice is drawn for: the configuration, its speed keys
    (`threads`, `speed.*`) included, less what only watches it (`mlflow`...), its seed, repeat
    index and length (`RUN_LENGTH`). Autotune's trials of a configuration and its full runs
    share it, so a suggestion measured and rejected there is looked up by it."""
    left_out = keys_affecting(Affects.NOTHING) | RUN_LENGTH | REPEAT_KEYS
    return _digest(_without(resolved, left_out))


def _digest(identity: Mapping[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
