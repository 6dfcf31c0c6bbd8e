"""MLflow, and only MLflow: one run per job, its params, tags, metrics and artifacts.

The engine reports through a few calls (`start`, `log_metrics`, `log_artifact`, `end`). Only the
main process tracks; on other ranks a `Tracker(enabled=False)` does nothing. The store is checked
before any data is loaded, so an unreachable tracking server stops the job at once instead of
after an hour of training. Everything goes through `MlflowClient` (no global active run), so one
process can hold several runs, e.g. in tests.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from accelexp.errors import AccelexpError

log = logging.getLogger(__name__)

MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value
MAX_PARAMS_PER_BATCH = 100  # MLflow's limit on params in one log_batch call


class TrackingUnavailableError(AccelexpError):
    """The MLflow tracking store cannot be reached or opened."""


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{'a': {'b': 1}} -> {'a.b': '1'}; values cut to MLflow's 6000-character limit."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = str(value)[:MAX_PARAM_VALUE]
    return flat


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast with a clear message when the tracking store cannot be used."""
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s) as response:
                if response.status == 200:
                    return
                problem = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as error:
            problem = str(getattr(error, "reason", error))
        raise TrackingUnavailableError(
            f"The MLflow tracking server at {uri} is unreachable ({problem}). Start it (e.g. "
            f"`mlflow server --host 127.0.0.1 --port 5000 --backend-store-uri "
            f"sqlite:///outputs/mlflow.db`), fix mlflow.tracking_uri, or use the local store: "
            f"mlflow.tracking_uri=sqlite:///outputs/mlflow.db"
        )
    path = _sqlite_path(uri)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise TrackingUnavailableError(
                f"Cannot create the folder of the MLflow store {uri}: {error}"
            ) from error


class Tracker:
    def __init__(self, cfg: DictConfig, enabled: bool = True) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._client = None
        self._system_monitor = None

    # --- set-up --------------------------------------------------------------------------
    def connect(self) -> None:
        """Check the store and find or create the experiment (before any training)."""
        if not self.enabled:
            return
        check_reachable(self.cfg.tracking_uri)
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=self.cfg.tracking_uri)
        try:
            experiment = self._client.get_experiment_by_name(self.cfg.experiment)
            if experiment is None:
                self.experiment_id = self._client.create_experiment(
                    self.cfg.experiment, artifact_location=self._artifact_location()
                )
            else:
                self.experiment_id = experiment.experiment_id
        except Exception as error:  # the store exists but cannot be opened or written
            raise TrackingUnavailableError(
                f"Cannot use the MLflow store {self.cfg.tracking_uri}: {error}"
            ) from error

    def _artifact_location(self) -> str | None:
        if self.cfg.artifact_location:
            return self.cfg.artifact_location
        path = _sqlite_path(self.cfg.tracking_uri)
        if path is None:
            return None  # a tracking server chooses its own artifact store
        return (path.parent.resolve() / "mlartifacts" / self.cfg.experiment).as_uri()

    def start(self, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Param

        tags = {**tags, **_git_tags()}
        run = self._client.create_run(self.experiment_id, run_name=run_name, tags=dict(tags))
        self.run_id = run.info.run_id
        items = [Param(k, str(v)[:MAX_PARAM_VALUE]) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])
        if self.cfg.log_system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_monitor = SystemMetricsMonitor(
                self.run_id, sampling_interval=5, tracking_uri=self.cfg.tracking_uri
            )
            self._system_monitor.start()
        log.info("MLflow run %s (%s) in experiment %r", run_name, self.run_id, self.cfg.experiment)

    # --- during the run -------------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, float | None], step: int | None = None) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None]
        self._client.log_batch(self.run_id, metrics=batch)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        path = Path(path)
        if path.is_dir():
            self._client.log_artifacts(self.run_id, str(path), artifact_path)
        elif path.is_file():
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        """Close the run as FINISHED, FAILED or KILLED; what was logged before stays."""
        if not self.enabled or self.run_id is None:
            return
        if self._system_monitor is not None:
            self._system_monitor.finish()
        self._client.set_terminated(self.run_id, status=status)
        log.info("MLflow run %s ended: %s. %s", self.run_id, status, self.where_to_look())

    def where_to_look(self) -> str:
        """How to open this run in the MLflow UI (MLflow 3 opens on GenAI pages otherwise)."""
        page = f"#/experiments/{self.experiment_id}/runs/{self.run_id}"
        uri = self.cfg.tracking_uri
        if uri.startswith(("http://", "https://")):
            return f"View it at {uri.rstrip('/')}/{page}"
        return (
            f"View it with `mlflow ui --backend-store-uri {uri}`, then http://127.0.0.1:5000/{page}"
        )


def _git_tags() -> dict[str, str]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": commit} if commit else {}
