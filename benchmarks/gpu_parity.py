"""GPU parity: a plain PyTorch loop vs `python run.py` at equal settings, alternated, medians.

    python benchmarks/gpu_parity.py --out $OUT/parity.md          # --plan quick, on a GPU
    python benchmarks/gpu_parity.py --plan full                    # every variant, 5 repeats
    python benchmarks/gpu_parity.py --shapes 32 --precisions fp32,bf16 --variants eager --repeats 3
    python benchmarks/gpu_parity.py --cpu --tiny --repeats 1       # tests the script on a CPU

The question: does a user lose throughput by training through accelexp instead of a loop they
write themselves? Goal: accelexp >= 0.97 of the plain loop's img/s, and the AMP gain (amp/fp32,
bf16/fp32) the same on both sides within 3 %.

**The two sides**, each a subprocess of its own (a fresh interpreter, CUDA context and allocator),
run one after the other for each configuration (plain, accelexp, plain, accelexp, ...), so the
machine's drift falls on both alike; each side's median over the repeats is reported.

- accelexp: `python run.py data=synthetic data.image_size=... data.batch_size=... model=resnet50
  scheduler=none precision=... speed.channels_last=... speed.compile=... epochs=2 ...` as a user
  types it, tracked into a temporary SQLite MLflow store; its figure is the last epoch's logged
  `samples_per_s` (epoch 1 pays for cuDNN autotuning and, compiled, for `compile_s`). The set is
  exactly `steps` batches (`data.num_train = batch * steps`, `data.val_fraction=0`) and one
  evaluation batch (`data.num_test = data.eval_batch_size = batch`), so nothing but the timed
  steps is larger than it needs to be. Its steps are `accelexp.step.train_step`, the one the loop,
  the largest-batch search and the other benchmarks share.
- plain (`--plain-worker`, this file re-invoked): a hand-written loop. The uint8 set already sits
  on the device; each step gathers a batch by index from a per-epoch permutation, normalises it on
  the device, and runs forward/backward/step under autocast (a GradScaler for fp16 amp on CUDA;
  on a CPU amp is bf16 without one, as in `accelexp.precision`). Same model (built by accelexp's
  registry: the model is not what is compared), same `cudnn.benchmark` and TF32 flags (through
  `accelexp.speed.set_tf32`), same channels_last, same `model.compile(mode=...)`, same optimizer
  (SGD, lr 0.1, momentum 0.9, weight decay 5e-4, torch's default kernels). It runs the same
  epochs, evaluates one batch between them as run.py does (so the timed epoch follows the same
  history: under reduce-overhead the eval graph is a CUDA graph of its own), and times epoch 1's
  first `COMPILE_WARMUP_STEPS` steps apart as `compile_s`, exactly as accelexp's Trainer does. Its
  figure is the last epoch's img/s.

**Shapes and variants.** `224`: ResNet-50, 224 px, batch 256 (compute-bound: accelexp's per-step
host work hides behind the GPU). `32`: ResNet-50 (3x3 stem), 32 px, batch 128 (launch-bound: a
step's host work is what the GPU waits for; here any overhead of accelexp shows). Variants:
`eager` (NCHW), `channels_last`, and `compile` (channels_last + torch.compile, mode `default` at
224, `reduce-overhead` (CUDA graphs) at 32).

**The budget, and the plans.** A GPU session has ~15 minutes of device time, machine start
included, shared with gpu_check and a lockstep A/A (scripts/gpu_session.sh). What a run costs
is mostly not its timed steps: on the H200 machine (2026-12-04) each accelexp process took
27-29 s start to exit (interpreter, torch + hydra + mlflow imports, CUDA context, cuDNN
autotuning, and at 224 px generating its synthetic set on the host), each plain one 19-23 s,
the session's first of each ~70-86 s (fp32: cuDNN's autotuning, cold caches), and a *compiled*
one 45-55 s of compilation with a cold cache. Both sides compile the same graphs (same model,
shapes, layout, autocast; the evaluation batch has the training batch's shape), and the plain
side runs first, so accelexp's compile mostly loads them from inductor's on-disk cache: its
`compile_s` is smaller for that reason, not for a better compiler. So the plans trade
configurations and repeats against process starts:

- `--plan quick` (default): 224 and 32, channels_last (what accelexp picks on CUDA), fp32/amp/bf16,
  2 repeats; plus one compiled configuration, 32 px reduce-overhead bf16, ONCE (n=1 in the table:
  a compiled pair costs about as much as two eager ones). 26 processes, ~11 minutes by the
  estimate printed first: more than a session holds beside anything else, so a session runs it
  with `--deadline-s` and gets what fits. Order: every configuration once (the compiled pair
  last), then the second repeats, so a `--deadline-s` cut leaves medians of fewer runs, not
  missing rows.
- `--plan full`: eager, channels_last and compile at both shapes, all precisions, 5 repeats
  (compiled ones 2): ~70 minutes by the estimate, more than a 15-minute lease holds; for a
  longer one.

Several precisions in one process would save starts, but accelexp's side is a whole `run.py`, and
the plain side must pay what accelexp pays to be a fair comparison; so one process per
measurement, and few compiled ones. `--deadline-s` skips any pair expected (from the estimate,
then from that configuration's measured processes) to end after the deadline; the table says
what was skipped. The markdown (`--out`) is rewritten after every pair, so a hard stop still
leaves the rows measured so far. Throughput is wall-clock by nature (the GPU runs
asynchronously; both sides synchronise around the timed epoch); the Runs table adds each
process's wall and CPU seconds, start to exit: the figures to size the next plan with.

`--cpu --tiny` runs the same machinery on a CPU at toy size (simple_cnn at 16 px, or resnet18 at
32 px with `--shapes 32`), for the tests; its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the GPU machine runs from the checkout, nothing installed
    sys.path.insert(0, str(REPO))

RATIO_GOAL = 0.97  # accelexp img/s over the plain loop's, at least
AMP_GAIN_TOLERANCE = 0.03  # the two sides' AMP gains agree within this fraction
PRECISIONS = ("fp32", "amp", "bf16")
VARIANTS = ("eager", "channels_last", "compile")
RESULT_PREFIX = "PARITY_RESULT "  # the plain worker's line of JSON on stdout
EXPERIMENT = "gpu_parity"


@dataclass(frozen=True)
class Shape:
    """A workload: the model, the image size, the batch, and the timed steps per epoch."""

    key: str
    model: str
    image_size: int
    batch_size: int
    steps: int
    compile_mode: str  # the mode of the `compile` variant at this shape

    @property
    def label(self) -> str:
        return f"{self.model} {self.image_size}px b{self.batch_size}"


SHAPES = {
    "224": Shape("224", "resnet50", 224, 256, 10, "default"),
    "32": Shape("32", "resnet50", 32, 128, 30, "reduce-overhead"),
}
TINY_SHAPES = {
    "16": Shape("16", "simple_cnn", 16, 32, 8, "default"),
    "32": Shape("32", "resnet18", 32, 16, 3, "default"),
}


@dataclass(frozen=True)
class Plan:
    shapes: str
    variants: str
    precisions: str
    repeats: int
    compile_repeats: int
    # compiled configurations kept when no grid flag is given: (shape, precision) pairs, or all
    compile_only: tuple[tuple[str, str], ...] | None = None


PLANS = {
    "quick": Plan("224,32", "channels_last,compile", "fp32,amp,bf16", 2, 1, (("32", "bf16"),)),
    "full": Plan("224,32", "eager,channels_last,compile", "fp32,amp,bf16", 5, 2),
}
TINY_PLAN = Plan("16", "eager,channels_last", "fp32,amp,bf16", 1, 1)


@dataclass(frozen=True)
class Job:
    """One configuration, measured `repeats` times on each side."""

    shape: Shape
    variant: str
    precision: str
    repeats: int

    @property
    def channels_last(self) -> bool:
        return self.variant != "eager"

    @property
    def compile_mode(self) -> str | None:
        return self.shape.compile_mode if self.variant == "compile" else None

    @property
    def variant_label(self) -> str:
        return f"channels_last+compile:{self.compile_mode}" if self.compile_mode else self.variant

    @property
    def name(self) -> str:
        return f"{self.shape.key}-{self.variant}-{self.precision}"


@dataclass
class Measurement:
    """One side's subprocess: its last epoch's img/s, and what the whole process cost."""

    samples_per_s: float | None  # the last epoch
    epochs: list[float] = field(default_factory=list)  # img/s of every epoch
    compile_s: float | None = None
    wall_s: float = 0.0  # the whole process: start, imports, data, compile, epochs
    cpu_s: float = 0.0
    placement: str = ""  # accelexp's data placement (device | prefetch | host)
    error: str | None = None
    versions: dict[str, str] | None = None  # the plain worker's torch, CUDA and device name


# --- sizing: guesses, replaced by measured process times as runs finish ------------------------

# interpreter, imports, CUDA context, cuDNN autotune: measured on the H200 machine (2026-12-04),
# a process took 19-23 s (plain) and 27-29 s (accelexp) at 224 px whatever its few timed steps
START_S = {"accelexp": 24.0, "plain": 17.0}
DATA_S_PER_GB = 10.0  # accelexp generates its synthetic uint8 set on the host
COMPILE_S = {"default": 50.0, "reduce-overhead": 45.0, "max-autotune": 300.0}  # cold cache
WARM_CACHE_SHARE = 0.35  # accelexp, after the plain side compiled the same graphs
# A step's seconds are derived from its FLOPs (`accelexp.diagnosis.flops`, the runs' own counter)
# at the rate the GPU sustains: large data-centre GPUs (the plans were sized on an H200) keep
# about this many TFLOP/s of ResNet-50 training at both shapes, channels_last; eager NCHW runs
# amp/bf16 EAGER_FACTOR times slower.
SUSTAINED_TFLOPS = {"fp32": 31.0, "amp": 75.0, "bf16": 75.0}
EAGER_FACTOR = 1.3
CPU_TINY_S = {"accelexp": 9.0, "plain": 3.0}


@functools.cache
def step_flops(shape: Shape) -> float:
    """FLOPs of one training step of `shape` (batch x the counted FLOPs of a sample)."""
    from accelexp.diagnosis.flops import train_flops_per_sample

    model = build_plain_model(shape.model, shape.image_size)
    sample = (3, shape.image_size, shape.image_size)
    return shape.batch_size * (train_flops_per_sample(model, sample) or 0.0)


def estimate_s(job: Job, side: str, epochs: int, cpu: bool) -> float:
    """A guess of one side's process seconds, to size a plan before anything has run."""
    if cpu:
        return CPU_TINY_S[side] + (30.0 if job.compile_mode else 0.0)
    shape = job.shape
    step = step_flops(shape) / (SUSTAINED_TFLOPS[job.precision] * 1e12)
    if job.variant == "eager" and job.precision != "fp32":
        step *= EAGER_FACTOR
    seconds = START_S[side] + epochs * shape.steps * step
    if side == "accelexp":
        images = shape.batch_size * (shape.steps + 1)
        seconds += DATA_S_PER_GB * images * 3 * shape.image_size**2 / 1e9
    if job.compile_mode:
        share = WARM_CACHE_SHARE if side == "accelexp" else 1.0
        seconds += COMPILE_S[job.compile_mode] * share
    return seconds


# --- the plan ---------------------------------------------------------------------------------


def split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def plan_jobs(args: argparse.Namespace) -> list[Job]:
    """The configurations to measure, in priority order (shape, then variant, then precision).

    `--plan` gives the defaults; `--shapes/--variants/--precisions` replace its lists, and once
    any of them is given the grid is their full product (the plan's compile_only filter drops).
    """
    plan = TINY_PLAN if args.tiny else PLANS[args.plan]
    shapes_table = TINY_SHAPES if args.tiny else SHAPES
    grid_given = any(v is not None for v in (args.shapes, args.variants, args.precisions))
    shapes = split(args.shapes or plan.shapes)
    variants = split(args.variants or plan.variants)
    precisions = split(args.precisions or plan.precisions)
    problems = [
        f"{flag} {value!r} is not one of {', '.join(allowed)}"
        for flag, values, allowed in (
            ("--shapes", shapes, tuple(shapes_table)),
            ("--variants", variants, VARIANTS),
            ("--precisions", precisions, PRECISIONS),
        )
        for value in values
        if value not in allowed
    ]
    if problems:
        raise SystemExit("gpu_parity.py: " + "; ".join(problems))
    repeats = args.repeats or plan.repeats
    compile_repeats = args.compile_repeats or min(plan.compile_repeats, repeats)
    jobs = []
    for key in shapes:
        shape = shapes_table[key]
        if args.steps:
            shape = dataclasses.replace(shape, steps=args.steps)
        for variant in variants:
            for precision in precisions:
                if variant != "compile":
                    jobs.append(Job(shape, variant, precision, repeats))
                elif (
                    grid_given or plan.compile_only is None or (key, precision) in plan.compile_only
                ):
                    jobs.append(Job(shape, variant, precision, compile_repeats))
    return jobs


def schedule(jobs: Sequence[Job]) -> list[tuple[int, Job]]:
    """Every configuration once, then every second repeat, ...: a cut loses repeats, not rows."""
    rounds = max((job.repeats for job in jobs), default=0)
    return [(r, job) for r in range(rounds) for job in jobs if r < job.repeats]


# --- the plain side (runs inside `--plain-worker`) ---------------------------------------------


def plain_spec(job: Job, args: argparse.Namespace) -> dict:
    return {
        "device": "cpu" if args.cpu else "cuda",
        "model": job.shape.model,
        "image_size": job.shape.image_size,
        "batch_size": job.shape.batch_size,
        "steps": job.shape.steps,
        "epochs": args.epochs,
        "precision": job.precision,
        "channels_last": job.channels_last,
        "compile_mode": job.compile_mode,
        "tf32": args.tf32,
        "cudnn_benchmark": True,  # accelexp's default (speed.cudnn_benchmark)
        "seed": 0,
    }


def build_plain_model(name: str, image_size: int, num_classes: int = 10) -> torch.nn.Module:
    """The same architecture accelexp builds for `model=<name>` (its registry, its defaults)."""
    from accelexp.config.schema import SCHEMAS
    from accelexp.models import build_model

    schema = SCHEMAS["model"]["resnet" if name.startswith("resnet") else name]
    return build_model(schema(name=name), 3, num_classes, image_size)


def plain_worker(spec: dict) -> dict:
    """The hand-written loop: data on the device, gather, normalise, step; last epoch timed."""
    import torch.nn.functional as F

    from accelexp.speed import COMPILE_WARMUP_STEPS, set_tf32

    device = torch.device(spec["device"])
    torch.manual_seed(spec["seed"])
    torch.backends.cudnn.benchmark = spec["cudnn_benchmark"]
    set_tf32(spec["tf32"])
    cuda = device.type == "cuda"
    batch, steps, size = spec["batch_size"], spec["steps"], spec["image_size"]
    layout = torch.channels_last if spec["channels_last"] else torch.contiguous_format

    model = build_plain_model(spec["model"], size).to(device, memory_format=layout)
    if spec["compile_mode"]:
        model.compile(mode=spec["compile_mode"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "amp": torch.float16 if cuda else torch.bfloat16}
    dtype = dtype[spec["precision"]]
    scaler = torch.amp.GradScaler("cuda") if dtype is torch.float16 else None

    def autocast() -> contextlib.AbstractContextManager:
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    generator = torch.Generator(device).manual_seed(spec["seed"])
    n = batch * steps
    shape = (n, 3, size, size)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)
    labels = torch.randint(0, 10, (n,), device=device, generator=generator)
    eval_images = images[:batch].clone()
    mean = torch.full((1, 3, 1, 1), 0.5 * 255, device=device)
    inv_std = 1 / torch.full((1, 3, 1, 1), 0.25 * 255, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def normalise(raw: torch.Tensor) -> torch.Tensor:
        return (raw.contiguous(memory_format=layout).float() - mean) * inv_std

    def train_epoch(warmup: int) -> tuple[float, float | None]:
        model.train()
        order = torch.randperm(n, device=device, generator=generator)
        compile_s, timed_from = None, 0
        sync()
        start = time.perf_counter()
        for step in range(steps):
            index = order[step * batch : (step + 1) * batch]
            x, y = normalise(images.index_select(0, index)), labels.index_select(0, index)
            with autocast():
                loss = F.cross_entropy(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step + 1 == warmup:  # compiled: the warm-up steps are compile_s, as in accelexp
                sync()
                now = time.perf_counter()
                compile_s, start, timed_from = now - start, now, step + 1
        sync()
        return (steps - timed_from) * batch / (time.perf_counter() - start), compile_s

    @torch.no_grad()
    def evaluate() -> None:  # one batch, as run.py's validation of data.num_test = batch
        model.eval()
        with autocast():
            model(normalise(eval_images)).float().argmax(1)

    per_epoch, compile_s = [], None
    for epoch in range(spec["epochs"]):
        warmup = min(COMPILE_WARMUP_STEPS, steps - 1) if spec["compile_mode"] and epoch == 0 else 0
        samples_per_s, warm = train_epoch(warmup)
        per_epoch.append(samples_per_s)
        compile_s = compile_s if warm is None else warm
        evaluate()
    return {
        "samples_per_s": per_epoch[-1],
        "epochs": per_epoch,
        "compile_s": compile_s,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name(device) if cuda else "CPU",
    }


# --- running the two sides --------------------------------------------------------------------


def accelexp_overrides(job: Job, args: argparse.Namespace) -> list[str]:
    """The run.py command line of one configuration, as a user types it."""
    shape = job.shape
    overrides = [
        "data=synthetic",
        f"data.image_size={shape.image_size}",
        f"data.batch_size={shape.batch_size}",
        f"model={shape.model}",
        "scheduler=none",
        f"precision={job.precision}",
        f"speed.channels_last={str(job.channels_last).lower()}",
        f"speed.compile={job.compile_mode or 'off'}",
        f"epochs={args.epochs}",
        f"max_steps_per_epoch={shape.steps}",
        f"data.num_train={shape.batch_size * shape.steps}",
        "data.val_fraction=0",
        f"data.num_test={shape.batch_size}",
        f"data.eval_batch_size={shape.batch_size}",
    ]
    if args.tf32:
        overrides.append("speed.tf32=true")
    if args.cpu:
        overrides.append("device=cpu")
    return overrides


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "MLFLOW_"))}


def run_process(
    command: list[str], timeout_s: float
) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `command` in the repo; (result, wall s, CPU s of the child and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(
        command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=timeout_s
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result, wall, cpu


def failure(result: subprocess.CompletedProcess, wall: float, cpu: float) -> Measurement:
    tail = (result.stdout + result.stderr).strip().splitlines()[-15:]
    error = f"exit {result.returncode}: " + "\n".join(tail)
    return Measurement(None, wall_s=wall, cpu_s=cpu, error=error)


def measure_plain(job: Job, args: argparse.Namespace, timeout_s: float) -> Measurement:
    spec = json.dumps(plain_spec(job, args))
    command = [sys.executable, str(Path(__file__).resolve()), "--plain-worker", spec]
    result, wall, cpu = run_process(command, timeout_s)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if result.returncode != 0 or not lines:
        return failure(result, wall, cpu)
    report = json.loads(lines[-1].removeprefix(RESULT_PREFIX))
    versions = {k: str(report[k]) for k in ("torch", "cuda", "device_name")}
    return Measurement(
        report["samples_per_s"],
        report["epochs"],
        report["compile_s"],
        wall,
        cpu,
        "device",
        None,
        versions,
    )


def measure_accelexp(
    job: Job, args: argparse.Namespace, store: Path, tag: str, timeout_s: float
) -> Measurement:
    from mlflow import MlflowClient

    from accelexp.record import COMPILE_S, DATA_PLACEMENT, SAMPLES_PER_S
    from accelexp.tracking.life import RUN_ID_FILE

    uri = f"sqlite:///{store / 'mlflow.db'}"
    run_dir = store / "runs" / tag
    command = [sys.executable, "run.py", *accelexp_overrides(job, args)]
    command += [f"mlflow.tracking_uri={uri}", f"mlflow.experiment={EXPERIMENT}"]
    command += [f"hydra.run.dir={run_dir}"]
    result, wall, cpu = run_process(command, timeout_s)
    id_file = run_dir / RUN_ID_FILE
    if result.returncode != 0 or not id_file.is_file():
        return failure(result, wall, cpu)
    client = MlflowClient(uri)
    run_id = id_file.read_text().strip()
    run = client.get_run(run_id)
    if run.info.status != "FINISHED":
        return Measurement(None, wall_s=wall, cpu_s=cpu, error=f"run {run_id} {run.info.status}")
    history = sorted(client.get_metric_history(run_id, SAMPLES_PER_S), key=lambda m: m.step)
    compiled = client.get_metric_history(run_id, COMPILE_S)
    return Measurement(
        history[-1].value if history else None,
        [m.value for m in history],
        compiled[0].value if compiled else None,
        wall,
        cpu,
        run.data.params.get(DATA_PLACEMENT, ""),
    )


# --- the tables -------------------------------------------------------------------------------

Results = dict[str, dict[str, list[Measurement]]]  # job name -> side -> measurements


def median_of(
    runs: Sequence[Measurement], pick: Callable[[Measurement], float | None]
) -> float | None:
    values = [v for v in (pick(m) for m in runs) if v is not None]
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def throughput(results: Results, job: Job, side: str) -> float | None:
    runs = [m for m in results.get(job.name, {}).get(side, []) if m.error is None]
    return median_of(runs, lambda m: m.samples_per_s)


def pairs_done(results: Results, job: Job) -> int:
    sides = results.get(job.name, {})
    ok = [sum(m.error is None for m in sides.get(side, [])) for side in ("plain", "accelexp")]
    return min(ok)


def render(
    header: Sequence[str], jobs: Sequence[Job], results: Results, notes: Sequence[str]
) -> str:
    """The whole report in markdown: parity rows, AMP gains, every process, and the notes."""
    lines = ["# GPU parity: plain PyTorch loop vs accelexp `run.py`", "", *header, ""]
    lines += [
        f"Ratio = accelexp img/s / plain img/s (medians over n alternated pairs); goal >= "
        f"{RATIO_GOAL}. Compiled rows have fewer repeats (n) than the others by design; their "
        f"accelexp compile s is smaller mostly because the plain side, run first, filled "
        f"inductor's cache with the same graphs.",
        "",
        "| shape | variant | precision | n | plain img/s | accelexp img/s | ratio | goal | "
        "compile s plain / accelexp |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for job in jobs:
        plain, ours = throughput(results, job, "plain"), throughput(results, job, "accelexp")
        ratio = ours / plain if plain and ours else None
        verdict = "-" if ratio is None else ("ok" if ratio >= RATIO_GOAL else "**UNDER**")
        sides = results.get(job.name, {})
        compile_s = "-"
        if job.compile_mode:
            compile_s = " / ".join(
                fmt(median_of(sides.get(side, []), lambda m: m.compile_s))
                for side in ("plain", "accelexp")
            )
        lines.append(
            f"| {job.shape.label} | {job.variant_label} | {job.precision} | "
            f"{pairs_done(results, job)} | {fmt(plain)} | {fmt(ours)} | {fmt(ratio, '.3f')} | "
            f"{verdict} | {compile_s} |"
        )
    lines += ["", *amp_gain_table(jobs, results), "", *runs_table(jobs, results)]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def amp_gain_table(jobs: Sequence[Job], results: Results) -> list[str]:
    """Per shape and variant: amp/fp32 and bf16/fp32 on each side, and how far apart they are."""
    lines = [
        f"## AMP gain (img/s over fp32 of the same shape and variant; goal: sides within "
        f"{AMP_GAIN_TOLERANCE:.0%})",
        "",
        "| shape | variant | plain amp/fp32 | accelexp amp/fp32 | diff | plain bf16/fp32 | "
        "accelexp bf16/fp32 | diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[str, str], dict[str, Job]] = {}
    for job in jobs:
        groups.setdefault((job.shape.label, job.variant_label), {})[job.precision] = job
    for (shape, variant), by_precision in groups.items():
        cells = []
        for precision in ("amp", "bf16"):
            gains = []
            for side in ("plain", "accelexp"):
                base = by_precision.get("fp32")
                top = by_precision.get(precision)
                fp32 = throughput(results, base, side) if base else None
                mixed = throughput(results, top, side) if top else None
                gains.append(mixed / fp32 if fp32 and mixed else None)
            diff = gains[1] / gains[0] - 1 if gains[0] and gains[1] else None
            mark = "" if diff is None or abs(diff) <= AMP_GAIN_TOLERANCE else " **OFF**"
            cells += [fmt(gains[0], ".3f"), fmt(gains[1], ".3f"), fmt(diff, "+.1%") + mark]
        lines.append(f"| {shape} | {variant} | " + " | ".join(cells) + " |")
    return lines


def runs_table(jobs: Sequence[Job], results: Results) -> list[str]:
    """Every side of every configuration: spread, epochs, and what its processes cost."""
    lines = [
        "## Runs (per process: wall and CPU seconds from start to exit, for sizing plans)",
        "",
        "| configuration | side | n | img/s median (min-max) | epoch 1 img/s | process wall s | "
        "process CPU s | data | failed |",
        "|---|---|---:|---|---:|---:|---:|---|---:|",
    ]
    for job in jobs:
        for side in ("plain", "accelexp"):
            runs = results.get(job.name, {}).get(side, [])
            if not runs:
                continue
            ok = [m for m in runs if m.error is None]
            values = [m.samples_per_s for m in ok if m.samples_per_s is not None]
            spread = f"{fmt(median_of(ok, lambda m: m.samples_per_s))}"
            if len(values) > 1:
                spread += f" ({min(values):.1f}-{max(values):.1f})"
            first = median_of(ok, lambda m: m.epochs[0] if m.epochs else None)
            placements = sorted({m.placement for m in ok if m.placement})
            lines.append(
                f"| {job.name} | {side} | {len(ok)} | {spread} | {fmt(first)} | "
                f"{fmt(median_of(runs, lambda m: m.wall_s))} | "
                f"{fmt(median_of(runs, lambda m: m.cpu_s))} | {','.join(placements) or '-'} | "
                f"{len(runs) - len(ok)} |"
            )
    return lines


# --- the driver -------------------------------------------------------------------------------


def gpu_name() -> str:
    """The GPU's name from nvidia-smi, without creating a CUDA context in this process."""
    if shutil.which("nvidia-smi") is None:
        return "unknown GPU"
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        names = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split("\n")
        return names[0].strip() or "unknown GPU"
    return "unknown GPU"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--plan",
        choices=sorted(PLANS),
        default="quick",
        help="preset lists and repeats (default: quick; see the module docstring)",
    )
    parser.add_argument("--shapes", help="comma list: 224,32 (with --tiny: 16,32)")
    parser.add_argument("--variants", help=f"comma list of {','.join(VARIANTS)}")
    parser.add_argument("--precisions", help=f"comma list of {','.join(PRECISIONS)}")
    parser.add_argument("--repeats", type=int, help="pairs per configuration (quick 2, full 5)")
    parser.add_argument(
        "--compile-repeats", type=int, help="pairs per compiled configuration (quick 1, full 2)"
    )
    parser.add_argument("--steps", type=int, help="timed steps per epoch (224: 10, 32: 30)")
    parser.add_argument("--epochs", type=int, default=2, help="the last one is timed (>= 2)")
    parser.add_argument("--tf32", action="store_true", help="speed.tf32=true on both sides")
    parser.add_argument("--cpu", action="store_true", help="device=cpu on both sides")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="toy shapes (simple_cnn 16px; resnet18 32px), for --cpu tests",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        help="launch no pair expected to end later than this many seconds",
    )
    parser.add_argument("--run-timeout-s", type=float, default=900, help="per process")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--keep", action="store_true", help="keep the temporary MLflow store")
    parser.add_argument("--plain-worker", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be >= 2: the first epoch pays for warm-up")
    if any(n is not None and n < 1 for n in (args.repeats, args.compile_repeats, args.steps)):
        parser.error("--repeats, --compile-repeats and --steps must be >= 1")
    return args


def header_line(args: argparse.Namespace, versions: dict[str, str] | None) -> str:
    """torch, CUDA and device (the plain worker's, once one has run), and the common settings."""
    if versions is None:
        versions = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
        versions["device_name"] = "CPU" if args.cpu else gpu_name()
    return (
        f"torch {versions['torch']}, CUDA {versions['cuda']}, {versions['device_name']}; "
        f"cudnn.benchmark on, TF32 {'on' if args.tf32 else 'off'}; {args.epochs} epochs, the "
        f"last timed; plan {'tiny' if args.tiny else args.plan}."
    )


def describe(measured: Measurement) -> str:
    if measured.error:
        return f"FAILED {measured.error}"
    return (
        f"{measured.samples_per_s:.1f} img/s (epochs "
        f"{', '.join(f'{v:.1f}' for v in measured.epochs)}; compile_s {fmt(measured.compile_s)}; "
        f"process {measured.wall_s:.1f}s wall {measured.cpu_s:.1f}s CPU)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plain_worker:
        print(RESULT_PREFIX + json.dumps(plain_worker(json.loads(args.plain_worker))), flush=True)
        return 0
    if not args.cpu and not args.dry_run and not torch.cuda.is_available():
        print("No CUDA GPU is visible: run this on a GPU machine, or with --cpu --tiny.")
        return 2

    jobs = plan_jobs(args)
    order = schedule(jobs)
    sides = ("plain", "accelexp")  # A B A B: the plain loop first in every pair
    expected = {
        (job.name, side): estimate_s(job, side, args.epochs, args.cpu)
        for job in jobs
        for side in sides
    }
    planned = sum(expected[(job.name, side)] for _, job in order for side in sides)
    header = [header_line(args, None)]
    print(header[0])
    print(
        f"planned: {len(jobs)} configurations, {2 * len(order)} subprocess runs ({len(order)} "
        f"plain, {len(order)} accelexp), about {planned / 60:.1f} min by the "
        f"{'CPU' if args.cpu else 'GPU'} estimate"
        + (f"; deadline {args.deadline_s:.0f} s" if args.deadline_s else ""),
        flush=True,
    )
    if args.dry_run:
        for round_, job in order:
            plain, ours = (expected[(job.name, side)] for side in sides)
            print(f"  {job.name} #{round_ + 1}: plain ~{plain:.0f}s, accelexp ~{ours:.0f}s")
        return 0

    # `timeout` sends SIGTERM: exit through subprocess.run, which kills the child, then report
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    store = Path(tempfile.mkdtemp(prefix="accelexp-gpu-parity-"))
    results: Results = {}
    skipped: list[str] = []
    start = time.monotonic()

    def write(total: str = "") -> str:
        notes = [f"Skipped (deadline): {', '.join(skipped)}."] if skipped else []
        text = render(header, jobs, results, notes + ([total] if total else []))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        return text

    def timeout_s() -> float:
        if not args.deadline_s:
            return args.run_timeout_s
        left = args.deadline_s - (time.monotonic() - start)
        return min(args.run_timeout_s, max(60.0, left + 60.0))

    try:
        for round_, job in order:
            need = sum(expected[(job.name, side)] for side in sides)
            if args.deadline_s and time.monotonic() - start + need > args.deadline_s:
                skipped.append(f"{job.name} #{round_ + 1}")
                print(f"skip {job.name} #{round_ + 1}: ~{need:.0f}s would pass the deadline")
                continue
            for side in sides:
                limit = timeout_s()
                try:
                    if side == "plain":
                        measured = measure_plain(job, args, limit)
                    else:
                        tag = f"{job.name}-{round_}"
                        measured = measure_accelexp(job, args, store, tag, limit)
                except subprocess.TimeoutExpired:
                    measured = Measurement(None, wall_s=limit, error=f"timed out ({limit:.0f}s)")
                results.setdefault(job.name, {}).setdefault(side, []).append(measured)
                expected[(job.name, side)] = measured.wall_s  # sizes this job's next pairs
                if measured.versions and not args.cpu:
                    header[0] = header_line(args, measured.versions)
                print(f"{job.name} #{round_ + 1} {side}: {describe(measured)}", flush=True)
            write()
    finally:
        text = write(f"Total {time.monotonic() - start:.0f} s.")
        print("\n" + text)
        if args.keep:
            print(f"runs kept in {store}")
        else:
            shutil.rmtree(store, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    failed = any(m.error for sides_ in results.values() for runs in sides_.values() for m in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
