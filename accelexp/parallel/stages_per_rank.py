"""The `RankStages` placement: a pipeline's stages across ranks (`torch.distributed.pipelining`).

`parallelism=pipeline` is stages per rank × `p2p` (`StageLinks`): `nprocs` processes, started
and joined as DDP's are (torchrun; a torchrun or srun world), form pipelines of `parallelism.pp`
ranks (null: one of all of them). The world is a 2-D mesh (torchtitan's `pp` x `dp`, a
`DeviceMesh`; world rank = pipeline rank * replicas + replica, as `WorldShape` numbers it): each
pipeline is a data-parallel replica on its shard of the data, and each stage's gradients are
averaged over the ranks holding that stage (the dp dimension: one flat allreduce after the
schedule's step, DDP's average without its overlap). With `parallelism.dp_shard` each stage is
sharded over the dp dimension instead (FSDP2, `StageLinks.wrap`: torchtitan's pp x fsdp): each
rank holds 1/dp of its stages' parameters, gradients and optimizer state, gathers them for the
step, and `PipelineStage` reduce-scatters the gradients after the step's last backward (DDP
inside a `PipelineStage` fails on torch 2.14: its reducer asserts at the second step). The
model's layer sequence
(`accelexp.models.layer_sequence`) is cut into as many stages as a pipeline has ranks (two per
rank under an interleaved schedule), balanced by parameter count as `parallelism=model` cuts it
(`pipeline.split_layers`); pipeline rank p keeps stage p (interleaved: stages p and p + pp, the
"loop" order torch's interleaved schedules expect) and drops the rest. Activations go forward and
their gradients back with point-to-point sends, in the order of the schedule
`parallelism.schedule` names (`SCHEDULES`: those of the installed torch), each batch cut into
`parallelism.microbatches` micro-batches.

What the loop sees does not change: the step's forward and backward passes are this placement's
`forward_backward`, which runs `schedule.step` (the schedule owns both passes, so the step clock
times them as one: the backward phase); the loss (the mean of the micro-batches', computed in fp32
on the last stage) and the logits are sent from the last stage to every rank, so each rank holds
its replica's figures and rank 0 logs the truth. Evaluation calls the placed model
(`RankPipeline.forward`): the whole batch goes through the stages in turn, no micro-batches.
Gradients are the mean over micro-batches (`scale_grads`): a step trains what one process trains
on the whole batch, BatchNorm aside (it normalises each micro-batch, as in GPipe).

Checkpoints: `last.pt`'s model and optimizer are sharded (`StageLinks.checkpoint_sharded`):
each rank writes its stages' states with torch.distributed.checkpoint, keyed by the whole
model's parameter names (`RankPipeline.fqns`; the optimizer's flattened by parameter), so a
pipeline of another depth or sharding, or one process with the plain model, reads them back; a
replica's copy is written once (the lowest rank's: the first pipeline's), a sharded stage's
shards by their ranks. `best.pt` is the whole model gathered on rank 0 (`whole_state`: a
sharded stage's shards gathered first, then the first pipeline's ranks send theirs to rank 0
alone, `gather_object`; it loads anywhere), and each rank takes its own layers back from it (its
shard of them: `StageLinks.load_model_state_dict`); a `last.pt`
written gathered before keeps the optimizer's state per pipeline rank (`{"ranks": [...]}`),
which a resume of the same pipeline depth reads.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from accelexp import record
from accelexp.errors import ConfigError
from accelexp.models import layer_sequence
from accelexp.parallel.base import Placement, Strategy, Sync, peak_memory_mb, resolve_device
from accelexp.parallel.config import PIPELINE_SCHEDULES, PipelineConfig
from accelexp.parallel.distributed import TorchDistributed
from accelexp.parallel.pipeline import split_layers
from accelexp.parallel.world import World, WorldShape
from accelexp.precision.runtime import Precision
from accelexp.timing import BACKWARD, FORWARD

# parallelism.schedule -> the class of torch.distributed.pipelining that runs it
_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
}
assert set(_CLASSES) == set(PIPELINE_SCHEDULES), "schedules without a class"


def available_schedules() -> dict[str, type]:
    """The schedules the installed torch has, by `parallelism.schedule` name."""
    try:
        pipelining = importlib.import_module("torch.distributed.pipelining")
    except ImportError:
        return {}
    return {
        name: getattr(pipelining, cls) for name, cls in _CLASSES.items() if hasattr(pipelining, cls)
    }


def _schedule_class(name: str) -> type:
    schedules = available_schedules()
    if name not in schedules:
        raise ConfigError(
            f"parallelism.schedule={name} is not in this torch ({torch.__version__}), which has "
            f"{', '.join(schedules) or 'no torch.distributed.pipelining'}."
        )
    return schedules[name]


def _flat_options():
    """The optimizer's state dict flattened by parameter (`state.<fqn>.<entry>`,
    `param_groups.<fqn>.<entry>`): each pipeline rank holds other parameters, so its
    param_groups differ from the other ranks', and only keys by parameter name let DCP merge
    them and reshard them for another cut."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _renamed(state: dict, names: dict[str, str], flat_optimizer: bool) -> dict:
    """`state` (the same values) with each parameter's name replaced by `names[name]`: a model's
    keys are the names; a flattened optimizer's are `<section>.<name>.<entry>`."""
    if not flat_optimizer:
        return {names[k]: v for k, v in state.items()}
    renamed = {}
    for key, value in state.items():
        section, rest = key.split(".", 1)
        name, entry = rest.rsplit(".", 1)
        renamed[f"{section}.{names[name]}.{entry}"] = value
    return renamed


class StageLinks(TorchDistributed):
    """The sync of a pipeline across ranks: torch.distributed's world (the launcher, Gloo or
    NCCL, the collectives the loop sums its figures with); within a replica every parameter is
    on one rank, so nothing to agree on: the activations travel by the placement's schedule.
    Over the replicas, each stage is sharded by FSDP2 (`dp_shard`: `wrap`), or its gradients
    averaged by the placement (`RankStages.average_over_replicas`).

    Checkpoints are sharded (`checkpoint_sharded`): each rank's stages' weights and optimizer
    state, keyed by the whole model's parameter names (`RankPipeline.fqns`), each rank writing
    its own through torch.distributed.checkpoint; the replicas' identical copies are written once
    (DCP keeps each key of the lowest rank holding it: the first pipeline's, as `best.pt`)."""

    name = "p2p"
    cfg: PipelineConfig
    checkpoint_sharded = True

    def wrap(
        self, model: nn.Module, precision: Precision, compile_mode: str | None = None
    ) -> nn.Module:
        """`parallelism.dp_shard`: each of this rank's stages (`model`: the `RankPipeline`)
        sharded over the dp dimension by FSDP2, as torchtitan composes pp with fsdp: each layer
        of a stage that holds parameters an FSDP unit, then the stage itself (the root, which
        `PipelineStage` drives: it skips the reduce-scatter of each micro-batch's backward but
        the step's last). Gathered parameters stay to the backward (`reshard_after_forward`
        false, torchtitan's choice under pp: else each micro-batch gathers them twice); the
        step's end frees them. Without replicas (`parallelism.pp` = nprocs) nothing to shard."""
        precision.agree_on_overflow()  # fp16's GradScaler: every stage skips the same steps
        if self.cfg.dp_shard and model.dp_mesh is not None:
            from accelexp.parallel.fsdp import shard_units

            for part in model.parts:
                layers = [m for m in part.children() if any(True for _ in m.parameters())]
                shard_units(layers, part, model.dp_mesh, precision, reshard_after_forward=False)
            model.sharded = True
        return model

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's stages' weights, whole: a stage sharded over dp (`dp_shard`) gathered
        from its shards (collective over the dp dimension)."""
        from torch.distributed.tensor import DTensor

        return {
            k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in model.state_dict().items()
        }

    def load_model_state_dict(self, model: nn.Module, state: dict | None) -> None:
        """Whole weights of this rank's stages into them (a stage sharded over dp takes its
        shard of each)."""
        if not model.sharded:
            model.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def sharded_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """This rank's stages' states by the whole model's names (`model`: the `RankPipeline`);
        the optimizer's flattened by parameter (`state.<name>.<entry>`)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer, options=_flat_options())
        return {
            "model": _renamed(model_state, model.fqns, flat_optimizer=False),
            "optimizer": _renamed(optimizer_state, model.fqns, flat_optimizer=True),
        }

    def load_sharded_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        own = {whole: mine for mine, whole in model.fqns.items()}
        set_state_dict(
            model,
            optimizer,
            model_state_dict=_renamed(state["model"], own, flat_optimizer=False),
            optim_state_dict=_renamed(state["optimizer"], own, flat_optimizer=True),
            options=_flat_options(),
        )


# dtypes a tensor sent between stages may have (its header says which)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
_HEADER = 8  # ints: dims, sizes..., dtype


def _header(tensor: torch.Tensor) -> torch.Tensor:
    shape = list(tensor.shape)
    values = [len(shape), *shape] + [0] * (_HEADER - 2 - len(shape)) + [_DTYPES.index(tensor.dtype)]
    return torch.tensor(values, dtype=torch.int64, device=tensor.device)


def _empty_from(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    values = header.tolist()
    return torch.empty(values[1 : 1 + values[0]], dtype=_DTYPES[values[-1]], device=device)


class RankPipeline(nn.Module):
    """This rank's stages (`parts`, the model's own layers), and the forward pass of the whole
    pipeline across ranks: the placed model the loop evaluates with."""

    def __init__(
        self,
        parts: Sequence[nn.Module],
        indices: Sequence[int],
        stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        global_ranks: Sequence[int],
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.indices = list(indices)  # the global index of each part
        self.stages = stages
        self.device = device
        self.group = group  # this pipeline's ranks (the mesh's pp dimension)
        self.global_ranks = list(global_ranks)  # pipeline rank -> world rank
        self.ranks = len(self.global_ranks)
        self.rank = self.global_ranks.index(dist.get_rank())
        self.fqns: dict[str, str] = {}  # this module's parameter names -> the whole model's
        self.dp_mesh = None  # the ranks holding the same stages (the mesh's dp dimension)
        self.sharded = False  # its stages sharded over them by FSDP2 (`StageLinks.wrap`)

    def owner(self, stage: int) -> int:
        """The pipeline rank holding `stage`."""
        return stage % self.ranks

    @property
    def last_rank(self) -> int:
        return self.owner(self.stages - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of batch `x` on every rank: stage after stage, each on its rank, the whole
        batch at once (evaluation; training goes through the schedule)."""
        parts = dict(zip(self.indices, self.parts, strict=True))
        h: torch.Tensor | None = x
        for stage in range(self.stages):
            if self.owner(stage) != self.rank:
                continue
            if stage > 0 and self.owner(stage - 1) != self.rank:
                h = self._recv(self.global_ranks[self.owner(stage - 1)])
            h = parts[stage](h)
            if stage + 1 < self.stages and self.owner(stage + 1) != self.rank:
                to = self.global_ranks[self.owner(stage + 1)]
                dist.send(_header(h), to)
                dist.send(h.contiguous(), to)
        return self.share(h if self.rank == self.last_rank else None)

    def _recv(self, source: int) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, source)
        tensor = _empty_from(header, self.device)
        dist.recv(tensor, source)
        return tensor

    def share(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """The last stage's `tensor` on every rank of this pipeline (None on the others)."""
        source = self.global_ranks[self.last_rank]
        header = (
            _header(tensor)
            if tensor is not None
            else torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        )
        dist.broadcast(header, source, group=self.group)
        if tensor is None:
            tensor = _empty_from(header, self.device)
        else:
            tensor = tensor.detach().contiguous()
        dist.broadcast(tensor, source, group=self.group)
        return tensor


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss, in fp32 whatever the logits' dtype (as `train_step`'s)."""
    return F.cross_entropy(logits.float(), labels)


def _on_cpu(value):
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


# an action of a schedule on one rank: (F, B, I or W, stage, micro-batch)
Action = tuple[str, int, int]


def _held_orders(schedule) -> dict[int, list[Action]] | None:
    """The compute actions of each pipeline rank, in order, from torch's schedule
    (`pipeline_order`, which multi-stage schedules have, and single-stage ones in recent torch);
    None when this torch's schedule does not say."""
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        return None
    orders: dict[int, list[Action]] = {}
    for rank, actions in order.items():
        kept = []
        for action in actions:
            kind = getattr(getattr(action, "computation_type", None), "value", None)
            if kind in ("F", "B", "I", "W"):
                kept.append((kind, action.stage_index, action.microbatch_index))
        orders[rank] = kept
    return orders


def in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batches whose activations one rank holds at once: forwards run and not yet
    backward (a full backward B, or the weights' W of a split one, frees them)."""
    held = most = 0
    for kind, _, _ in actions:
        if kind == "F":
            held += 1
            most = max(most, held)
        elif kind in ("B", "W"):
            held -= 1
    return most


class _Once(nn.Module):
    """A stage called through a module of its own each time: MemTracker (the forecast's) takes
    a root module called twice for the next step, and refuses it."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.stage(h)


class PipelinePlan:
    """What the memory forecast (`accelexp.forecast`) needs of a pipeline across ranks: every
    stage of the cut, which pipeline rank holds it, and each rank's actions in the schedule's
    order (`orders`; `derived`: read from torch's schedule, else GPipe's order, all
    micro-batches in flight, an upper bound). `replay` runs one rank's actions in this process
    without any communication: what that rank computes and keeps, the sends and receives aside
    (their persistent buffers are `recv_bytes`)."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        ranks: int,
        microbatches: int,
        orders: dict[int, list[Action]],
        derived: bool,
    ) -> None:
        self.stages = list(stages)
        self.ranks = ranks
        self.microbatches = microbatches
        self.orders = orders
        self.derived = derived

    def mine(self, rank: int) -> list[int]:
        return [k for k in range(len(self.stages)) if k % self.ranks == rank]

    def in_flight(self, rank: int) -> int:
        return in_flight(self.orders[rank])

    def input_shapes(self, images: torch.Tensor, precision) -> list[torch.Size]:
        """Each stage's input shape for one micro-batch `images` (and the last stage's output
        shape at the end)."""
        shapes = []
        with torch.no_grad(), precision.autocast():
            h = precision.cast_inputs(images)
            for stage in self.stages:
                shapes.append((h.shape, h.dtype))
                h = stage(h)
            shapes.append((h.shape, h.dtype))
        return shapes

    def recv_buffers(self, rank: int, shapes: list) -> dict[tuple[str, int, int], torch.Tensor]:
        """The receive buffers a rank's `PipelineStage`s keep through every step, one per
        micro-batch: an input for each stage but the first ("in"), a gradient of its output for
        each stage but the last ("grad"); torch allocates them at the schedule's first step."""
        buffers = {}
        last = len(self.stages) - 1
        device = next(iter(self.stages[0].parameters())).device
        for k in self.mine(rank):
            for what, (shape, dtype) in [("in", shapes[k])] * (k > 0) + [
                ("grad", shapes[k + 1])
            ] * (k < last):
                for mb in range(self.microbatches):
                    buffers[(what, k, mb)] = torch.empty(shape, dtype=dtype, device=device)
        return buffers

    def replay(
        self,
        rank: int,
        images: torch.Tensor,
        labels: torch.Tensor,
        precision,
        buffers: dict[tuple[str, int, int], torch.Tensor],
    ) -> None:
        """One step's forward and backward passes of `rank`'s stages in the schedule's order,
        every micro-batch like `images` (one micro-batch), a stage's input and its output's
        gradient read from its receive `buffers` (`recv_buffers`), the loss as the
        placement's (`_loss`, the micro-batches' mean), and the last stage's logits kept to the
        step's end as the schedule keeps them."""
        last = len(self.stages) - 1
        held: dict[int, list[tuple]] = {k: [] for k in self.mine(rank)}  # in forward order
        logits = []
        for kind, k, mb in self.orders[rank]:
            if kind == "F":
                x = None
                if k == 0:
                    h = precision.cast_inputs(images)
                else:
                    h = x = buffers[("in", k, mb % self.microbatches)].detach().requires_grad_()
                call = _Once(self.stages[k])
                with precision.autocast():
                    out = call(h)
                    if k == last:
                        logits.append(out.detach())
                        out = _loss(out, labels) / self.microbatches
                held[k].append((out, x, call, mb))
            elif kind in ("B", "W"):
                # the stage's oldest (torch's 1F1B order numbers the micro-batches of ranks
                # but the first one ahead: the count is what holds memory)
                out, x, call, mb = held[k].pop(0)
                grad = None if k == last else buffers[("grad", k, mb % self.microbatches)]
                out.backward(grad)
                del out, x, call  # its input's gradient is sent, and dropped
            # I (a split backward's input gradients): the activations stay held until W


class RankStages(Placement):
    """This rank's stages of one pipeline over the world's ranks, run by a schedule."""

    cfg: PipelineConfig
    name = "stages per rank"
    replicated_as = "pipeline"
    stages_across_ranks = True
    pipeline: RankPipeline | None = None  # set by place()

    def __init__(self, cfg: PipelineConfig, device_request: str = "auto") -> None:
        super().__init__(cfg, device_request)
        self.schedule_class = _schedule_class(cfg.schedule)
        self.per_rank = PIPELINE_SCHEDULES[cfg.schedule]
        self.shape = WorldShape()
        self.schedule = None
        self.pp_group: dist.ProcessGroup | None = None  # this rank's pipeline (set by start)
        self.dp_group: dist.ProcessGroup | None = None  # the ranks holding its stages (dp > 1)
        self.dp_mesh = None  # the same ranks as a 1-D DeviceMesh (FSDP2's, `dp_shard`)
        self.stages: list = []
        self.split_points: list[int] = []
        self.spans: list[str] = []
        self.stage_params: list[int] = []
        self.names: dict[str, str] = {}  # this rank's state-dict keys -> the whole model's
        self.whole_keys: list[str] = []  # the whole model's, in its order

    @classmethod
    def label(cls, cfg: PipelineConfig) -> dict[str, str]:
        pp = getattr(cfg, "pp", None)
        return (
            ({"parallelism.pp": f"pp{pp}"} if pp else {})
            | ({"parallelism.dp_shard": "fsdp"} if getattr(cfg, "dp_shard", False) else {})
            | {"parallelism.schedule": f"{cfg.schedule}-m{cfg.microbatches}"}
        )

    def choose_devices(self, local_rank: int) -> list[torch.device]:
        self.devices = [resolve_device(self.device_request, local_rank)]
        return self.devices

    def ranks_per_replica(self, world: World) -> int:
        """`parallelism.pp` ranks per pipeline (null: the whole world, one pipeline)."""
        return self.cfg.pp or world.world_size

    def start(self, shape: WorldShape) -> None:
        """The world as a 2-D mesh, pp (outer) x dp (inner), as `WorldShape` numbers it (rank
        = pipeline rank * replicas + replica): this rank's pipeline is its pp group, the ranks
        holding the same stages its dp group."""
        if shape.ranks_per_replica < 2:
            raise ConfigError(
                "parallelism=pipeline needs at least 2 ranks per pipeline (parallelism.nprocs=2, "
                "or parallelism.pp=2): one process is parallelism=model."
            )
        self.shape = shape
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            self.devices[0].type,
            (shape.ranks_per_replica, shape.replicas),
            mesh_dim_names=("pp", "dp"),
        )
        self.pp_group = mesh.get_group("pp")
        self.dp_group = mesh.get_group("dp") if shape.replicas > 1 else None
        self.dp_mesh = mesh["dp"] if shape.replicas > 1 else None

    # --- the model cut and placed -------------------------------------------------------------
    def place(self, model: nn.Module, input_shape: Sequence[int] | None = None) -> nn.Module:
        ranks, rank, device = self.shape.ranks_per_replica, self.shape.stage, self.devices[0]
        count = ranks * self.per_rank
        layers = [name for name, _ in layer_sequence(model)]
        if count > len(layers):
            other = (
                ", or a schedule of one stage per rank (gpipe, 1f1b)" if self.per_rank > 1 else ""
            )
            said = f"parallelism.pp={ranks}" if self.cfg.pp else f"parallelism.nprocs={ranks}"
            raise ConfigError(
                f"{said} with parallelism.schedule={self.cfg.schedule} cuts "
                f"{type(model).__name__} into {count} stages ({self.per_rank} per rank), but it "
                f"has only {len(layers)} layers to split ({', '.join(layers)}): use at most "
                f"{len(layers) // self.per_rank} ranks{other}."
            )
        parts, self.split_points = split_layers(model, count)
        self.spans = [part.span for part in parts]
        self.stage_params = [sum(p.numel() for p in part.parameters()) for part in parts]
        mine = [k for k in range(count) if k % ranks == rank]
        for k in mine:
            if k > 0:  # its input arrives as a leaf: an in-place first op would write into it
                for module in next(iter(parts[k].children())).modules():
                    if getattr(module, "inplace", False):
                        module.inplace = False
        replicas, replica = self.shape.replicas, self.shape.replica
        pipeline = RankPipeline(
            [parts[k] for k in mine],
            mine,
            count,
            device,
            self.pp_group,
            [p * replicas + replica for p in range(ranks)],
        )
        pipeline.dp_mesh = self.dp_mesh
        whole = model.state_dict(keep_vars=True)
        key_of = {id(t): name for name, t in whole.items()}
        self.whole_keys = list(whole)
        self.names = {
            name: key_of[id(t)] for name, t in pipeline.state_dict(keep_vars=True).items()
        }
        pipeline.fqns = self.names
        pipeline.to(device)
        self.pipeline = pipeline
        return pipeline

    def _build_schedule(self, precision: Precision) -> None:
        """The schedule over this rank's stages; its loss is `_loss`, scaled by the run's
        GradScaler under fp16 (`Precision.agree_on_overflow`: every rank skips the same
        steps)."""
        from torch.distributed.pipelining import PipelineStage

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loss = _loss(logits, labels)
            return precision.scaler.scale(loss) if precision.scaler else loss

        pipeline, device = self.pipeline, self.devices[0]
        stages = [
            PipelineStage(part, k, pipeline.stages, device, group=self.pp_group)
            for k, part in zip(pipeline.indices, pipeline.parts, strict=True)
        ]
        self.stages = stages  # torch's PipelineStage of each of this rank's stages
        multi = self.per_rank > 1
        try:
            self.schedule = self.schedule_class(
                stages if multi else stages[0], self.cfg.microbatches, loss_fn=loss_fn
            )
        except (ValueError, AssertionError) as error:
            raise ConfigError(
                f"parallelism.schedule={self.cfg.schedule} with parallelism.microbatches="
                f"{self.cfg.microbatches} over {self.shape.ranks_per_replica} ranks: {error}"
            ) from error

    # --- what the memory forecast needs ---------------------------------------------------------
    def pipeline_plan(self, model: nn.Module) -> PipelinePlan:
        """`model` (the whole, on the forecast's fake tensors) cut as `place` cuts it, and each
        pipeline rank's actions in the order of torch's schedule (built in this process's
        world, the forecast's fake one, on stand-in stages: only its order is read). Stages
        sharded over the replicas (`dp_shard`) are not modelled: refused."""
        from torch.distributed.pipelining import PipelineStage

        if self.cfg.dp_shard:
            raise ConfigError(
                "the memory forecast does not model a pipeline's stages sharded over its "
                "replicas (parallelism.dp_shard=true): forecast the run with "
                "parallelism.dp_shard=false, whose parameters, gradients and optimizer state are "
                "each replica's whole, an upper bound; the run itself logs each rank's peak "
                "(stage<r>_peak_mem_mb)."
            )
        ranks, count = self.shape.ranks_per_replica, self.shape.ranks_per_replica * self.per_rank
        parts, _ = split_layers(model, count)
        micro = self.cfg.microbatches
        stand_ins = [
            PipelineStage(nn.Identity(), k, count, self.devices[0], group=self.pp_group)
            for k in range(count)
            if k % ranks == self.shape.stage
        ]
        try:
            schedule = self.schedule_class(
                stand_ins if self.per_rank > 1 else stand_ins[0], micro, loss_fn=_loss
            )
        except (ValueError, AssertionError) as error:
            raise ConfigError(
                f"parallelism.schedule={self.cfg.schedule} with parallelism.microbatches="
                f"{micro} over {ranks} ranks: {error}"
            ) from error
        orders = _held_orders(schedule)
        if orders is not None:
            return PipelinePlan(parts, ranks, micro, orders, derived=True)
        gpipe = {  # all of a rank's forwards, then all its backwards: the most held
            r: [("F", k, mb) for k in range(r, count, ranks) for mb in range(micro)]
            + [("B", k, mb) for k in reversed(range(r, count, ranks)) for mb in range(micro)]
            for r in range(ranks)
        }
        return PipelinePlan(parts, ranks, micro, gpipe, derived=False)

    # --- the step ------------------------------------------------------------------------------
    def forward_backward(
        self,
        strategy: Strategy,
        model: nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        accumulate: int,
        sync: bool,
        clock,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The schedule's step: every micro-batch's forward and backward pass in its order."""
        precision = strategy.precision
        if self.schedule is None:
            self._build_schedule(precision)
        pipeline = self.pipeline
        clock.mark(FORWARD)  # the schedule runs both passes: the step clock times them as one
        first, last = 0 in pipeline.indices, pipeline.stages - 1 in pipeline.indices
        inputs = (precision.cast_inputs(images),) if first else ()
        losses: list[torch.Tensor] = []
        with precision.autocast():
            logits = self.schedule.step(
                *inputs, target=labels if last else None, losses=losses if last else None
            )
        figures = None
        if last:  # the loss and the logits, in one message to the other ranks
            loss = torch.stack([loss.detach() for loss in losses]).mean()
            if precision.scaler is not None:  # the losses the schedule saw were scaled
                loss = loss / precision.scaler.get_scale()
            figures = torch.cat([loss.view(1), logits.detach().float().flatten()])
        figures = pipeline.share(figures)
        if not pipeline.sharded:  # FSDP2 reduce-scattered them at the schedule's last backward
            self.average_over_replicas(self.pipeline.parameters())
        clock.mark(BACKWARD)
        return figures[0], figures[1:].view(len(labels), -1)

    def average_over_replicas(self, parameters) -> None:
        """Data parallelism over the mesh's dp dimension: each of this rank's gradients
        averaged with those of the ranks holding the same stages (the other pipelines), in one
        flat allreduce once the schedule's step has made them all (DDP's average, not
        overlapped with the backward pass)."""
        if self.dp_group is None:
            return
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.shape.replicas
        for grad, mean in zip(
            grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
        ):
            grad.copy_(mean)

    # --- the whole model's state, on rank 0 -----------------------------------------------------
    def _gather_on_main(self, part: object) -> list:
        """The first pipeline's `part` of each of its ranks, by pipeline rank, on rank 0 ([]
        elsewhere; the other pipelines hold the same): collective, every rank calls it."""
        shape = self.shape
        mine = (shape.stage, part) if shape.replica == 0 else None
        gathered: list | None = [None] * shape.processes if shape.is_main else None
        dist.gather_object(mine, gathered, dst=0)
        return [part for _, part in sorted(x for x in gathered or [] if x is not None)]

    def whole_state(self, state: dict, sync: Sync) -> dict:
        if "param_groups" in state:  # an optimizer's: each pipeline rank's own, in rank order
            return {"ranks": self._gather_on_main(_on_cpu(state))}
        gathered = self._gather_on_main({self.names[k]: v.detach().cpu() for k, v in state.items()})
        merged = {k: v for part in gathered for k, v in part.items()}
        return {k: merged[k] for k in self.whole_keys if k in merged}

    def own_state(self, state: dict | None) -> dict | None:
        if state is None:
            return None
        if "ranks" in state:
            return state["ranks"][self.shape.stage]
        return {mine: state[whole] for mine, whole in self.names.items()}

    # --- what a run logs of it -------------------------------------------------------------------
    def describe(self) -> dict[str, int | str]:
        facts: dict[str, int | str] = {
            record.STAGES: len(self.spans),
            record.SPLIT_POINTS: str(self.split_points),
        }
        for k, (span, params) in enumerate(zip(self.spans, self.stage_params, strict=True)):
            facts |= {
                record.stage_fact(k, "layers"): span,
                record.stage_fact(k, "params"): params,
                record.stage_fact(k, "rank"): k % self.shape.ranks_per_replica,
            }
        return facts

    def memory_metrics(self, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
        """Each rank's peak (the process's RSS on a CPU, the allocator's on CUDA), by pipeline
        rank (`stage{r}_peak_mem_mb`: the stages of pipeline rank r, the largest over the
        replicas), the largest as `peak_mem_mb`."""
        peaks = [0.0] * self.shape.processes
        dist.all_gather_object(peaks, peak_memory_mb(self.devices[0]))
        by_rank = [0.0] * self.shape.ranks_per_replica
        for rank, mb in enumerate(peaks):  # world rank = pipeline rank * replicas + replica
            by_rank[rank // self.shape.replicas] = max(by_rank[rank // self.shape.replicas], mb)
        return {record.PEAK_MEM_MB: max(peaks)} | {
            record.stage_peak_mem_mb(r): mb for r, mb in enumerate(by_rank)
        }
