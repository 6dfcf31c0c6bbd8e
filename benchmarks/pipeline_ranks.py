"""Pipeline bubbles across ranks: each schedule's idle share of a stage, against theory.

Starts itself under torchrun with `--stages` worker processes (Gloo, one thread each), which
build accelexp's `parallelism=pipeline` strategy for every schedule the installed torch has and
step it through the loop's step (`accelexp.step.train_step`): `--warmup` untimed steps, then
`--repeats` timed ones, the schedules taking turns step by step so the machine's noise falls on
all alike. Per rank and step:

- busy: the time the rank spent in its stages' compute (torch's `PipelineStage` forward, backward
  and, under zero bubble, weight-gradient actions, timed around each call), wall: the step's
  time; a rank's bubble is 1 - busy / wall (waiting for an activation or a gradient, sending,
  the schedule's own work), the step's the mean over ranks. A core per rank is needed (fewer: a
  rank waiting for a core stretches its compute and its waits alike); `--stages` is checked
  against the usable cores.
- the peak bytes of activations the rank's stages held for the backward pass (saved tensors,
  counted by a saved-tensors hook), and its parameters' and optimizer state's.

Theory (equal stages, no communication time): GPipe and 1F1B idle (S-1)/(M+S-1) of a step (S
ranks, M micro-batches); interleaved 1F1B with V stages per rank (S-1)/(V*M+S-1); zero bubble
(ZB1P) fills most of the rest with the weight-gradient halves of the backward passes.

    python benchmarks/pipeline_ranks.py                         # simple_cnn, 2 ranks, M=4
    python benchmarks/pipeline_ranks.py --model vit_tiny --override model.depth=4 model.dim=96
    python benchmarks/pipeline_ranks.py --model resnet18 --stages 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def theory(schedule: str, stages: int, micro: int) -> float | None:
    per_rank = 2 if schedule in ("interleaved_1f1b", "zero_bubble") else 1
    if schedule == "zero_bubble":
        return None
    return (stages - 1) / (per_rank * micro + stages - 1)


class SavedBytes:
    """The bytes of the tensors autograd holds for the backward pass, now and at the peak."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage -> [holders, bytes]
        self.now = self.peak = 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        entry = self.live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        return _Held(self, key, tensor)

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]


class _Held:
    def __init__(self, counter: SavedBytes, key: int, tensor) -> None:
        self.counter, self.key, self.tensor = counter, key, tensor

    def __del__(self) -> None:
        self.counter.release(self.key)


def timed(stage, total: list[float]) -> None:
    """Add the wall time of each compute action of torch's `stage` to `total[0]`."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        action = getattr(stage, name, None)
        if action is None:
            continue

        def clocked(*args, _action=action, **kwargs):
            start = time.perf_counter()
            try:
                return _action(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - start

        setattr(stage, name, clocked)


def worker(args: argparse.Namespace, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from accelexp.config import typed
    from accelexp.models import build_model
    from accelexp.parallel import build_strategy
    from accelexp.parallel.base import state_bytes
    from accelexp.parallel.stages_per_rank import available_schedules
    from accelexp.step import train_step

    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    from conftest import compose_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    runs = {}
    for schedule in available_schedules():
        cfg = typed(
            compose_config(
                "sqlite:///unused.db",
                f"model={args.model}",
                "parallelism=pipeline",
                f"parallelism.nprocs={args.stages}",
                f"parallelism.schedule={schedule}",
                f"parallelism.microbatches={args.microbatches}",
                f"data.batch_size={args.batch_size}",
                f"data.image_size={args.image_size}",
                *args.override,
            )
        )
        torch.manual_seed(0)
        model = build_model(cfg.model, 3, 10, args.image_size)
        strategy = build_strategy(cfg)
        strategy.setup()
        placed = strategy.wrap_model(model)
        optimizer = strategy.wrap_optimizer(torch.optim.SGD(placed.parameters(), lr=0.01), placed)
        runs[schedule] = (strategy, placed, optimizer, SavedBytes())
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, 10, (args.batch_size,))
    figures: dict[str, dict[str, list[float]]] = {s: {"busy": [], "wall": []} for s in runs}
    busy = {schedule: [0.0] for schedule in runs}
    for step in range(args.warmup + args.repeats):
        for schedule, (strategy, placed, optimizer, saved) in runs.items():
            dist.barrier()
            busy[schedule][0], wall = 0.0, time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda held: held.tensor):
                train_step(placed, images, labels, optimizer, strategy)
            wall = time.perf_counter() - wall
            if step == 0:  # the schedule and its stages are built by the first step
                for stage in strategy.placement.stages:
                    timed(stage, busy[schedule])
            if step >= args.warmup:
                figures[schedule]["busy"].append(busy[schedule][0])
                figures[schedule]["wall"].append(wall)
    report = {
        schedule: {
            **figures[schedule],
            "activations_mb": saved.peak / 2**20,
            "state_mb": state_bytes(list(placed.parameters()), optimizer) / 2**20,
            "stages": strategy.describe()["stages"],
        }
        for schedule, (strategy, placed, optimizer, saved) in runs.items()
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _median_bubble(rank: dict[str, list[float]]) -> float:
    """A rank's median idle share over the steps."""
    return statistics.median(1 - b / w for b, w in zip(rank["busy"], rank["wall"], strict=True))


def summary(out: Path, args: argparse.Namespace) -> None:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.stages)]
    print(
        f"{args.model}, {args.stages} ranks, {args.microbatches} micro-batches of "
        f"{args.batch_size // args.microbatches}, {args.image_size} px, Gloo, 1 thread per rank; "
        f"{args.repeats} timed steps after {args.warmup}; bubble = 1 - busy/wall per rank, the "
        f"step's the mean over ranks: median [min, max] over the steps"
    )
    print(
        "| schedule | stages | bubble measured | theory | per rank | step ms | "
        + " | ".join(f"rank {r} activations / state MiB" for r in range(args.stages))
        + " |"
    )
    print("|---|---|---|---|---|---|" + "---|" * args.stages)
    for schedule in ranks[0]:
        steps = len(ranks[0][schedule]["wall"])
        bubbles = [
            statistics.mean(1 - r[schedule]["busy"][i] / r[schedule]["wall"][i] for r in ranks)
            for i in range(steps)
        ]
        walls = [max(r[schedule]["wall"][i] for r in ranks) * 1e3 for i in range(steps)]
        expected = theory(schedule, args.stages, args.microbatches)
        per_rank = ", ".join(f"{_median_bubble(r[schedule]):.2f}" for r in ranks)
        memory = " | ".join(
            f"{r[schedule]['activations_mb']:.2f} / {r[schedule]['state_mb']:.2f}" for r in ranks
        )
        print(
            f"| {schedule} | {ranks[0][schedule]['stages']} | {statistics.median(bubbles):.2f} "
            f"[{min(bubbles):.2f}, {max(bubbles):.2f}] | "
            f"{'—' if expected is None else f'{expected:.2f}'} | {per_rank} | "
            f"{statistics.median(walls):.0f} [{min(walls):.0f}, {max(walls):.0f}] | {memory} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="simple_cnn")
    parser.add_argument("--stages", type=int, default=2, help="ranks (worker processes)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--override", nargs="*", default=[], help="more run.py overrides, e.g. model.depth=4"
    )
    parser.add_argument("--out", type=Path, default=None, help="the ranks' reports (tmp)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = args.out or Path(f"/tmp/pipeline_ranks_{os.getpid()}")
    if args.worker:
        worker(args, out)
        return
    cores = len(os.sched_getaffinity(0))
    if args.stages > cores:
        sys.exit(f"--stages {args.stages} needs a core per rank; this machine has {cores}")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1])}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.stages}", str(HERE), "--worker", f"--out={out}",
        *sys.argv[1:],
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True)
    print("$ python benchmarks/pipeline_ranks.py " + " ".join(sys.argv[1:]))
    summary(out, args)


if __name__ == "__main__":
    main()
