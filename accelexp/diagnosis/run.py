"""The diagnosis of one run: each epoch's time accounting logged, the verdict said at the end.

`RunDiagnosis` is fed every trained epoch's breakdown and throughput (metrics `time/*`,
`achieved_gflops`), and at the run's end, on the main rank, measures the device's matmul peak,
draws the verdict (`verdict.diagnose`) from the last epoch, prints it, and records it in MLflow:
tags `diagnosis`, `diagnosis_detail`, `diagnosis_next`, the artifact `diagnosis.md`, and the
metrics `flop_utilisation` and `peak_gflops`. Each epoch's contention figures (`noise/*`) are
judged at the end too (`accelexp.diagnosis.noise`): tags `noise` (quiet | contended) and
`noise_evidence`, a section of `diagnosis.md`, and the run's last console line. The same figures
say what of this host the run left idle (`machine`), which the strategy's "more devices" advice
is drawn from (`accelexp.machine`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from accelexp import record
from accelexp.config.identity import setting_id
from accelexp.config.resources import usable_cores
from accelexp.diagnosis import flops
from accelexp.diagnosis.noise import NoiseSample, NoiseVerdict, busiest, judge, stolen_cores
from accelexp.diagnosis.verdict import RunFacts, Verdict, diagnose, memory_advice, usable
from accelexp.errors import AccelexpError
from accelexp.machine import Machine, visible_gpus
from accelexp.parallel.base import Strategy
from accelexp.timing import Breakdown
from accelexp.tracking import Tracker

log = logging.getLogger(__name__)


class RunOutOfMemoryError(AccelexpError):
    """The device ran out of memory; the message gives the peak and the ways out."""


class RunDiagnosis:
    def __init__(
        self,
        strategy: Strategy,
        cfg: DictConfig,
        flops_per_sample: float | None,
        in_effect: Mapping[str, str] | None = None,
        convolutional: bool = True,
        checkpointable: bool = False,
    ) -> None:
        """`cfg`: the run's config, `in_effect`: the settings it really ran with where they
        differ from it (`speed.channels_last` chosen by `auto`; the precision it computes in,
        bf16 for amp on a CPU, is the precision's own), `convolutional`: whether the model has
        2-D convolutions, `checkpointable`: whether it has blocks activation checkpointing can
        checkpoint; the advice is drawn for them."""
        self.strategy, self.precision = strategy, strategy.precision
        self.in_effect = {**(in_effect or {}), "precision": self.precision.effective_name}
        self.cfg, self.convolutional = cfg, convolutional
        self.checkpointable = checkpointable
        self.batch_size, self.flops_per_sample = cfg.data.batch_size, flops_per_sample
        self.last: Breakdown | None = None
        self.samples_per_s_per_device = 0.0
        self.peak_mem_mb: float | None = None
        self.hta: dict[str, float] = {}
        self.noise: list[NoiseSample] = []

    def profiled(self, hta_figures: dict[str, float]) -> None:
        """HTA's figures of the profiled epoch (GPU traces only), evidence for the verdict."""
        self.hta.update(hta_figures)

    def epoch(
        self,
        breakdown: Breakdown,
        samples_per_s_per_device: float,
        peak_mem_mb: float,
        noise: NoiseSample | None = None,
    ) -> dict[str, float | None]:
        """This epoch's metrics; the last epoch is the one the verdict reads, every epoch's
        `noise` (what showed a shared machine while it was timed) the noise verdict."""
        self.last, self.peak_mem_mb = breakdown, peak_mem_mb
        self.samples_per_s_per_device = samples_per_s_per_device
        achieved = None
        if self.flops_per_sample:
            achieved = self.flops_per_sample * samples_per_s_per_device / 1e9
        if noise is not None:
            self.noise.append(noise)
        noise_metrics = noise.metrics() if noise is not None else {}
        return {**breakdown.metrics(), record.ACHIEVED_GFLOPS: achieved, **noise_metrics}

    def noise_verdict(self) -> NoiseVerdict:
        return judge(self.noise, self.strategy.device.type, torch.get_num_threads())

    def machine(self) -> Machine:
        """This host as the run found it: the epoch that left the fewest cores idle, the GPUs
        it sees (for "more devices": `accelexp.machine`)."""
        device, threads = self.strategy.device.type, torch.get_num_threads()
        sample = busiest(self.noise)
        if sample is None:
            return Machine(device, usable_cores(), threads, visible_gpus(device))
        util = sample.cpu_util
        return Machine(
            device,
            sample.host_cores,
            threads,
            visible_gpus(device),
            job_cores=sample.job_cores,
            others_cores=sample.others_cores,
            worker_cores=None if util is None else util * threads,
            stolen_cores=stolen_cores(sample),
        )

    def finish(self, tracker: Tracker, run_name: str) -> Verdict | None:
        """On the main rank: the verdict, printed and recorded. None before any epoch."""
        if not self.strategy.shape.is_main or self.last is None:
            return None
        device = self.strategy.device
        noise, machine = self.noise_verdict(), self.machine()
        utilisation = peak = None
        if self.flops_per_sample:
            peak = flops.peak_flops(
                device, self.precision.autocast, dtype=self.precision.param_dtype
            )
            utilisation = self.flops_per_sample * self.samples_per_s_per_device / peak
        verdict = diagnose(
            RunFacts(
                breakdown=self.last,
                device_type=device.type,
                batch_size=self.batch_size,
                flop_utilisation=utilisation,
                peak_mem_mb=self.peak_mem_mb,
                device_mem_mb=device_memory_mb(device),
                comm_advice=self.strategy.sync.comm_advice(),
                hta=self.hta,
                config=self.cfg,
                in_effect=self.in_effect,
                convolutional=self.convolutional,
                checkpointable=self.checkpointable,
                scale_out=self.strategy.scale_out_advice(machine),
                machine=machine,
                contention=noise.evidence if noise.contended else [],
                rejected=self.rejected_by_autotune(tracker),
            )
        )
        log.info("%s", verdict.console())
        peak_gflops = peak and peak / 1e9
        tracker.log_metrics({record.FLOP_UTILISATION: utilisation, record.PEAK_GFLOPS: peak_gflops})
        tracker.set_tags({**verdict.tags(), **noise.tags()})
        tracker.log_text(verdict.markdown(run_name) + noise.markdown(), "diagnosis.md")
        return verdict

    def rejected_by_autotune(self, tracker: Tracker) -> dict[str, str]:
        """What autotune measured on this run's setting on this host and rejected (never
        offered again); nothing, with a warning, when the store cannot say."""
        setting = setting_id(OmegaConf.to_container(self.cfg, resolve=True))
        try:
            return tracker.rejected_by_autotune(setting)
        except Exception as error:  # advice is not worth a failed run
            log.warning("Could not look up what autotune rejected for this setting: %s", error)
            return {}

    def say_noise(self) -> None:
        """The run's last console line, on the main rank: was the machine quiet while timed."""
        if self.strategy.shape.is_main and self.noise:
            noise = self.noise_verdict()
            log.log(logging.WARNING if noise.contended else logging.INFO, "%s", noise.console())

    def out_of_memory(self, error: BaseException, epoch: int) -> RunOutOfMemoryError:
        """The one message of a run that ran out of memory (`error`: the allocator's)."""
        device = self.strategy.device
        total = device_memory_mb(device)
        peak = self.strategy.memory_metrics().get(record.PEAK_MEM_MB)
        reached = f"peak {peak:.0f} MB" if peak is not None else "peak unknown"
        if total:
            reached += f" of {total:.0f} MB"
        tried = str(error).strip().splitlines()[0][:160]
        advice = memory_advice(self.batch_size, self.checkpointable)
        advice = usable(advice, self.cfg, self.in_effect)
        ways = "; ".join(f"{override} ({why})" for override, why in advice)
        return RunOutOfMemoryError(
            f"Out of memory on {device} in epoch {epoch} with data.batch_size={self.batch_size} "
            f"({reached}; {tried}). The run is FAILED, what it logged is kept. Ways out: {ways}."
        )


def device_memory_mb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 2**20


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's failure (a plain RuntimeError)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate" in str(error)
    )
