"""What a run is called and tagged: its name, what it is, where its process lives, its link.

A run's name says what differs between runs (`run_name`: in a sweep, what the jobs vary first);
its tags say what it is (`run_tags`), which sweep it belongs to (`sweep_tags`, from the
environment a sweep's parent hands its jobs: `PARENT_RUN_ENV`...), which commit ran it
(`git_tags`) and where its process lives (`where_it_runs`: host, pid namespace, pid, start
time, which healing reads back); `where_to_look` is the link to a run in the MLflow UI.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig

from accelexp import objective, processes, record
from accelexp.tracking import credentials

# A sweep's parent run, handed to its jobs (also in worker and launcher subprocesses) by env
PARENT_RUN_ENV = "ACCELEXP_PARENT_RUN_ID"
SWEEP_NAME_ENV = "ACCELEXP_SWEEP_NAME"
SWEPT_KEYS_ENV = "ACCELEXP_SWEPT_KEYS"  # the keys a sweep varies, comma-separated
# swept keys a run's name shows by their value alone: `amp`, not `precision=amp`
SHOWN_BY_VALUE = {"model", "parallelism", "parallelism.sync", "precision"}
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default


def run_name(
    cfg: DictConfig,
    speed: str = "eager",
    overrides: Sequence[str] = (),
    parallelism: Mapping[str, str] | None = None,
) -> str:
    """`mlflow.run_name`, or what differs between runs: e.g. resnet18-horovod-np4-amp, and the
    speed switches that are on (`SpeedSwitches.summary()`), e.g. resnet50-single-bf16-tf32+cl.

    In a sweep what the jobs differ in comes first, in short (`np2`, `amp`, `lr=0.2`), then the
    rest of the name: `np2 amp simple_cnn-ddp`. The MLflow UI cuts names at about 15 characters,
    so rows stay told apart; no two jobs of a sweep share a name: repeats start with `r1 `,
    `r2 `... (what differs first, so the cut names still tell repeats apart)."""
    repeat = f"r{cfg.repeat_index + 1} " if cfg.repeats > 1 else ""
    if cfg.mlflow.run_name:
        return repeat + cfg.mlflow.run_name
    parts = _name_parts(cfg, speed, parallelism or {"parallelism": cfg.parallelism.name})
    swept = [k for k in os.environ.get(SWEPT_KEYS_ENV, "").split(",") if k]
    values = {}
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        values[key] = value
    shown = [key for key in swept if key in values]
    rest = "-".join(part for key, part in parts.items() if key not in shown)
    return repeat + " ".join([*(_short(key, values[key]) for key in shown), rest])


def _short(key: str, value: str) -> str:
    """A swept key's value as a run's name shows it: np2, amp, adamw (a group), lr=0.2; a number
    an optimizing sweeper drew to 4 significant digits (lr=0.03756, not 0.03756196144499839)."""
    if key == "parallelism.nprocs":
        return f"np{value}"
    if key in SHOWN_BY_VALUE or "." not in key:
        return value
    with contextlib.suppress(ValueError):
        if "." in value and len(value) > len(f"{float(value):.4g}"):
            value = f"{float(value):.4g}"
    return f"{key.rpartition('.')[2]}={value}"


def _name_parts(cfg: DictConfig, speed: str, parallelism: Mapping[str, str]) -> dict[str, str]:
    """The parts of a derived run name, by the key that sets each; `parallelism` is what the
    strategy says of itself (`accelexp.parallel.run_label`), e.g. hybrid-ddp-np2-s2c1."""
    parts = {"model": cfg.model.name, **parallelism}
    parts["precision"] = cfg.precision.name
    if speed != "eager":
        parts["speed"] = speed
    return parts


def run_tags(cfg: DictConfig, world_size: int, overrides: Sequence[str] = ()) -> dict[str, str]:
    """What a run is, as tags to group and filter by in the MLflow UI and the report; then
    `mlflow.tags`, the user's own (a study's rung, say)."""
    return {
        record.PARALLELISM: cfg.parallelism.name,
        record.PRECISION: cfg.precision.name,
        record.MODEL: cfg.model.name,
        record.DATA: cfg.data.name,
        record.WORLD_SIZE: str(world_size),
        record.REPEAT_INDEX: str(cfg.repeat_index),
        record.REPEATS: str(cfg.repeats),
        record.OVERRIDES: credentials.redact(" ".join(overrides)),
        **objective.tags(cfg.get("objective", objective.DEFAULT)),
        **{str(k): str(v) for k, v in (cfg.mlflow.get("tags") or {}).items()},
    }


def sweep_tags() -> dict[str, str]:
    """The sweep this process's run belongs to (its parent run, the sweep's name), from the
    environment the sweep's parent handed it; none outside a sweep."""
    parent = os.environ.get(PARENT_RUN_ENV)
    if not parent:
        return {}
    return {record.PARENT_RUN: parent, record.SWEEP: os.environ.get(SWEEP_NAME_ENV, parent)}


def git_tags() -> dict[str, str]:
    """The commit checked out here, when there is one."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {record.GIT_COMMIT: commit} if commit else {}


def tag_list(tags: Mapping[str, Any]) -> list[Any]:
    """`tags` as MLflow's `RunTag`s, for a batch."""
    from mlflow.entities import RunTag

    return [RunTag(k, str(v)) for k, v in tags.items()]


def where_it_runs() -> dict[str, str]:
    """This process as a run's tags: its host, its pid and when it started (a later process
    that reuses the pid started later)."""
    pid = os.getpid()
    return {
        record.HOST: platform.node(),
        record.PID: str(pid),
        record.PROCESS_START: f"{processes.started_at(pid):.2f}",
        record.PID_NAMESPACE: processes.pid_namespace(),
    }


def where_to_look(
    uri: str, experiment_id: str, run_id: str, artifact: str | None = None, command: bool = True
) -> str:
    """The link to a run, or to one of its artifacts, in the MLflow UI; for a store without a
    server, also the command that starts the UI (unless `command=False`). Short, never a
    password: `http://127.0.0.1:5000/#/experiments/1/runs/<id> (UI: mlflow ui ...)`."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    if artifact:  # the UI's artifact viewer opens on this file
        page += f"/artifacts/{artifact}"
    if uri.startswith(("http://", "https://")):
        return f"{credentials.split(uri)[0].rstrip('/')}/{page}"
    link = f"{LOCAL_UI}/{page}"
    if not command:
        return link
    return f"{link} (UI: mlflow ui --backend-store-uri {credentials.redact(uri)})"
