"""`parallelism=model`: one process, the model cut into stages over several devices.

Stage k runs on `devices[k % len(devices)]`; with `devices: null` the stages go one per GPU over
the visible GPUs, or all on the CPU where there is none (the same code path, which is how it is
tested here). `chunks` micro-batches per batch are pipelined GPipe-style (`pipeline.py`).

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

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn as nn

from accelexp.config import ConfigError
from accelexp.parallel.base import Strategy, peak_memory_mb, resolve_device
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


class SplitModel:
    """A `Strategy` mixin: each process's model is a `Pipeline` of stages over `stage_devices()`.

    Shared by `model` (one process) and `hybrid` (one such replica per worker, synced by DDP or
    Horovod); the subclass says which devices a replica's stages run on.
    """

    cfg: object
    device: torch.device
    shape: object
    pipeline: Pipeline | None = None  # set by place()
    optimizer: torch.optim.Optimizer | None = None  # set by wrap_optimizer(), for its state

    def stage_devices(self) -> list[torch.device]:
        """Device of stage k, for every stage of this process's replica."""
        raise NotImplementedError

    def place_devices(self) -> None:
        self.devices = self.stage_devices()
        self.device = self.devices[0]  # the inputs, the labels and the outputs live here
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.shape = dataclasses.replace(self.shape, devices_per_replica=len(set(self.devices)))

    def place(self, model: nn.Module, input_shape: Sequence[int] | None = None) -> nn.Module:
        cfg, example = self.cfg, None
        if cfg.balance == "compute" and input_shape is not None:
            model.to(self.devices[0])  # timed on the first device, one micro-batch at a time
            batch, *sample = input_shape
            example = torch.randn(max(1, batch // cfg.chunks), *sample, device=self.devices[0])
        stages, self.split_points = split_layers(
            model, len(self.devices), cfg.split_points, cfg.balance, example
        )
        self.pipeline = Pipeline(model, stages, self.devices, cfg.chunks)
        return self.pipeline

    def unwrap(self, model: nn.Module) -> nn.Module:
        model = super().unwrap(model)
        return model.module if isinstance(model, Pipeline) else model

    def compile(self, model: nn.Module, mode: str) -> nn.Module:
        """Each stage compiled on its own device; the clock loop between them stays eager."""
        for stage in self.pipeline.stages:
            stage.compile(mode=mode)
        return model

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module
    ) -> torch.optim.Optimizer:
        self.optimizer = super().wrap_optimizer(optimizer, model)
        return self.optimizer

    def describe(self) -> dict[str, int | str]:
        facts = {
            **super().describe(),
            "stages": len(self.devices),
            "split_points": str(self.split_points),
        }
        pipeline = self.pipeline
        for k, (params, layers, device) in enumerate(
            zip(pipeline.stage_params(), pipeline.stage_layers(), self.devices, strict=True)
        ):
            facts |= {
                f"stage{k}_params": params,
                f"stage{k}_layers": layers,
                f"stage{k}_device": str(device),
            }
        return facts

    def reset_memory_stats(self) -> None:
        for device in set(self.devices):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        if self.pipeline is not None:
            self.pipeline.measure_saved = True

    def memory_metrics(self) -> dict[str, float]:
        metrics = super().memory_metrics()  # the process's peak RSS on a CPU
        if self.device.type == "cuda":
            peaks = [peak_memory_mb(device) for device in self.devices]
            metrics["peak_mem_mb"] = max(peaks)
        else:
            peaks = [self._held_mb(k) for k in range(len(self.devices))]
        return metrics | {f"stage{k}_peak_mem_mb": mb for k, mb in enumerate(peaks)}

    def _held_mb(self, stage: int) -> float:
        """Parameters, gradients, optimizer state and saved activations of one stage, in MiB."""
        params = list(self.pipeline.stages[stage].parameters())
        state = self.optimizer.state if self.optimizer is not None else {}
        tensors = [
            *params,
            *(p for p in params if p.requires_grad),  # each gradient is the size of its parameter
            *(v for p in params for v in state.get(p, {}).values() if torch.is_tensor(v)),
        ]
        held = sum(t.numel() * t.element_size() for t in tensors)
        return (held + self.pipeline.saved_bytes[stage]) / 2**20


class ModelParallel(SplitModel, Strategy):
    name = "model"

    def stage_devices(self) -> list[torch.device]:
        requested = self.cfg.devices
        stages = self.cfg.stages or (len(requested) if requested else 2)
        if requested is None:
            first = resolve_device(self.device_request)
            if first.type == "cpu":
                return [first] * stages
            gpus = torch.cuda.device_count()
            return [torch.device("cuda", k % gpus) for k in range(stages)]
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
