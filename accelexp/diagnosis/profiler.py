"""`profile=true`: torch.profiler traces of a few steps on every rank, and what HTA makes of them.

During epoch `profiler.epoch` every rank runs `torch.profiler` on the schedule `profiler.wait`,
`.warmup`, `.active` (the `active` steps are recorded; steps are `ProfilerStep#N` in the trace).
Right after that epoch, `collect` sends each rank's Chrome trace to the main rank (no shared disk
needed), which writes them as `<output_dir>/traces/rank-<R>.pt.trace.json.gz` and logs them as the
run's MLflow artifacts under `traces/`. Where the traces hold GPU kernels, Holistic Trace Analysis
(HTA) reads that folder and its figures become the run's `hta/...` metrics; on a CPU there is
nothing for HTA to analyse, and the run's `hta` tag says so.

To look at a trace, download `traces/` from the run in the MLflow UI (or `MLFLOW_TRACKING_URI=
sqlite:///outputs/mlflow.db mlflow artifacts download -r RUN_ID -a traces -d .`), then:
- Perfetto: open a `rank-<R>.pt.trace.json.gz` at https://ui.perfetto.dev (or chrome://tracing);
- TensorBoard (its PyTorch profiler plugin, deprecated, finds `*.pt.trace.json.gz` files):
  `pip install torch-tb-profiler`, `tensorboard --logdir <the folder holding traces/>`;
- HTA in a notebook: `TraceAnalysis(trace_dir="traces")`, for the analyses and plots not logged.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import math
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from omegaconf import DictConfig

from accelexp import record

log = logging.getLogger(__name__)

# HTA's cut-offs for its CUDA kernel launch statistics (its defaults), in microseconds
RUNTIME_CUTOFF_US = 50
LAUNCH_DELAY_CUTOFF_US = 100


class StepProfiler:
    """Profiles the steps of one epoch on this rank; `collect` gathers and analyses the traces."""

    def __init__(self, cfg: DictConfig, output_dir: Path, rank: int, device: torch.device) -> None:
        self.cfg = cfg.profiler
        self._on = bool(cfg.profile)
        self.output_dir = Path(output_dir)
        self.rank = rank
        self.device = device
        self._profile: torch.profiler.profile | None = None  # only inside the profiled epoch
        self._exported: Path | None = None  # this rank's trace, once the profiler has it
        self._collect_due = False
        steps = self.cfg.wait + self.cfg.warmup + self.cfg.active
        cap = cfg.get("max_steps_per_epoch")
        if self._on and cap is not None and cap < steps:
            log.warning(
                "profile=true: epoch %d stops after %d steps, so fewer than profiler.active=%d "
                "steps are recorded (it takes profiler.wait + warmup + active = %d steps).",
                self.cfg.epoch,
                cap,
                self.cfg.active,
                steps,
            )

    @property
    def enabled(self) -> bool:
        return self._on

    def epoch(self, epoch: int) -> contextlib.AbstractContextManager:
        """Where epoch `epoch`'s steps run: under the profiler in the profiled epoch."""
        if not self._on or epoch != self.cfg.epoch:
            return contextlib.nullcontext()
        return self._profiling()

    @contextlib.contextmanager
    def _profiling(self) -> Iterator[None]:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(
            wait=self.cfg.wait, warmup=self.cfg.warmup, active=self.cfg.active, repeat=1
        )
        with torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self._export,
            record_shapes=self.cfg.record_shapes,
            profile_memory=self.cfg.profile_memory,
            with_stack=self.cfg.with_stack,
        ) as profile:
            self._profile = profile
            try:
                yield
            finally:
                self._profile = None
        self._collect_due = True

    def step(self) -> None:
        """After every training step (nothing to do outside the profiled epoch)."""
        if self._profile is not None:
            self._profile.step()

    def _export(self, profile: torch.profiler.profile) -> None:
        folder = Path(tempfile.mkdtemp(prefix="accelexp-trace-"))
        self._exported = folder / f"rank-{self.rank}.pt.trace.json"
        profile.export_chrome_trace(str(self._exported))

    # --- after the profiled epoch ---------------------------------------------------------
    def collect(self, strategy, tracker) -> dict[str, float]:
        """On every rank after the profiled epoch: the traces to the main rank, MLflow, HTA.

        Returns (and logs, at the profiled epoch's step) HTA's figures where the traces hold GPU
        kernels, `{}` elsewhere. The figures cover all ranks: `hta/idle_pct`, `hta/compute_pct`,
        `hta/non_compute_pct` (HTA's temporal breakdown, % of the GPU's time) and
        `hta/comm_comp_overlap_pct` are means over the ranks; `hta/{computation,communication,
        memory}_kernel_pct` (HTA's kernel-type breakdown, the rest is kernels overlapping) and
        `hta/idle_{host,kernel}_wait_pct` (HTA's idle-time breakdown, % of the idle time) are
        over the ranks' summed times; `hta/short_kernels_pct` and `hta/launch_delay_outliers_pct`
        are % of the kernel launches of all ranks (HTA's launch statistics, by its cut-offs).
        HTA leaves out the last profiled step (it may be incomplete).
        """
        if not self._collect_due:
            return {}
        self._collect_due = False
        traces = strategy.sync.gather_object(self._payload())  # collective: every rank sends
        metrics = self._publish(traces, tracker) if strategy.shape.is_main else {}
        strategy.sync.barrier()  # the other ranks' next epoch starts when the analysis is done
        return metrics

    def _payload(self) -> tuple[int, bytes] | None:
        """(GPU kernels in it, gzipped trace) of this rank, or None when no step was recorded."""
        if self._exported is None:
            return None
        raw = self._exported.read_bytes()
        shutil.rmtree(self._exported.parent, ignore_errors=True)
        self._exported = None
        try:
            trace = json.loads(raw)
        except ValueError as error:  # sent as it is: this rank must still join the gather
            log.warning("The profiler's trace of rank %d is not valid JSON: %s", self.rank, error)
            return raw.count(b'"cat": "kernel"'), gzip.compress(raw)
        # HTA takes a file's rank from the first `"rank": N` in it: `distributedInfo` first,
        # with this rank where torch.distributed did not write one (one process, Horovod).
        info = trace.pop("distributedInfo", None) or {"rank": self.rank}
        trace = {"distributedInfo": info, **trace}
        kernels = sum(event.get("cat") == "kernel" for event in trace.get("traceEvents", ()))
        return kernels, gzip.compress(json.dumps(trace).encode())

    def _publish(self, traces: list[tuple[int, bytes] | None], tracker) -> dict[str, float]:
        """Main rank: write and log the traces, then run HTA on them where it applies."""
        if not any(traces):
            steps = self.cfg.wait + self.cfg.warmup
            self._not_run(
                tracker,
                f"not run: no trace was recorded (epoch {self.cfg.epoch} has fewer than "
                f"profiler.wait + warmup = {steps} steps)",
                logging.WARNING,
            )
            return {}
        folder = self.output_dir / "traces"
        folder.mkdir(parents=True, exist_ok=True)
        for rank, trace in enumerate(traces):
            if trace is not None:
                (folder / f"rank-{rank}.pt.trace.json.gz").write_bytes(trace[1])
        tracker.log_artifact(folder, "traces")
        log.info("Profiler traces in %s (MLflow artifacts: traces/)", folder)
        if not any(trace and trace[0] for trace in traces):
            self._not_run(
                tracker,
                f"not run: the traces have no GPU kernels (device {self.device.type}); "
                "HTA analyses GPU kernels only",
            )
            return {}
        try:
            metrics = hta_figures(folder)
        except ImportError as error:
            self._not_run(
                tracker,
                f"not run: HTA cannot be imported ({error}); bash scripts/setup.sh installs it",
                logging.WARNING,
            )
            return {}
        except Exception as error:  # HTA's trouble must never end the training run
            first_line = next(iter(str(error).strip().splitlines()), "")[:300]
            self._not_run(tracker, f"failed: {type(error).__name__} {first_line}", logging.WARNING)
            return {}
        tracker.log_metrics(metrics, step=self.cfg.epoch)
        ranks = sum(map(bool, traces))
        tracker.set_tags(
            {record.HTA: f"run on the traces of {ranks} rank(s): see the hta/ metrics"}
        )
        log.info("HTA: %s", ", ".join(f"{k} {v:.3g}" for k, v in metrics.items()))
        return metrics

    def _not_run(self, tracker, reason: str, level: int = logging.INFO) -> None:
        log.log(level, "Holistic Trace Analysis %s", reason)
        tracker.set_tags({record.HTA: reason})


def hta_figures(folder: Path) -> dict[str, float]:
    """HTA's temporal, kernel-type and idle-time breakdowns, communication-computation overlap
    and kernel launch statistics of the traces in `folder`, as `hta/...` figures (see
    `StepProfiler.collect`); figures HTA cannot give (no communication: no overlap) are left out."""
    import pandas as pd
    from hta.trace_analysis import TraceAnalysis

    with _quiet("hta"):  # its timings, parser advice and 0/0 warnings, at every run
        analysis = TraceAnalysis(trace_dir=str(folder))
        temporal = analysis.get_temporal_breakdown(visualize=False)
        ranks = [int(rank) for rank in temporal["rank"]]
        kinds = analysis.get_gpu_kernel_breakdown(visualize=False)[0]
        idle = analysis.get_idle_time_breakdown(ranks=ranks, visualize=False)[0]
        overlap = analysis.get_comm_comp_overlap(visualize=False)
        launches = analysis.get_cuda_kernel_launch_stats(
            ranks=ranks,
            runtime_cutoff=RUNTIME_CUTOFF_US,
            launch_delay_cutoff=LAUNCH_DELAY_CUTOFF_US,
            visualize=False,
        )
    kind_pct = kinds.set_index("kernel_type")["percentage"]
    idle_time = idle.groupby("idle_category")["idle_time"].sum()
    idle_total = idle_time.sum() or math.nan
    launch = pd.concat(launches.values())
    short = (launch.cpu_duration <= RUNTIME_CUTOFF_US) & (launch.gpu_duration < launch.cpu_duration)
    figures = {
        record.HTA_IDLE_PCT: temporal["idle_time_pctg"].mean(),
        record.HTA_COMPUTE_PCT: temporal["compute_time_pctg"].mean(),
        record.HTA_NON_COMPUTE_PCT: temporal["non_compute_time_pctg"].mean(),
        record.HTA_COMPUTATION_KERNEL_PCT: kind_pct.get("COMPUTATION", 0.0),
        record.HTA_COMMUNICATION_KERNEL_PCT: kind_pct.get("COMMUNICATION", 0.0),
        record.HTA_MEMORY_KERNEL_PCT: kind_pct.get("MEMORY", 0.0),
        record.HTA_IDLE_HOST_WAIT_PCT: 100 * idle_time.get("host_wait", 0.0) / idle_total,
        record.HTA_IDLE_KERNEL_WAIT_PCT: 100 * idle_time.get("kernel_wait", 0.0) / idle_total,
        record.HTA_COMM_COMP_OVERLAP_PCT: overlap["comp_comm_overlap_pctg"].mean(),
        record.HTA_SHORT_KERNELS_PCT: 100 * short.mean(),
        record.HTA_LAUNCH_DELAY_OUTLIERS_PCT: 100
        * (launch.launch_delay > LAUNCH_DELAY_CUTOFF_US).mean(),
    }
    return {name: float(value) for name, value in figures.items() if math.isfinite(value)}


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """Only errors from `logger`, and no Python warnings, inside."""
    logger_ = logging.getLogger(logger)
    level = logger_.level
    logger_.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger_.setLevel(level)
