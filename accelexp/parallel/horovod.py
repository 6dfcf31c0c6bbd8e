"""`HorovodSync`: replicas agree through Horovod, the recipe of its PyTorch examples, complete.

`parallelism=horovod` is one device × Horovod; `hybrid` with `sync: horovod` is stages ×
Horovod (Horovod's layout for model parallelism: each worker has several GPUs and submits the
same tensors as the others).

`hvd.init()`; each worker pinned to GPU `hvd.local_rank()`; a DistributedSampler per rank;
`hvd.DistributedOptimizer(named_parameters=...)` with `compression` (none/fp16),
`backward_passes_per_step` (= `accumulate_steps`) and `op` (average/adasum); parameters (and
optimizer state, when there is any) broadcast from rank 0; metrics summed with allreduce; only
rank 0 logs and saves.

With a GradScaler (fp16 AMP on CUDA) the step follows Horovod's AMP recipe: synchronize the
gradients, unscale them, then step without a second synchronization. Horovod's allreduce and
broadcast have no bfloat16: under `precision=bf16_true` (bf16 weights, hence gradients) each bf16
tensor travels as an fp32 copy (`parallelism.compression=fp16`: as fp16) and comes back bf16;
under every other precision parameters and gradients are fp32 (autocast only changes the compute
dtype).

Communication time: Horovod's background thread allreduces each gradient as the backward pass
produces it; `optimizer.synchronize()` waits for what is left. The step calls it explicitly and
times it — the communication the host waited for (`accelexp.timing`). When the
allreduces were in flight is Horovod's own business: its timeline (`HOROVOD_TIMELINE=file.json`)
records every tensor's negotiation and allreduce.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.nn as nn

from accelexp.errors import AccelexpError
from accelexp.parallel.base import Sync
from accelexp.parallel.config import HorovodConfig
from accelexp.parallel.world import World, current_world
from accelexp.precision.runtime import Precision
from accelexp.timing import CommTime

SETUP_HINT = "Run the setup, which builds it against the installed torch: `make setup`."


def _import_horovod():
    try:
        import horovod.torch as hvd
    except ImportError as error:
        raise AccelexpError(
            f"parallelism=horovod needs Horovod, which is not importable here ({error}). "
            + SETUP_HINT
        ) from error
    return hvd


def sendable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as Horovod's collectives take it: contiguous, and fp32 where it is bf16 (Horovod
    has no bfloat16); the tensor itself when it is both already."""
    if tensor.dtype == torch.bfloat16:
        return tensor.to(torch.float32, memory_format=torch.contiguous_format)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def contiguous(compression: type) -> type:
    """Horovod's `compression`, for gradients in any memory format and in bf16.

    Horovod's allreduce takes contiguous tensors only, and a channels_last weight has a
    channels_last gradient. This compressor sends a contiguous copy and gives the result back in
    the gradient's own layout: two copies of each such gradient per step, a small cost beside
    the convolutions that channels_last speeds up. A bf16 gradient (precision=bf16_true) is sent
    as fp32, or as fp16 by the fp16 compression, and given back in bf16. Contiguous fp32
    gradients pass untouched.
    """

    class Contiguous(compression):
        @staticmethod
        def compress(tensor: torch.Tensor):
            layout = None if tensor.is_contiguous() else torch.channels_last
            if layout is not None and not tensor.is_contiguous(memory_format=layout):
                raise AccelexpError(f"Horovod cannot sync a gradient of strides {tensor.stride()}")
            sent, inner = compression.compress(tensor.contiguous())
            if sent.dtype == torch.bfloat16:  # Horovod has no bfloat16
                sent = sent.float()
            return sent, (inner, layout, tensor.dtype)

        @staticmethod
        def decompress(tensor: torch.Tensor, ctx):
            inner, layout, dtype = ctx
            result = compression.decompress(tensor, inner).to(dtype)
            return result if layout is None else result.contiguous(memory_format=layout)

    return Contiguous


class HorovodSync(Sync):
    name = "horovod"
    launcher = "horovodrun"
    cfg: HorovodConfig  # hybrid's HybridConfig is one

    def __init__(self, cfg: HorovodConfig) -> None:
        super().__init__(cfg)
        self.hvd = _import_horovod()
        self.comm = CommTime()

    def join(self) -> World:
        hvd = self.hvd
        hvd.init()  # opens the communication too: `start` has nothing more to open
        world = current_world()
        if world.world_size != hvd.size():  # e.g. srun tasks of a Gloo-only Horovod
            raise AccelexpError(
                f"{world.source} started {world.world_size} processes, but Horovod formed a world "
                f"of {hvd.size()}: this Horovod cannot join a {world.source} world (that "
                f"needs an MPI build). Start the job with horovodrun instead, e.g. inside the "
                f"allocation: horovodrun -np {world.world_size} -H <hosts> python run.py ..."
            )
        return replace(
            world,
            rank=hvd.rank(),
            world_size=hvd.size(),
            local_rank=hvd.local_rank(),
            local_size=hvd.local_size(),
        )

    def leave(self) -> None:
        self.hvd.shutdown()

    def lr_factor(self, samples_factor: int, rule: str) -> float:
        # Adasum adapts the combined step itself: Horovod's examples do not scale its lr by size
        return 1 if self.cfg.op == "adasum" else super().lr_factor(samples_factor, rule)

    def wrap(
        self, model: nn.Module, precision: Precision, compile_mode: str | None = None
    ) -> nn.Module:
        state = model.state_dict()
        # Horovod sends contiguous tensors only: channels_last weights travel as NCHW copies,
        # bf16 ones (precision=bf16_true) as fp32 copies
        sent = {k: sendable(t) for k, t in state.items()}
        self.hvd.broadcast_parameters(sent, root_rank=0)
        for name, tensor in state.items():
            if sent[name] is not tensor:
                tensor.copy_(sent[name])
        return model

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, accumulate_steps: int
    ) -> torch.optim.Optimizer:
        hvd = self.hvd
        if optimizer.state_dict()["state"]:
            # A fresh optimizer is identical on every rank by construction. Horovod's broadcast
            # would first initialise its state with a zero-gradient step, which under weight
            # decay moves the weights (and starts AdamW's bias correction a step late): done for
            # an optimizer that carries state only, e.g. one restored from a checkpoint.
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=contiguous(
                hvd.Compression.fp16 if self.cfg.compression == "fp16" else hvd.Compression.none
            ),
            backward_passes_per_step=accumulate_steps,
            op=hvd.Adasum if self.cfg.op == "adasum" else hvd.Average,
        )

    def optimizer_step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        # what DistributedOptimizer.step() does, with the wait timed
        start = time.perf_counter()
        optimizer.synchronize()
        self.comm.wait("optimizer", time.perf_counter() - start)
        precision.unscale_(optimizer)  # Horovod's AMP order: synchronize, unscale, step
        with optimizer.skip_synchronize():
            precision.step(optimizer)

    def comm_advice(self) -> list[tuple[str, str]]:
        return [
            ("parallelism.compression=fp16", "gradients sent as fp16: half the bytes to allreduce")
        ]

    def take_comm_time(self) -> CommTime | None:
        comm, self.comm = self.comm, CommTime()
        return comm

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(tensor, op=self.hvd.Max)

    def barrier(self) -> None:
        self.hvd.barrier()

    # named: Horovod matches collectives across ranks by name, and its default name is the
    # object's type, which differs where only rank 0 has the object
    def broadcast_object(self, obj: object) -> object:
        return self.hvd.broadcast_object(obj, root_rank=0, name="accelexp.broadcast_object")

    def gather_object(self, obj: object) -> list:
        return self.hvd.allgather_object(obj, name="accelexp.gather_object")
