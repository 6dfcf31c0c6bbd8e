"""The checks Hydra's schema cannot express: choices and ranges, with messages a user can act on.

`validate(cfg)` raises one `ConfigError` listing every problem found, each naming the key, the
value and what is allowed, so a typo costs one run of `python run.py`, not an hour of training.
A key left unset, an interpolation that cannot be resolved (`${oc.env:NOPE}`) and a key added
with `+` that nothing reads are problems too; one that other options of its group have
(`+data.num_train` with data=fashion_mnist) is named with them, one that was renamed
(`RENAMED_KEYS`) with its new name.

The choices of a string key of a fixed set are the schema's (`key(..., choices=...)`), the common
ranges `accelexp.keys`'s; the `parallelism` group's ranges and what a strategy refuses (the
combinations it cannot run) are the strategy's own, asked of `accelexp.parallel.rules`
(`KEY_RULES`, `problems`). What this machine can hold is checked apart, in `resources.py`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from accelexp import objective
from accelexp.config.catalog import flatten, options_declaring
from accelexp.config.schema import SCHEMAS
from accelexp.errors import ConfigError
from accelexp.keys import (
    AT_LEAST_ONE,
    AUTO_OR_BOOL,
    FRACTION,
    NON_NEGATIVE,
    OPTIONAL_AT_LEAST_ONE,
    POSITIVE,
    Rule,
    declared_choices,
    either,
    one_of,
)
from accelexp.parallel import rules as strategy_rules
from accelexp.precision import NAMES
from accelexp.schema import Config

SEED_MAX = 2**32 - 1  # numpy's seeding takes [0, 2**32 - 1]
INT32_MAX = 2**31 - 1
# old spelling -> new: refused with the new one (`renamed_key`)
RENAMED_KEYS = {"parallelism.engine": "parallelism.sync"}
# the URI schemes MLflow 3 opens a tracking store / an artifact store for (its error lists them)
TRACKING_SCHEMES = (
    "", "file", "sqlite", "http", "https", "postgresql", "mysql", "mssql",
    "databricks", "databricks-uc", "uc",
)  # fmt: skip
ARTIFACT_SCHEMES = (
    "", "file", "s3", "r2", "b2", "gs", "wasbs", "ftp", "sftp", "dbfs", "hdfs", "viewfs",
    "runs", "models", "http", "https", "mlflow-artifacts", "abfss",
)  # fmt: skip


def _scheme(uri: str) -> str:
    """`sqlite` of sqlite:///x, `postgresql` of postgresql+psycopg2://..., "" of a plain path."""
    return urlparse(uri).scheme.split("+")[0].lower()


def _tracking_store(uri: str) -> bool:
    """A store MLflow opens, and keeps: SQLite in a file, not in memory (sqlite://)."""
    if not uri.strip() or _scheme(uri) not in TRACKING_SCHEMES:
        return False
    return _scheme(uri) != "sqlite" or urlparse(uri).path.strip("/") not in ("", ":memory:")


def _declared_choices(key: str) -> tuple[str, ...]:
    """The choices the schema declares for `key` (`device`, `speed.compile`): the same in every
    option of a group that has the key."""
    group = key.rpartition(".")[0]
    if group in SCHEMAS:
        schemas = list(SCHEMAS[group].values())
    else:  # a top-level key, or a section's
        schemas = [Config.__dataclass_fields__[group].default_factory if group else Config]
    return declared_choices(key, schemas)


def _one_of(key: str) -> Rule:
    """`key` takes one of its declared choices: "expected one of a, b, c"."""
    return one_of(key, _declared_choices(key))


def _either(key: str) -> Rule:
    """`key` takes one of its declared choices: "expected a, b or c"."""
    return either(key, _declared_choices(key))


def _rules() -> list[Rule]:
    return [
        ("seed", lambda v: 0 <= v <= SEED_MAX, f"an integer in [0, {SEED_MAX}]"),
        ("repeats", *AT_LEAST_ONE),
        _either("repeat_seed"),
        ("repeat_index", lambda v: v >= 0, "an integer >= 0 (set by the sweeper)"),
        _one_of("compare"),
        ("precision_target", lambda v: v is None or 0 < v < 1, "null or a number in (0, 1)"),
        ("max_repeats", lambda v: v >= 2, "an integer >= 2"),
        _one_of("lockstep.process"),
        ("lockstep.slice_steps", *AT_LEAST_ONE),
        ("lockstep.slice_s", lambda v: v is None or v > 0, "null or a number of seconds > 0"),
        ("lockstep.warmup_rounds", lambda v: v >= 0, "an integer >= 0"),
        ("lockstep.epochs_per_process", *OPTIONAL_AT_LEAST_ONE),
        ("lockstep.turn_timeout_s", lambda v: v > 0, "a number of seconds > 0"),
        ("objective", objective.valid, objective.ALLOWED),
        ("epochs", *AT_LEAST_ONE),
        ("max_steps_per_epoch", *OPTIONAL_AT_LEAST_ONE),
        ("target_accuracy", lambda v: v is None or 0 < v <= 1, "null or a number in (0, 1]"),
        _one_of("device"),
        ("threads", *OPTIONAL_AT_LEAST_ONE),
        ("log_every_n_steps", *AT_LEAST_ONE),
        ("data.batch_size", *AT_LEAST_ONE),
        ("data.eval_batch_size", *AT_LEAST_ONE),
        ("data.num_workers", *NON_NEGATIVE),
        ("data.val_fraction", *FRACTION),
        ("data.on_device", *AUTO_OR_BOOL),
        ("data.num_train", *AT_LEAST_ONE),
        ("data.num_test", *AT_LEAST_ONE),
        ("data.image_size", lambda v: v >= 8, "an integer >= 8"),
        ("data.channels", *AT_LEAST_ONE),
        ("data.num_classes", lambda v: v >= 2, "an integer >= 2"),
        ("precision.name", lambda v: v in NAMES, f"one of {', '.join(NAMES)}"),
        ("precision.init_scale", *POSITIVE),
        (
            "precision.growth_interval",
            lambda v: 1 <= v <= INT32_MAX,
            f"an integer in [1, {INT32_MAX}]",
        ),
        *strategy_rules.KEY_RULES,  # the parallelism group's: its owner's
        ("debug.raise_at_step", *AT_LEAST_ONE),
        ("debug.input_delay_ms", lambda v: v >= 0, "a number of milliseconds >= 0"),
        ("debug.raise_oom_at_step", *OPTIONAL_AT_LEAST_ONE),
        ("profiler.epoch", *AT_LEAST_ONE),
        ("profiler.wait", lambda v: v >= 0, "an integer >= 0"),
        ("profiler.warmup", lambda v: v >= 0, "an integer >= 0"),
        ("profiler.active", *AT_LEAST_ONE),
        ("max_batch.limit", *AT_LEAST_ONE),
        ("max_batch.device_mem_gb", lambda v: v is None or v > 0, "null or a number of GiB > 0"),
        ("autotune.budget_s", *POSITIVE),
        ("autotune.max_trials", lambda v: v >= 2, "an integer >= 2 (the base and a candidate)"),
        ("autotune.accuracy_tolerance", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        ("speed.channels_last", *AUTO_OR_BOOL),
        _one_of("speed.compile"),
        _one_of("speed.optimizer_impl"),
        _one_of("speed.activation_checkpointing"),
        _one_of("speed.heap"),
        (
            "speed.selective_ac_option",
            lambda v: str(v) == "op" or (str(v).isdigit() and int(v) >= 1),
            "a number k >= 1 (checkpoint every k-th block) or op (every block, keeping the "
            "outputs of its matmuls, attention and convolutions)",
        ),
        (
            "mlflow.tracking_uri",
            _tracking_store,
            "a tracking store such as sqlite:///outputs/mlflow.db or http://HOST:5000 "
            f"(MLflow opens the schemes {', '.join(s for s in TRACKING_SCHEMES if s)})",
        ),
        ("mlflow.experiment", lambda v: bool(v.strip()), "a non-empty experiment name"),
        ("mlflow.outage_budget_s", *NON_NEGATIVE),
        (
            "mlflow.artifact_location",
            lambda v: v is None or _scheme(v) in ARTIFACT_SCHEMES,
            "null (next to the store) or a folder or URI of the schemes "
            f"{', '.join(s for s in ARTIFACT_SCHEMES if s)}",
        ),
        ("optimizer.lr", *POSITIVE),
        ("optimizer.weight_decay", *NON_NEGATIVE),
        ("optimizer.momentum", *FRACTION),
        ("optimizer.eps", *POSITIVE),
        (
            "optimizer.betas",
            lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
            "two numbers in [0, 1)",
        ),
        ("model.channels", lambda v: len(v) == 2 and all(c >= 1 for c in v), "two integers >= 1"),
        ("model.hidden", *AT_LEAST_ONE),
        ("model.widths", lambda v: len(v) >= 1 and all(w >= 1 for w in v), "integers >= 1"),
        ("model.dropout", *FRACTION),
        (
            "model.patch_size",
            lambda v: v in (None, "auto") or (type(v) is int and v >= 1),
            "auto or an integer >= 1 that divides the image size",
        ),
        ("model.dim", *AT_LEAST_ONE),
        ("model.depth", *AT_LEAST_ONE),
        ("model.heads", *AT_LEAST_ONE),
        ("model.mlp_ratio", *POSITIVE),
        ("scheduler.warmup_epochs", *NON_NEGATIVE),
        ("scheduler.warmup_start_factor", lambda v: 0 < v <= 1, "a number in (0, 1]"),
        ("scheduler.step_size", *AT_LEAST_ONE),
        ("scheduler.gamma", lambda v: 0 < v <= 1, "a number in (0, 1]"),
        ("scheduler.min_lr_factor", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        ("scheduler.pct_start", lambda v: 0 < v < 1, "a number in (0, 1)"),
        ("scheduler.div_factor", *POSITIVE),
        ("scheduler.final_div_factor", *POSITIVE),
    ]


def validate(cfg: DictConfig) -> None:
    """Raise `ConfigError` naming every out-of-range value of a composed config."""
    unset = list(_unset_or_unresolvable(cfg))
    if unset:  # the rules below would read those values
        raise ConfigError(
            "Invalid configuration:\n" + "\n".join(unset) + "\n"
            "`python run.py --cfg job` prints the composed config."
        )
    problems = list(_unknown_keys(cfg))
    for key, ok, allowed in _rules():
        value = OmegaConf.select(cfg, key, default="__absent__")
        if value == "__absent__":  # the chosen group option has no such key
            continue
        if isinstance(value, DictConfig | list) or OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        if not ok(value):
            problems.append(f"  {key}={value!r} is not allowed: expected {allowed}.")
    if cfg.scheduler.warmup_epochs >= cfg.epochs and cfg.scheduler.warmup_epochs > 0:
        problems.append(
            f"  scheduler.warmup_epochs={cfg.scheduler.warmup_epochs} must be shorter than "
            f"epochs={cfg.epochs}."
        )
    problems += _objective_problems(cfg)
    problems += strategy_rules.problems(cfg)
    problems += _vit_problems(cfg)
    if cfg.optimizer.get("nesterov") and cfg.optimizer.momentum == 0:
        problems.append(
            "  optimizer.nesterov=true needs a momentum, but optimizer.momentum=0: set "
            "optimizer.momentum (e.g. 0.9) or optimizer.nesterov=false."
        )
    if cfg.data.on_device is True and cfg.data.num_workers > 0:
        problems.append(
            f"  data.on_device=true gathers batches on the device, where loader worker processes "
            f"have nothing to do: use data.num_workers=0 (now {cfg.data.num_workers}), or "
            f"data.on_device=false to gather on the host with workers."
        )
    if problems:
        raise ConfigError(
            "Invalid configuration:\n" + "\n".join(problems) + "\n"
            f"Fix the override(s) above{_example_fix(problems[0])}; "
            "`python run.py --cfg job` prints the composed config."
        )


def check_one_job_of_a_study(sweep: Mapping[str, str], overrides: Sequence[str]) -> None:
    """A study that sweeps (`hydra.sweeper.params` of an experiment file) started without `-m`:
    Hydra would run one job with none of its values. Fine when the command line picks a value
    of every swept key (one job of the study, on purpose); a `ConfigError` otherwise."""
    picked = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    missing = [key for key in sweep if key.lstrip("+~") not in picked]
    if not missing:
        return
    grid = " ".join(f"{key}={values}" for key, values in sweep.items())
    example = missing[0] + "=" + str(sweep[missing[0]]).split(",")[0]
    raise ConfigError(
        f"This study is a sweep ({grid}): run it with -m, e.g. `python run.py -m "
        f"{' '.join(overrides)}`, or pick one value of each swept key for a single job "
        f"(e.g. {example})."
    )


def check_repeats_of_one_job(overrides: Sequence[str]) -> None:
    """`repeats=N` typed without `-m`: repeats are jobs of a sweep (`accelexp.sweeper`). A
    study's own `repeats` (its experiment file's) is left alone: one job of it runs once."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") == "repeats" and value.strip() not in ("1", ""):
            raise ConfigError(
                f"repeats={value} runs each configuration {value} times as jobs of a sweep: "
                f"add -m, e.g. `python run.py -m {' '.join(overrides)}`."
            )


def check_sweep_objective(config: DictConfig) -> bool:
    """A sweep's `objective`, before its first job (each job would fail on it alone): a value
    that names no objective is a `ConfigError`, and so, for a sweeper that optimizes (one with a
    `direction`: Optuna's), is a direction that is not the objectives' own. Whether the sweeper
    optimizes."""
    setting = config.get("objective", objective.DEFAULT)
    if OmegaConf.is_config(setting):
        setting = OmegaConf.to_container(setting)
    if not objective.valid(setting):
        raise ConfigError(f"objective={setting!r} is not allowed: expected {objective.ALLOWED}.")
    direction = config.hydra.sweeper.get("direction")
    if direction is None:
        return False
    problem = objective.check_directions(setting, direction)
    if problem:
        raise ConfigError(problem)
    return True


def _example_fix(problem: str) -> str:
    """ ", e.g. `python run.py KEY=...`" for a problem with the value of KEY, else nothing."""
    match = re.match(r"\s*([\w.]+)=", problem)
    return f", e.g. `python run.py {match.group(1)}=...`" if match else ""


def _objective_problems(cfg: DictConfig) -> list[str]:
    """time_to_target as an objective without a target to reach."""
    setting = cfg.get("objective", objective.DEFAULT)
    if not objective.valid(setting) or cfg.target_accuracy is not None:
        return []
    if not objective.needs_target(setting):
        return []
    return [
        f"  objective={objective.written(objective.names_of(setting))} needs a target, but "
        f"target_accuracy=null: set target_accuracy (e.g. target_accuracy=0.8, a val_acc the "
        f"runs reach)."
    ]


def _vit_problems(cfg: DictConfig) -> list[str]:
    """A ViT's heads that do not divide its width; patches that do not divide the images (where
    the image size is known before loading: data=synthetic, fashion_mnist, cifar10)."""
    if not cfg.model.name.startswith("vit"):
        return []
    from accelexp.data.sources import set_shape
    from accelexp.models.vit import heads_problem, patch_problem

    shape = set_shape(cfg.data)
    found = [patch_problem(cfg.model, shape.image_size)] if shape else []
    if "heads" in cfg.model:
        found.append(heads_problem(cfg.model.dim, cfg.model.heads))
    return [f"  {problem}" for problem in found if problem]


def _unset_or_unresolvable(node: DictConfig | ListConfig, prefix: str = "") -> Iterator[str]:
    """Keys left `???` (e.g. a group removed with `~model`) and interpolations that fail."""
    in_list = isinstance(node, ListConfig)
    for key in range(len(node)) if in_list else node:
        name = f"{prefix}[{key}]" if in_list else f"{prefix}.{key}" if prefix else str(key)
        if OmegaConf.is_missing(node, key):
            yield (
                f"  {name} is not chosen: pick an option, e.g. {name}=OPTION (`python run.py "
                f"--help` lists them)."
                if not prefix  # the top-level keys left unset are the config groups
                else f"  {name} is not set: give it a value, {name}=VALUE."
            )
            continue
        try:
            value = node[key]
        except OmegaConfBaseException as error:
            raw = OmegaConf.to_container(node, resolve=False)[key]
            yield f"  {name}={raw!r} cannot be resolved: {unresolved_reason(error, name)}"
            continue
        if isinstance(value, DictConfig | ListConfig):
            yield from _unset_or_unresolvable(value, name)


def unresolved_reason(error: OmegaConfBaseException, key: str) -> str:
    """Why an interpolation of `key` failed, and what to type instead."""
    message = str(getattr(error, "msg", None) or error).splitlines()[0]
    message = re.sub(r"^\w+ raised while resolving interpolation: ", "", message).strip("\"'")
    variable = re.search(r"Environment variable '([^']+)' not found", message)
    if variable:
        name = variable.group(1)
        return (
            f"the environment variable {name} is not set. Set it (export {name}=...), give a "
            f"default (${{oc.env:{name},DEFAULT}}), or give {key} a value directly."
        )
    return f"{message}. Fix the interpolation or give {key} a value directly."


def _unknown_keys(node: DictConfig, prefix: str = "") -> Iterator[str]:
    """Keys no schema declares: Hydra refuses them, except when added with `+KEY=VALUE`."""
    schema = OmegaConf.get_type(node)
    known = dataclasses.is_dataclass(schema) and {f.name for f in dataclasses.fields(schema)}
    for key in node:
        name = f"{prefix}.{key}" if prefix else str(key)
        if known and key not in known:
            value = node[key]
            if isinstance(value, DictConfig):  # +anything.unknown=1: name what was typed
                name, value = next(iter(flatten({name: OmegaConf.to_container(value)}).items()))
            problem = misplaced_key(name, node.get("name"), value) or (
                f"{name} is not a key of accelexp's config (added with +{name}=...?): nothing "
                f"would read it.{did_you_mean(name, known, value)} Check its spelling against "
                f"`python run.py --cfg job`."
            )
            yield f"  {problem}"
        elif isinstance(node[key], DictConfig):
            yield from _unknown_keys(node[key], name)


def did_you_mean(key: str, known: Iterable[str], value: Any = None) -> str:
    """ " Did you mean data.batch_size=3?" for `data.batchsize` (given `value`, 3) when one of the
    `known` keys of its node is spelled alike (a config group's name: `model=VALUE`); ""."""
    parent, _, leaf = key.rpartition(".")
    close = difflib.get_close_matches(leaf, list(known), n=1, cutoff=0.7)
    if not close:
        return ""
    typed = "..." if value is None else value
    return f" Did you mean {parent + '.' if parent else ''}{close[0]}={typed}?"


def unknown_key(key: str, known: Iterable[str], value: Any = None) -> str:
    """`key=value`, which Hydra cannot set because no schema declares `key`: said with the key
    it resembles (`known`: the keys of its node), or the options that have it (`misplaced_key`)."""
    hint = misplaced_key(key, None, value)
    if hint:
        return hint
    where = "Hydra's config" if key.startswith("hydra.") else "accelexp's config"
    listing = "--cfg hydra" if key.startswith("hydra.") else "--help"
    return (
        f"{key} is not a key of {where}.{did_you_mean(key, known, value)} `python run.py "
        f"{listing}` lists its keys."
    )


def renamed_key(key: str, value: Any = None) -> str:
    """For a key of `RENAMED_KEYS` (given `value`): its new name, as the override to type
    instead; "" for any other key."""
    new = RENAMED_KEYS.get(key)
    if new is None:
        return ""
    return f"{key} is now {new}" + ("" if value is None else f": {new}={value}")


def misplaced_key(key: str, chosen: str | None = None, value: Any = None) -> str:
    """For `data.num_train` with data=fashion_mnist (`chosen`): that the key belongs to other
    options of its group (data=synthetic) and what to do; for a renamed key, its new name
    (`renamed_key`); "" when no option of the group has it."""
    if key in RENAMED_KEYS:
        return renamed_key(key, value)
    group, _, leaf = key.rpartition(".")
    owners = [f"{group}={option}" for option in options_declaring(group, leaf)] if group else []
    if not owners:
        return ""
    this = f"{group}={chosen}" if chosen else f"the chosen {group}"
    owned = " and ".join([", ".join(owners[:-1]), owners[-1]] if len(owners) > 2 else owners)
    return f"{key} applies only to {owned}, not to {this}: drop it, or pick {owners[0]}."
