"""Why lockstep's jobs in one process are greenlets of one thread, not threads: an A/A toy.

Two identical trainings (a small CNN, one seed, 2 torch threads, batch 128) in ONE process take
turns, R rounds of 8 steps, the order alternating by round, either each in a Python thread of its
own (each OS thread calling into torch gets an OpenMP team of its own) or each a greenlet of the
main thread (one OpenMP team for both, as `accelexp.lockstep.together` runs them). Prints b / a
with the 95 % t interval of the per-round log ratios: identical work, so whatever excludes 1.00
is a bias of the design.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/one_thread.py threads [R]
    OMP_WAIT_POLICY=PASSIVE python benchmarks/one_thread.py greenlets [R]

Measured 2026-12-03 (2-core VM, quiet, R=60, alternating the two, three each): threads 1.029
(1.008-1.051), 1.005 (0.987-1.023), 0.854 (0.835-0.874); greenlets 0.994 (0.974-1.015), 0.996
(0.970-1.023), and 1.047 (1.012-1.083) while a test run shared the machine.
"""

from __future__ import annotations

import argparse
import math
import statistics
import threading
import time

import greenlet
import torch
from scipy.special import stdtrit
from torch import nn

STEPS = 8  # a slice


def job():
    """One training's step function, built from seed 0."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(64 * 49, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(5):  # warm-up
        step()
    return step


def slice_of(step) -> float:
    started = time.perf_counter()
    for _ in range(STEPS):
        step()
    return time.perf_counter() - started


def in_threads(rounds: int) -> dict[int, list[float]]:
    times: dict[int, list[float]] = {0: [], 1: []}
    go, done, ready = [threading.Event(), threading.Event()], threading.Event(), []

    def worker(i: int) -> None:
        torch.set_num_threads(2)
        step = job()
        ready.append(i)
        for _ in range(rounds):
            go[i].wait()
            go[i].clear()
            times[i].append(slice_of(step))
            done.set()

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    while len(ready) < 2:
        time.sleep(0.01)
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            done.clear()
            go[i].set()
            done.wait()
    for thread in threads:
        thread.join()
    return times


def in_greenlets(rounds: int) -> dict[int, list[float]]:
    times: dict[int, list[float]] = {0: [], 1: []}
    hub = greenlet.getcurrent()

    def worker(i: int) -> None:
        step = job()
        hub.switch()
        for _ in range(rounds):
            times[i].append(slice_of(step))
            hub.switch()

    jobs = [greenlet.greenlet(worker) for _ in (0, 1)]
    for i, one in enumerate(jobs):
        one.switch(i)
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            jobs[i].switch()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("design", choices=("threads", "greenlets"))
    parser.add_argument("rounds", type=int, nargs="?", default=60)
    args = parser.parse_args()
    design, rounds = args.design, args.rounds
    torch.set_num_threads(2)
    times = (in_threads if design == "threads" else in_greenlets)(rounds)
    logs = [math.log(b / a) for a, b in zip(times[0], times[1], strict=True)]
    mean = statistics.mean(logs)
    half = stdtrit(len(logs) - 1, 0.975) * statistics.stdev(logs) / math.sqrt(len(logs))
    print(
        f"{design}: b/a {math.exp(mean):.4f} ({math.exp(mean - half):.4f}-"
        f"{math.exp(mean + half):.4f}) ±{100 * math.expm1(half):.1f} %, slice "
        f"{statistics.median(times[0]):.2f} s"
    )


if __name__ == "__main__":
    main()
