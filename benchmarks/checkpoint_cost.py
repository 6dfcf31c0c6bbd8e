"""What the per-epoch training-state checkpoint costs: `last.pt` written as `train.py` writes it.

The full state (model, SGD with momentum, scheduler, RNG states) of torchvision's resnet18 and
resnet50 (10 classes) is written with `accelexp.checkpoint.save` — temporary file and its sha256,
fsync, the one it replaces kept as previous.pt, rename, the record —
`--repeats` times; the median wall and process CPU time per write is printed with the file size.
This is paid once per epoch, outside the timed training steps (`samples_per_s`).

`--fsdp N`: the same models sharded over N FSDP2 workers (Gloo, this machine's CPU), saved both
ways an FSDP run can: gathered to rank 0 into one file (as before shards) and as shards every
worker writes in parallel (`checkpoint.save_shards`, torch.distributed.checkpoint, each worker
hashing its share, then `last.pt` naming them), the two taken in turns after one warm-up turn;
the median and range over the repeats of the slowest worker's wall time per save.

    python benchmarks/checkpoint_cost.py
    python benchmarks/checkpoint_cost.py --models resnet50 --repeats 9
    python benchmarks/checkpoint_cost.py --fsdp 2 --models resnet18 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torchvision

from accelexp import checkpoint


def trained(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """`name` after one SGD step: its momentum buffers exist, as after a real epoch."""
    model = getattr(torchvision.models, name)(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    return model, optimizer


def small_state(optimizer: torch.optim.Optimizer, model=None, opt=None, shards=None) -> dict:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return checkpoint.training_state(
        model=model, optimizer=opt, shards=shards, scheduler=scheduler, scaler={},
        progress=checkpoint.Progress(), rng=[checkpoint.rng_state(torch.Generator())],
        run_id=None, config={},
    )  # fmt: skip


def cost(name: str, repeats: int) -> tuple[float, float, float]:
    """(MiB, median wall s, median CPU s) of writing `name`'s last.pt."""
    model, optimizer = trained(name)
    walls, cpus = [], []
    with tempfile.TemporaryDirectory(dir=".") as folder:
        path = Path(folder) / checkpoint.LAST
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            state = small_state(optimizer, model.state_dict(), optimizer.state_dict())
            checkpoint.save(path, state, keep_previous=True)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        size = path.stat().st_size / 2**20
    return size, statistics.median(walls), statistics.median(cpus)


class World:
    """torch.distributed's objects collectives, as `checkpoint.save_shards` asks for them."""

    def broadcast_object(self, obj: object) -> object:
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather_object(self, obj: object) -> list:
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, obj)
        return gathered


def fsdp_worker(rank: int, size: int, name: str, repeats: int, folder: str, port: int) -> None:
    """One of `size` FSDP workers: `repeats` saves each way; rank 0 prints the figures."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from accelexp.parallel.fsdp import GATHERED

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))
    model = getattr(torchvision.models, name)(num_classes=10)
    for block in (m for m in model.modules() if type(m).__name__ in ("BasicBlock", "Bottleneck")):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    checkpoints = Path(folder)

    def gathered() -> None:
        model_state = get_model_state_dict(model, options=GATHERED)
        opt_state = get_optimizer_state_dict(model, optimizer, options=GATHERED)
        if rank == 0:
            state = small_state(optimizer, model_state, opt_state)
            checkpoint.save(checkpoints / "gathered" / checkpoint.LAST, state, keep_previous=True)

    def sharded() -> None:
        model_state, opt_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": opt_state}
        shards = checkpoint.save_shards(checkpoints / "sharded", state, 1, World(), rank, size)
        if rank == 0:
            state = small_state(optimizer, shards=shards)
            checkpoint.save(checkpoints / "sharded" / checkpoint.LAST, state, keep_previous=True)

    ways = {"gathered": gathered, "sharded": sharded}
    walls: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats + 1):  # the two ways taken in turns; the first turn warms up
        for way, save in ways.items():
            dist.barrier()
            wall = time.perf_counter()
            save()
            walls[way].append(max(World().gather_object(time.perf_counter() - wall)))
    for way in ways:
        slowest = sorted(walls[way][1:])
        if rank == 0:
            print(
                f"{name} on {size} FSDP workers, {way}: median {statistics.median(slowest):.3f} s "
                f"(range {slowest[0]:.3f}-{slowest[-1]:.3f} s, {repeats} repeats)",
                flush=True,
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fsdp", type=int, default=0, help="workers: gathered vs sharded saves")
    args = parser.parse_args()
    for name in args.models:
        if args.fsdp:
            from accelexp.parallel.world import free_port

            with tempfile.TemporaryDirectory(dir=".") as folder:
                torch.multiprocessing.spawn(
                    fsdp_worker,
                    (args.fsdp, name, args.repeats, folder, free_port()),
                    nprocs=args.fsdp,
                )
            continue
        size, wall, cpu = cost(name, args.repeats)
        print(
            f"{name}: last.pt {size:.0f} MiB, one write: median wall {wall:.3f} s, "
            f"CPU {cpu:.3f} s ({args.repeats} repeats)"
        )


if __name__ == "__main__":
    main()
