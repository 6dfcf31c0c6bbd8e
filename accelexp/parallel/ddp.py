"""`DDPSync`: replicas agree through DistributedDataParallel's gradient allreduce.

`parallelism=ddp` is one device × DDP, one process per device; `hybrid` with `sync: ddp` is
stages × DDP (DDP over a multi-device module, `device_ids=None`, as PyTorch's DDP + model-parallel
recipe does). The world is torch.distributed's (`distributed.py`). Options: SyncBatchNorm, bucket
size, static graph, gradient compression through DDP's comm hooks (fp16/bf16), and gradient
accumulation with `no_sync` on the micro-batches that only accumulate.

Communication time (on a CPU, Gloo): a comm hook around the allreduce (`TimedAllreduce`) notes when
each gradient bucket was handed to Gloo and when its allreduce finished. Per step, the union of
those intervals is the time communication was in flight, and the time from the last bucket's
hand-over (the backward's compute is done) to the last allreduce's end is what the host waited
for in the backward pass. On CUDA, NCCL's futures complete at enqueue time, so host clocks cannot
time them: DDP keeps its built-in hooks there, and `profile=true` (HTA) gives the GPU's figures.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from accelexp.parallel.config import DDPConfig
from accelexp.parallel.distributed import TorchDistributed
from accelexp.precision.runtime import Precision
from accelexp.timing import CommTime


class TimedAllreduce:
    """A DDP comm hook that runs `hook` (DDP's allreduce, or a compressing one) and times it."""

    def __init__(self, hook) -> None:
        self.hook = hook
        self.comm = CommTime()
        self.buckets: list[tuple[float, list[float]]] = []  # (handed over, [finished]) per bucket

    def as_hook(self):
        """A function for `register_comm_hook`, which reads a hook's name and signature."""
        return functools.wraps(self.hook)(lambda state, bucket: self(state, bucket))

    def __call__(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future:
        finished: list[float] = []
        self.buckets.append((time.perf_counter(), finished))

        def done(future: torch.futures.Future) -> torch.Tensor:
            finished.append(time.perf_counter())  # on the thread that completed the allreduce
            return future.value()

        return self.hook(state, bucket).then(done)

    def step_done(self) -> None:
        """After a synchronising backward pass: its buckets' times go into `comm`."""
        intervals = sorted((start, end[0]) for start, end in self.buckets if end)
        self.buckets.clear()
        if not intervals:
            return
        last_handed_over = max(start for start, _ in intervals)
        self.comm.wait("backward", max(0.0, max(end for _, end in intervals) - last_handed_over))
        inflight, reach = 0.0, float("-inf")  # the union of the intervals
        for start, end in intervals:
            inflight += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        self.comm.in_flight(inflight)


class DDPSync(TorchDistributed):
    name = "ddp"
    cfg: DDPConfig  # hybrid's HybridConfig is one

    def __init__(self, cfg: DDPConfig) -> None:
        super().__init__(cfg)
        self._timed: TimedAllreduce | None = None

    def prepare(self, model: nn.Module) -> nn.Module:
        if self.cfg.sync_batchnorm:
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return model

    def wrap(
        self, model: nn.Module, precision: Precision, compile_mode: str | None = None
    ) -> nn.Module:
        device, devices = self.device, {p.device for p in model.parameters()}
        ddp = DistributedDataParallel(
            model,
            # one GPU: its id; a CPU module or one spread over several devices: None
            device_ids=[device.index] if devices == {device} and device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            static_graph=self.cfg.static_graph,
            find_unused_parameters=self.cfg.find_unused_parameters,
        )
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {
            "none": default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook,
        }[self.cfg.comm_hook]
        if device.type == "cpu":
            self._timed = TimedAllreduce(hook)
            hook = self._timed.as_hook()
        if hook is not default_hooks.allreduce_hook:  # that one is DDP's own, built in
            ddp.register_comm_hook(state=None, hook=hook)
        return ddp

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def untraced_bytes(self, model: nn.Module) -> int:
        """The reducer's gradient buckets (C++, which fake tensors cannot run): a second copy of
        the gradients, in the parameters' dtype (gradient_as_bucket_view is off)."""
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def comm_advice(self) -> list[tuple[str, str]]:
        return [
            ("parallelism.comm_hook=fp16", "gradients sent as fp16: half the bytes to allreduce"),
            (
                f"parallelism.bucket_cap_mb={self.cfg.bucket_cap_mb / 4:g}",
                "smaller buckets start their allreduce earlier in the backward pass",
            ),
        ]

    def take_comm_time(self) -> CommTime | None:
        if self._timed is None:
            return None
        comm, self._timed.comm = self._timed.comm, CommTime()
        return comm

    @contextlib.contextmanager
    def backward_context(self, model: nn.Module, sync: bool):
        if not sync:
            with model.no_sync():
                yield
            return
        yield
        if self._timed is not None:
            self._timed.step_done()
