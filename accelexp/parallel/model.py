"""The `Stages` placement: a replica's model cut into stages over several devices.

`parallelism=model` is stages × no sync (one process); `parallelism=hybrid` is stages × DDP or
Horovod (one replica per worker). Stage k runs on `devices[k % len(devices)]`; with `devices:
null` the stages go one per GPU over this replica's GPUs (all visible GPUs for `model`; local
rank r of `hybrid` takes GPUs r*D .. r*D+D-1, D = `devices_per_replica`), or all on the CPU
where there is none (the same code path, which is how it is tested here). `chunks`
micro-batches per batch are pipelined GPipe-style (`pipeline.py`).

Precision needs nothing special: every stage runs inside the loop's autocast context, which
applies to all devices of its type in this thread (so all stages must be of one device type),
and the one GradScaler unscales and checks the gradients of every stage's parameters, device by
device. Per stage, the parameters are logged (`stage{k}_params`, `stage{k}_layers`,
`stage{k}_device`) and, each epoch, the peak memory (`stage{k}_peak_mem_mb`): on CUDA the
allocator's peak on the stage's device (stages sharing a device report that device's peak); on a
CPU, where all stages share one memory, the bytes the stage holds at its peak: parameters, their
gradients, optimizer state, and the activations it saved for the backward pass of all its
micro-batches, counted by a saved-tensors hook on the epoch's first step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from accelexp import record
from accelexp.errors import ConfigError
from accelexp.parallel.base import Placement, peak_memory_mb, resolve_device, state_bytes
from accelexp.parallel.config import HybridConfig, ModelParallelConfig
from accelexp.parallel.pipeline import Pipeline, split_layers


def parse_devices(requested: Sequence[str]) -> list[torch.device]:
    """The requested devices, each checked against what this machine has."""
    devices = []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for name in requested:
        try:
            device = torch.device(name)
        except RuntimeError as error:
            raise ConfigError(
                f"parallelism.devices has {name!r}, which is not a device name ({error}). "
                f"Use names like cpu, cuda:0, cuda:1."
            ) from error
        if device.type == "cuda":
            device = torch.device("cuda", device.index or 0)
            if device.index >= gpus:
                have = f"cuda:0..cuda:{gpus - 1}" if gpus else "none"
                raise ConfigError(
                    f"parallelism.devices asks for {name}, but this machine has {gpus} CUDA "
                    f"GPU(s) ({have}). List devices that exist, or leave parallelism.devices "
                    f"null to use the GPUs there are (or the CPU)."
                )
        elif device.type != "cpu":
            raise ConfigError(
                f"parallelism.devices has {name!r}: only cpu and cuda:N devices are supported."
            )
        devices.append(device)
    if len({device.type for device in devices}) > 1:
        raise ConfigError(
            f"parallelism.devices={list(requested)} mixes CPU and CUDA: put every stage on the "
            f"same kind of device (autocast and loss scaling work per device type)."
        )
    return devices


class Stages(Placement):
    """Each replica's model is a `Pipeline` of stages over this worker's devices. Its config:
    `model`'s (`devices`) or `hybrid`'s (`devices_per_replica`), each key the other lacks read
    with a default."""

    cfg: ModelParallelConfig | HybridConfig
    name = "stages"
    replicated_as = "hybrid"
    pipeline: Pipeline | None = None  # set by place()

    @classmethod
    def devices_per_worker(cls, cfg: ModelParallelConfig | HybridConfig) -> int:
        return getattr(cfg, "devices_per_replica", None) or 1

    @classmethod
    def label(cls, cfg: ModelParallelConfig | HybridConfig) -> dict[str, str]:
        stages = cfg.stages or getattr(cfg, "devices_per_replica", None) or ""
        return {"parallelism.chunks": f"s{stages}c{cfg.chunks}"}

    def choose_devices(self, local_rank: int) -> list[torch.device]:
        cfg = self.cfg
        requested = getattr(cfg, "devices", None)
        per_replica = getattr(cfg, "devices_per_replica", None)
        stages = cfg.stages or (len(requested) if requested else per_replica or 2)
        if requested:
            self.devices = self._listed(requested, stages)
            return self.devices
        if resolve_device(self.device_request).type == "cpu":
            self.devices = [torch.device("cpu")] * stages
            return self.devices
        gpus = torch.cuda.device_count()
        per_replica = per_replica or gpus
        first = local_rank * per_replica if getattr(cfg, "devices_per_replica", None) else 0
        if first + per_replica > gpus:
            raise ConfigError(
                f"replica {local_rank} on this machine needs GPUs {first}..."
                f"{first + per_replica - 1} (parallelism.devices_per_replica={per_replica}), but "
                f"the machine has {gpus}. Start at most {gpus // per_replica} replicas per machine "
                f"(parallelism.nprocs), or lower parallelism.devices_per_replica."
            )
        self.devices = [torch.device("cuda", first + k % per_replica) for k in range(stages)]
        return self.devices

    def _listed(self, requested: Sequence[str], stages: int) -> list[torch.device]:
        if len(requested) > stages:
            raise ConfigError(
                f"parallelism.devices lists {len(requested)} devices for parallelism.stages="
                f"{stages}: the extra devices would sit idle. Set parallelism.stages="
                f"{len(requested)}, or list fewer devices."
            )
        devices = parse_devices(requested)
        if self.device_request == "cpu" and devices[0].type != "cpu":
            raise ConfigError(
                f"device=cpu, but parallelism.devices={list(requested)}: drop one or the other."
            )
        return [devices[k % len(devices)] for k in range(stages)]

    def place(self, model: nn.Module, input_shape: Sequence[int] | None = None) -> nn.Module:
        cfg, example = self.cfg, None
        if cfg.balance == "compute" and input_shape is not None:
            model.to(self.devices[0])  # timed on the first device, one micro-batch at a time
            batch, *sample = input_shape
            # in the dtype of the first layer's weights (bf16 under precision=bf16_true)
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
            example = torch.randn(
                max(1, batch // cfg.chunks), *sample, device=self.devices[0], dtype=dtype
            )
        stages, self.split_points = split_layers(
            model, len(self.devices), cfg.split_points, cfg.balance, example
        )
        self.pipeline = Pipeline(model, stages, self.devices, cfg.chunks)
        return self.pipeline

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, Pipeline) else model

    def compile(self, model: nn.Module, mode: str) -> nn.Module:
        """Each stage compiled on its own device; the clock loop between them stays eager."""
        for stage in self.pipeline.stages:
            stage.compile(mode=mode)
        return model

    def describe(self) -> dict[str, int | str]:
        facts: dict[str, int | str] = {
            record.STAGES: len(self.devices),
            record.SPLIT_POINTS: str(self.split_points),
        }
        pipeline = self.pipeline
        for k, (params, layers, device) in enumerate(
            zip(pipeline.stage_params(), pipeline.stage_layers(), self.devices, strict=True)
        ):
            facts |= {
                record.stage_fact(k, "params"): params,
                record.stage_fact(k, "layers"): layers,
                record.stage_fact(k, "device"): str(device),
            }
        return facts

    def reset_memory_stats(self) -> None:
        super().reset_memory_stats()
        if self.pipeline is not None:
            self.pipeline.measure_saved = True

    def memory_metrics(self, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
        metrics = super().memory_metrics(optimizer)  # the busiest GPU, or the process's peak RSS
        if self.devices[0].type == "cuda":
            peaks = [peak_memory_mb(device) for device in self.devices]
        else:
            peaks = [self._held_mb(k, optimizer) for k in range(len(self.devices))]
        return metrics | {record.stage_peak_mem_mb(k): mb for k, mb in enumerate(peaks)}

    def _held_mb(self, stage: int, optimizer: torch.optim.Optimizer | None) -> float:
        """Parameters, gradients, optimizer state and saved activations of one stage, in MiB."""
        params = list(self.pipeline.stages[stage].parameters())
        held = state_bytes(params, optimizer)
        return (held + self.pipeline.saved_bytes[stage]) / 2**20
