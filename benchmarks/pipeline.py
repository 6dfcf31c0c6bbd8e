"""Pipeline efficiency: the model split into stages, fed 1, 2, 4, 8 micro-batches, vs unsplit.

Every side trains the same model (same initial weights, batch, threads) for the same steps, each
accelexp's training step (`accelexp.step.train_step`, fp32), in this one process: the unsplit
model on the first device, then the model cut into `--stages` stages (accelexp's `Pipeline`, as
`parallelism=model` builds it) with each `--chunks` value. The sides alternate (U C1 C2 C4 C8 U
C1 ...) so the machine's noise falls on all alike; each side's median over the repeats is
printed, in wall and process CPU time, with samples/s relative to unsplit.

First it prints how resnet50's parameters divide over 2 and 4 stages (balanced by parameters).

    python benchmarks/pipeline.py                              # resnet18, 2 stages, on the CPU
    python benchmarks/pipeline.py --devices cuda:0,cuda:1      # the same over two GPUs
    python benchmarks/pipeline.py --model resnet50 --batch-size 128 --repeats 7
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.nn as nn
from timing import timed

from accelexp.models import build_model
from accelexp.parallel.base import Strategy
from accelexp.parallel.config import ParallelismConfig
from accelexp.parallel.model import parse_devices
from accelexp.parallel.pipeline import Pipeline, split_layers
from accelexp.schema import ResNetConfig, SimpleCNNConfig
from accelexp.step import train_step


def model_of(name: str, image_size: int) -> nn.Module:
    cfg = (
        SimpleCNNConfig(channels=[32, 64], hidden=128, dropout=0.0)
        if name == "simple_cnn"
        else ResNetConfig(name=name, pretrained=False, small_input_max_size=64)
    )
    torch.manual_seed(0)
    return build_model(cfg, in_channels=3, num_classes=10, image_size=image_size)


def print_resnet50_split() -> None:
    model = model_of("resnet50", 32)
    total = sum(p.numel() for p in model.parameters())
    print(f"resnet50 (CIFAR stem, 10 classes): {total:,} parameters, split by parameter count")
    print(f"{'stages':<8}{'stage':<7}{'layers':<24}{'params':>12}{'share':>8}")
    for stages in (2, 4):
        parts, _ = split_layers(model, stages)
        for k, part in enumerate(parts):
            params = sum(p.numel() for p in part.parameters())
            print(f"{stages:<8}{k:<7}{part.span:<24}{params:>12,}{params / total:>8.1%}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--devices", default="cpu", help="stage k on devices[k %% len], e.g. cpu")
    parser.add_argument("--balance", default="params", choices=["params", "compute"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4, help="training steps per timed side")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print_resnet50_split()

    devices = parse_devices(args.devices.split(","))
    devices = [devices[k % len(devices)] for k in range(args.stages)]
    reference = model_of(args.model, args.image_size).to(devices[0])
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
    images = images.to(devices[0])
    labels = torch.randint(0, 10, (args.batch_size,), generator=generator).to(devices[0])
    sides: dict[str, nn.Module] = {"unsplit": copy.deepcopy(reference).to(devices[0])}
    splits = {"unsplit": "-"}
    for chunks in map(int, args.chunks.split(",")):
        model = copy.deepcopy(reference)
        micro_batch = images[: args.batch_size // chunks]  # what balance=compute times
        parts, points = split_layers(model, args.stages, None, args.balance, micro_batch)
        sides[f"chunks={chunks}"] = Pipeline(model, parts, devices, chunks)
        splits[f"chunks={chunks}"] = str(points)

    strategy = Strategy(ParallelismConfig(), device="cpu")  # one replica: no sync, no wrapping

    def train(model: nn.Module) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for _ in range(args.steps):
            train_step(model, images, labels, optimizer, strategy)
        for device in set(devices):
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    for model in sides.values():
        train(model)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side, model in sides.items():
            times[side].append(timed(lambda model=model: train(model)))

    samples = args.steps * args.batch_size
    print(
        f"{args.model}, {args.stages} stages on {[str(d) for d in devices]} split by "
        f"{args.balance}, batch "
        f"{args.batch_size} of {args.image_size}px, {args.steps} steps, {args.threads} threads, "
        f"{args.repeats} alternated repeats (medians; relative = samples/s / unsplit's)"
    )
    header = (
        f"{'side':<12}{'wall s':>9}{'cpu s':>9}{'samples/s':>11}{'relative':>10}{'cpu/wall':>10}"
    )
    print(f"{header}  split at")
    base = None
    for side, runs in times.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        base = base or samples / wall
        print(
            f"{side:<12}{wall:>9.3f}{cpu:>9.3f}{samples / wall:>11.0f}"
            f"{samples / wall / base:>10.3f}{cpu / wall:>10.2f}  {splits[side]}"
        )


if __name__ == "__main__":
    main()
