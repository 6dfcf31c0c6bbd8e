"""How a config key is declared: its default, a one-line help, and what it affects.

Every field of the schema (`accelexp.schema`, and the `parallelism` group's dataclasses,
`accelexp.parallel.config`) is a `key(...)` (a section of keys, a `section(...)`): the help is
what `python run.py --help` shows beside the key, and `affects` decides the key's place in a
run's identity (`accelexp.config.identity`): whether a resumed run may differ in it
(`config_hash`) and whether the report's like-for-like comparison ignores it.

What a key's value may be, as `accelexp.config.validate` checks it, is a `Range` (a test, and
what is allowed, said the way the validator's "expected ..." ends): the common ones are here, so
each group's owner (`accelexp.parallel.rules` for `parallelism`) writes its keys' ranges in the
same words.

Imports nothing of accelexp, nor anything heavy: `accelexp.config` and `accelexp.parallel` both
declare keys with it, and `config` asks `parallel` (so it is neither's).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any


class Affects(Enum):
    """What a key can change of a run."""

    RESULTS_AND_SPEED = "results and speed"  # what a run computes and how fast (the default)
    RESULTS = "results"  # what it computes or names as input, never its speed: seed, data.root
    SPEED = "speed"  # how fast it runs, never what it computes: threads, profiling
    NOTHING = "nothing"  # how a run is watched, found or repeated: mlflow, resume, progress


HELP = "help"
AFFECTS = "affects"
CHOICES = "choices"


def key(
    default: Any, help: str, affects: Affects | None = None, choices: tuple[str, ...] = ()
) -> Any:
    """A config key: its default (a list or dict is copied for each config), help and kind
    (None: what its section or config group affects; at the top level, results and speed), and
    for a string of a fixed set its `choices` (`accelexp.config.validate` refuses the others)."""
    metadata = {HELP: help, AFFECTS: affects, CHOICES: choices}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(schema: type, help: str, affects: Affects | None = None) -> Any:
    """A section of keys (`mlflow`, `speed`...) whose defaults are `schema`'s: `affects` stands
    for all its keys, which declare none of their own."""
    return dataclasses.field(default_factory=schema, metadata={HELP: help, AFFECTS: affects})


def option_name(name: str) -> Any:
    """The `name` key every option of a config group has: which option GROUP=OPTION picked."""
    return key(name, "the option's name")


def like(schema: type, name: str, default: Any = dataclasses.MISSING) -> Any:
    """`schema`'s key `name` (its help and kind), with another default where one is given: an
    option that shares a key with another option, or changes its default."""
    declared = schema.__dataclass_fields__[name]
    if default is dataclasses.MISSING:
        default = (
            declared.default
            if declared.default_factory is dataclasses.MISSING
            else declared.default_factory()
        )
    metadata = declared.metadata
    return key(default, metadata[HELP], metadata[AFFECTS], metadata[CHOICES])


def help_of(declared: dataclasses.Field) -> str:
    """The help of a schema field, "" where it has none."""
    return declared.metadata.get(HELP, "")


def affects(declared: dataclasses.Field) -> Affects | None:
    """What a schema field says it affects; None: what its section or group affects."""
    return declared.metadata.get(AFFECTS)


def choices_of(declared: dataclasses.Field) -> tuple[str, ...]:
    """The values a schema field allows, () where any value of its type is allowed."""
    return declared.metadata.get(CHOICES, ())


def helps(schema: type, prefix: str = "") -> dict[str, str]:
    """Every key of `schema` with its help and choices, a section's keys dotted:
    {"device": "what to compute on: auto, cpu, cuda", "mlflow.tracking_uri": "...", ...}."""
    found = {}
    for declared in dataclasses.fields(schema):
        choices = choices_of(declared)
        found[prefix + declared.name] = help_of(declared) + (
            f": {', '.join(choices)}" if choices else ""
        )
        keys = declared.default_factory  # a section's: `mlflow`...
        if isinstance(keys, type) and dataclasses.is_dataclass(keys):
            found |= helps(keys, f"{prefix}{declared.name}.")
    return found


# --- what a key's value may be ------------------------------------------------------------------

Range = tuple[Callable[[Any], bool], str]  # (ok, allowed): "expected {allowed}" when not ok
Rule = tuple[str, Callable[[Any], bool], str]  # a key's Range: (dotted key, ok, allowed)
FLOAT32_MAX = 3.4028234663852886e38  # an lr or a scale beyond it overflows torch's float32 math
POSITIVE: Range = (lambda v: 0 < v <= FLOAT32_MAX, "a number > 0 (and at most 3.4e38)")
NON_NEGATIVE: Range = (lambda v: 0 <= v <= FLOAT32_MAX, "a number >= 0 (and at most 3.4e38)")
AT_LEAST_ONE: Range = (lambda v: v >= 1, "an integer >= 1")
OPTIONAL_AT_LEAST_ONE: Range = (lambda v: v is None or v >= 1, "null or an integer >= 1")
FRACTION: Range = (lambda v: 0 <= v < 1, "a number in [0, 1)")
AUTO_OR_BOOL: Range = (lambda v: v == "auto" or isinstance(v, bool), "auto, true or false")


def declared_choices(key: str, schemas: Iterable[type]) -> tuple[str, ...]:
    """The choices `schemas` (the options of `key`'s group, or its section) declare for `key`
    (`device`, `speed.compile`, `parallelism.op`): the same in every one that has it."""
    name = key.rpartition(".")[2]
    found = {
        choices_of(f) for schema in schemas for f in dataclasses.fields(schema) if f.name == name
    }
    assert len(found) == 1 and () not in found, f"{key}: the schema declares choices {found}"
    return found.pop()


def one_of(key: str, choices: tuple[str, ...]) -> Rule:
    """`key` takes one of `choices`: "expected one of a, b, c"."""
    return key, lambda v: v in choices, f"one of {', '.join(choices)}"


def either(key: str, choices: tuple[str, ...]) -> Rule:
    """`key` takes one of `choices`: "expected a, b or c"."""
    return key, lambda v: v in choices, " or ".join([", ".join(choices[:-1]), choices[-1]])
