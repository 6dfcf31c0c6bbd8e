"""MLflow, and only MLflow: writing one job's run, its params, tags, metrics and artifacts.

The engine reports through a few calls (`start`, `log_dataset`, `log_metrics`, `log_artifact`,
`log_model`, `end`), in MLflow's own conventions so the UI's default columns fill: the training
set is a run input (Dataset column), the best model an MLflow model (Models column), metrics are
kept to `METRIC_DIGITS` significant digits. Only the main process tracks; on other ranks a
`Tracker(enabled=False)` does nothing. The store is checked before any data is loaded
(`connect`), so an unreachable tracking server stops the job at once instead of after an hour of
training. Everything goes through `MlflowClient` (no global active run; `mlflow.pytorch` is
given the run id), so one process can hold several runs, e.g. in tests.

The store itself is reached through `store`, the run's name and tags come from `names`; its
status (started, RUNNING again, closed; stale runs healed) is set by `life`, which `start`,
`resume`, `end` and `connect` call.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from accelexp import record
from accelexp.record import FINISHED, KILLED
from accelexp.tracking import life, store
from accelexp.tracking.names import tag_list, where_to_look
from accelexp.tracking.outage import (
    KILLED_FLUSH_S,
    UNSENT,
    Outage,
    ServerGoneError,
    Writer,
    outage_for,
    take_unsent,
)
from accelexp.tracking.store import MAX_METRICS_PER_BATCH, MAX_PARAM_VALUE, MAX_PARAMS_PER_BATCH

log = logging.getLogger(__name__)

# Metrics are stored with this many significant digits, so the UI shows 0.91234 rather than
# 0.9123400449752808: an accuracy on up to 100,000 samples keeps every digit, and the error
# (under 5e-5 of the value) is far below run-to-run noise in throughput and time (~1%).
METRIC_DIGITS = 5


def significant(value: float, digits: int = METRIC_DIGITS) -> float:
    """`value` to `digits` significant digits: 0.000123456 -> 0.00012346, never to 0; nan and inf
    stay as they are."""
    return float(f"{float(value):.{digits}g}")


class Tracker:
    """One job's run, written by its main process (`enabled`); on other ranks nothing."""

    def __init__(self, cfg: DictConfig, enabled: bool = True) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._client = None
        self._system_monitor = None
        self._outage: Outage | None = None  # a tracking server's: how long it may be gone
        self._writer: Writer | None = None  # ... and the thread that writes to it, in order
        self._failure: BaseException | None = None  # the writer's, once raised to the loop

    # --- set-up --------------------------------------------------------------------------
    def connect(self, heal: bool = True) -> None:
        """Check the store and find or create the experiment (before any training); then, with
        `heal`, fail the experiment's runs of this host whose process is gone
        (`life.heal_stale_runs`)."""
        if not self.enabled:
            return
        self._outage = outage_for(self.cfg)  # a server's absence is waited out (outage.py)
        self._client, self.experiment_id = store.open_experiment(self.cfg, self._outage)
        if heal:
            life.heal_stale_runs(self._client, [self.experiment_id], "run.py")

    def start(self, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Param

        self.run_id = life.start_run(self._client, self.cfg, self.experiment_id, run_name, tags)
        folder = tags.get(record.OUTPUT_DIR)
        self._start_writer(Path(folder) / "checkpoints" if folder else None)
        items = [Param(k, str(v)[:MAX_PARAM_VALUE]) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            batch = items[i : i + MAX_PARAMS_PER_BATCH]
            self._write("the params", partial(self._client.log_batch, self.run_id, params=batch))
        if self.cfg.log_system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_monitor = SystemMetricsMonitor(
                self.run_id, sampling_interval=5, tracking_uri=self.cfg.tracking_uri
            )
            self._system_monitor.start()

    def resume(
        self, run_id: str, epoch: int, output_dir: Path, checkpoints: Path | None = None
    ) -> None:
        """Continue run `run_id` (RUNNING again, in this process: `life.resume_run`): its
        metrics go on at the next epoch's step. Writes a server gone too long did not take,
        kept beside its `checkpoints` (`outage.UNSENT`), are sent first, in their order; the
        file goes once they all are (a process killed meanwhile resends the rest)."""
        if not self.enabled:
            return
        self.run_id = run_id
        life.resume_run(self._client, run_id)
        self._start_writer(output_dir / "checkpoints")
        if checkpoints is not None:
            token, unsent = take_unsent(checkpoints / UNSENT, self._client)
            if self._writer is not None:
                self._writer.taken = token
            for what, write in unsent:
                self._write(what, write)
            if unsent:
                log.info("Sending first the writes kept in %s", checkpoints / UNSENT)
        self.set_tags(
            {record.RESUMED_AFTER_EPOCH: str(epoch), record.OUTPUT_DIR: str(output_dir.resolve())}
        )
        log.info("MLflow run %s continues after epoch %d", run_id, epoch)

    # --- runs to continue (resume) -------------------------------------------------------
    def run_folder(self, run_id: str) -> str | None:
        """The output folder of run `run_id` (its `output_dir` tag), if the run exists."""
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id).data.tags.get(record.OUTPUT_DIR)
        except MlflowException:
            return None

    def run_status(self, run_id: str) -> str | None:
        """Run `run_id`'s status (FINISHED, KILLED, ...), None if this store has no such run."""
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id).info.status
        except MlflowException:
            return None

    def unfinished_run_folders(self, config_hash: str) -> list[str]:
        """Output folders of this experiment's runs of `config_hash` that did not finish (killed,
        failed, or still marked running), newest first."""
        runs = self._client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.{record.CONFIG_HASH} = '{config_hash}' "
            "and attributes.status != 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=50,
        )
        folder = record.OUTPUT_DIR
        return [run.data.tags[folder] for run in runs if folder in run.data.tags]

    def rejected_by_autotune(self, setting: str) -> dict[str, str]:
        """The overrides autotune measured on setting `setting` (`record.SETTING_ID`) on this
        host, in any experiment, and rejected the last time it decided on them: {override: why};
        none while the tracking server is gone."""
        if not self.enabled or (self._outage is not None and self._outage.since is not None):
            return {}  # advice is not worth waiting for a server that is gone
        ids = [e.experiment_id for e in self._client.search_experiments()]
        runs = self._client.search_runs(
            ids,
            filter_string=f"tags.`{record.AUTOTUNE_BASE_SETTING}` = '{setting}' "
            f"and tags.{record.HOST} = '{platform.node()}'",
            order_by=["attributes.start_time DESC"],
            max_results=500,
        )
        newest: dict[str, dict[str, str]] = {}
        for run in runs:
            if record.AUTOTUNE_DECISION in run.data.tags:
                newest.setdefault(run.data.tags[record.AUTOTUNE_CANDIDATE], run.data.tags)
        return {
            override: tags.get(record.AUTOTUNE_WHY, "")
            for override, tags in newest.items()
            if tags[record.AUTOTUNE_DECISION] == record.AUTOTUNE_REJECTED
        }

    # --- during the run -------------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, float | None], step: int | None = None) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(k, significant(v), now, step or 0) for k, v in metrics.items() if v is not None
        ]
        self._write("the metrics", partial(self._client.log_batch, self.run_id, metrics=batch))

    def log_series(self, values: Mapping[str, Mapping[int, float]]) -> None:
        """Metrics with a value per step of their own: {name: {step: value}}."""
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(name, significant(v), now, step)
            for name, series in values.items()
            for step, v in series.items()
        ]
        for start in range(0, len(batch), MAX_METRICS_PER_BATCH):
            part = batch[start : start + MAX_METRICS_PER_BATCH]
            self._write("the metrics", partial(self._client.log_batch, self.run_id, metrics=part))

    def log_dataset(
        self, name: str, identity: Mapping[str, Any], source: Path | str, context: str = "training"
    ) -> None:
        """Record the data set as a run input (the UI's Dataset column): its metadata only, no
        copy of the data. `identity` (split sizes, image shape, seeds...) tells two sets of one
        name apart: its hash is the digest. `source` is the folder the set was read from, or
        the name of the code that made or found it."""
        if not self.enabled:
            return
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.data.sources import LocalArtifactDatasetSource
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        text = json.dumps({"name": name, **identity}, sort_keys=True, default=str)
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        if isinstance(source, Path):
            origin = LocalArtifactDatasetSource(source.resolve().as_uri())
        else:
            origin = CodeDatasetSource({"code": source, **{k: str(v) for k, v in identity.items()}})
        dataset = MetaDataset(origin, name=name, digest=digest)._to_mlflow_entity()
        tags = [InputTag(MLFLOW_DATASET_CONTEXT, context)]
        run_id, client = self.run_id, self._client

        def log_input() -> None:
            try:
                client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags)])
            except Exception as error:  # a job beside it made the same set at the same moment
                if "UNIQUE constraint failed: datasets" not in str(error):
                    raise
                client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags)])

        self._write(f"the data set {name}", log_input)

    def log_model(self, model: Any, input_example: Any, name: str = "model") -> None:
        """`model` (a torch module on the CPU) as an MLflow model of this run, for the UI's Models
        column and `mlflow.pytorch.load_model`. MLflow's default format, a graph traced by
        `torch.export` from `input_example` (a batch, a tensor), loads without accelexp installed
        and runs no pickled code. Its requirements are given (torch and cloudpickle at their
        installed versions), so MLflow spends no time inferring them. A model that cannot be
        logged is a warning: the run's results are kept all the same."""
        if not self.enabled:
            return
        import mlflow
        import mlflow.pytorch
        import torch
        from mlflow.models import infer_signature

        with torch.no_grad():
            output = model(input_example)
        # tensor specs (what the export needs), from numpy arrays
        signature = infer_signature(input_example.numpy(), output.numpy())
        self.flush()  # its run's writes first; then it waits out a server gone, too

        def log_it() -> None:
            # mlflow.pytorch writes through the fluent API's store and experiment (else it puts
            # the model in experiment 0, whose artifacts go to ./mlruns)
            mlflow.set_tracking_uri(self.cfg.tracking_uri)
            mlflow.set_experiment(experiment_id=self.experiment_id)
            mlflow.pytorch.log_model(
                model,
                name=name,
                run_id=self.run_id,
                signature=signature,
                input_example=input_example.numpy(),
                pip_requirements=mlflow.pytorch.get_default_pip_requirements(),
            )

        try:
            if self._outage is not None:
                self._outage.call(log_it)
            else:
                log_it()
        except ServerGoneError:  # the run stops: its server is gone past the budget
            raise
        except Exception as error:
            log.warning("Could not log the model of run %s to MLflow: %s", self.run_id, error)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        path = Path(path)
        if path.is_dir():
            write = partial(self._client.log_artifacts, self.run_id, str(path), artifact_path)
        elif path.is_file():
            write = partial(self._client.log_artifact, self.run_id, str(path), artifact_path)
        else:
            return
        self._write(f"the artifact {path.name}", write)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if not self.enabled:
            return
        self._write("the tags", partial(self._client.log_batch, self.run_id, tags=tag_list(tags)))

    def log_text(self, text: str, artifact_file: str) -> None:
        """`text` as the artifact `artifact_file` (e.g. diagnosis.md) of this run."""
        if not self.enabled:
            return
        write = partial(self._client.log_text, self.run_id, text, artifact_file)
        self._write(f"the artifact {artifact_file}", write)

    def _writing(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A store that stops taking writes mid-run (a full disk, a server gone) is one message."""
        return store.writing(self.cfg.tracking_uri, what, self.run_id)

    # --- writes: to a tracking server by a thread of their own, in order ---------------------
    def _start_writer(self, checkpoints: Path | None) -> None:
        """A tracking server's writer; what it cannot send is kept in `checkpoints`."""
        if self._outage is not None and self._writer is None:
            unsent = checkpoints / UNSENT if checkpoints is not None else None
            self._writer = Writer(self._outage, self.run_id, unsent)

    def _write(self, what: str, write: Callable[[], Any]) -> None:
        """`write` (`what` names it in an error): handed to the writer's thread when the store
        is a tracking server (the loop goes on; the writer's failure, a server gone past the
        budget, is raised here, at the next write), else done now."""
        if self._writer is None:
            with self._writing(what):
                write()
            return
        try:
            self._writer.put(what, write)
        except BaseException as error:
            self._failure = error  # the user hears it as the error that ends the run
            raise

    def flush(self, limit_s: float | None = None) -> None:
        """Wait until every write so far is sent (at most `limit_s`; a server gone: its budget),
        e.g. before the process hands the run to another (lockstep's next incarnation)."""
        if self._writer is not None:
            self._writer.flush(limit_s)

    def end(self, status: str = FINISHED) -> None:
        """Close the run as FINISHED, FAILED or KILLED (`life.end_run`) once its writes are sent
        (waiting out a server gone, within its budget; stopped by a signal, `KILLED_FLUSH_S` at
        most); what was logged before stays. A FINISHED run whose writes cannot be sent raises
        that error; otherwise a store that fails here is said in a line (not again when it is
        the error that ended the run), and the error that ended the run stays the one raised."""
        if not self.enabled or self.run_id is None:
            return
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            try:
                writer.flush(KILLED_FLUSH_S if status == KILLED else None)
            except BaseException as error:
                if status == FINISHED:
                    raise
                if error is not self._failure:
                    log.warning(
                        "Could not mark MLflow run %s as %s: %s", self.run_id, status, error
                    )
                return
        life.end_run(self._client, self.run_id, status, self.where_to_look(), self._system_monitor)
        gone = self._outage.failure if self._outage is not None else None
        if gone is not None and status == FINISHED:  # it went again, past the budget, just now
            raise gone

    def where_to_look(self) -> str:
        return where_to_look(self.cfg.tracking_uri, self.experiment_id, self.run_id)
