"""The check a maintainer runs on a GPU machine: parallelism, the speed switches, data, scaling.

    .venv/bin/python scripts/gpu_check.py                # on 1 GPU: two stages share cuda:0
    .venv/bin/python scripts/gpu_check.py --only 1,7,8   # some checks only
    .venv/bin/python scripts/gpu_check.py --cpu          # the checks on the CPU: tests the script

With 2 or more GPUs each stage gets its own GPU and `hybrid` runs GPUs // 2 replicas of 2 GPUs; on
one GPU both stages are placed on it and `hybrid` runs one replica. Checks, each PASS, SKIP (said
why) or FAIL:

1. the split model (resnet18, eval-mode BatchNorm) gives the unsplit model's outputs and
   gradients, for chunks 1 and 4, in true fp32: TF32 is turned off for the check
   (`accelexp.speed.set_tf32(False)`) and the flags restored after. PyTorch lets cuDNN run fp32
   convolutions on TF32 tensor cores by default, and TF32 keeps a 10-bit mantissa (about 3
   decimal digits): a split and an unsplit pass pick different algorithms and then differ by far
   more than fp32 rounding (max abs diff 4.4e-4 seen on an H200, over the tolerance of 1e-4);
2. `parallelism=model precision=amp`: fp16 autocast per stage and one GradScaler over the stages'
   parameters train 2 epochs, and the stages' devices and peak memory are logged;
3. `parallelism=model precision=bf16 parallelism.balance=compute`;
4. `parallelism=hybrid parallelism.sync=ddp` (NCCL, DDP over the multi-device replica);
5. `parallelism=hybrid parallelism.sync=horovod`, when Horovod was built with GPU operations
   (`scripts/build_horovod.sh` on a machine with CUDA and NCCL); otherwise SKIP, said why;
6. `parallelism=dp` (torch.nn.DataParallel over every visible GPU; on one GPU, that one);
7. the speed switches together, `speed.channels_last=true speed.tf32=true speed.compile=default
   speed.optimizer_impl=fused precision=amp`: the run FINISHED, each switch is logged as a tag
   and a param, and the compile warm-up as `compile_s`;
8. data held on the device and data copied per batch (on CUDA: pinned staging and a side-stream
   copy, placement `prefetch`) give exactly the same batches, augmentation included, over 2
   epochs of a reshuffling DistributedSampler; with --cpu the copied path is the plain host one;
9. a GradScaler overflow through the real `Precision`, `Strategy` and `Trainer`: an inf
   injected into one gradient skips that step (parameters unchanged) and halves the scale, and
   the next step updates the parameters. With --cpu, where `precision=amp` is bf16 without a
   scaler, the check sets a `torch.amp.GradScaler("cpu")` on the `Precision` itself;
10. `parallelism=fsdp precision=amp` (FSDP2, one worker per GPU up to 2, NCCL): fp16 autocast
    and the GradScaler over sharded (DTensor) gradients; the training state's memory per worker
    (`state_mem_mb`) is logged; then the memory study's largest-batch search
    (`max_batch.search=true`) doubles the batch until it runs out of memory and logs `max_batch`.
    With --cpu (Gloo): no search, the step's measured memory (`step_peak_mb`) instead;
11. `parallelism=fsdp parallelism.cpu_offload=true precision=bf16 model=vit_tiny`: the shards
    in host memory, a ViT's attention in bf16 (CUDA only; SKIP with --cpu).

With --cpu the same checks run at toy size (`CPU_RUN`: 16 px, one epoch of 2 steps of 16 images;
check 1 at `CPU_IMAGE_SIZE`): they test the script, not the hardware.

Exit code 0 when nothing failed. Runs go to a temporary folder (one MLflow store, an experiment
per job), removed at the end unless a check failed or --keep is given; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from mlflow import MlflowClient

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from accelexp.data import BatchLoader, ImageSet  # noqa: E402
from accelexp.engine import Trainer  # noqa: E402
from accelexp.models import build_model  # noqa: E402
from accelexp.parallel.base import Strategy  # noqa: E402
from accelexp.parallel.config import ParallelismConfig  # noqa: E402
from accelexp.parallel.pipeline import Pipeline, split_layers  # noqa: E402
from accelexp.schema import AmpConfig, ResNetConfig  # noqa: E402
from accelexp.speed import set_tf32  # noqa: E402

SMALL_RUN = (
    "data=synthetic",
    "data.image_size=32",
    "data.num_train=2048",
    "data.num_test=512",
    "data.batch_size=64",
    "epochs=2",
    "max_steps_per_epoch=10",
    "progress=false",
)
# --cpu tests the script, not the hardware: the same jobs at toy size, seconds each
CPU_IMAGE_SIZE = 16
CPU_RUN = (
    "data=synthetic",
    f"data.image_size={CPU_IMAGE_SIZE}",
    "data.num_train=128",
    "data.num_test=16",
    "data.batch_size=16",
    "epochs=1",
    "max_steps_per_epoch=2",
    "progress=false",
)


@contextlib.contextmanager
def true_fp32() -> Iterator[None]:
    """TF32 off (matmuls and cuDNN convolutions) inside; the flags as they were, after."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    set_tf32(False)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def check_same_numbers(devices: list[torch.device], image_size: int = 32) -> str:
    with true_fp32():
        return _same_numbers(devices, image_size)


def _same_numbers(devices: list[torch.device], image_size: int) -> str:
    cfg = ResNetConfig(name="resnet18", pretrained=False, small_input_max_size=64)
    torch.manual_seed(0)
    reference = build_model(cfg, 3, 10, image_size).to(devices[0]).eval()
    x = torch.randn(16, 3, image_size, image_size, device=devices[0])
    y = torch.randint(0, 10, (16,), device=devices[0])
    expected = reference(x)
    F.cross_entropy(expected, y).backward()
    for chunks in (1, 4):
        model = copy.deepcopy(reference)
        model.zero_grad()
        parts, _ = split_layers(model, len(devices))
        out = Pipeline(model, parts, devices, chunks).eval()(x)
        torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-4)
        F.cross_entropy(out, y).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad.to(q.device), q.grad, rtol=1e-3, atol=1e-4, msg=name)
    return (
        f"outputs and gradients equal (fp32, TF32 off) for chunks 1 and 4 over "
        f"{[str(d) for d in devices]}"
    )


def check_loader_paths(device: torch.device, epochs: int = 2) -> str:
    """The set held on the device and the set copied per batch give identical batches."""
    from torch.utils.data import DistributedSampler

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (1000, 3, 32, 32), dtype=torch.uint8, generator=generator)
    data = ImageSet(images, torch.randint(0, 10, (1000,), generator=generator))

    def loader(on_device: bool) -> BatchLoader:
        sampler = DistributedSampler(range(len(data)), num_replicas=1, rank=0, seed=7)
        return BatchLoader(
            data,
            96,  # 10 full batches and a last one of 40: the staging buffers' partial use
            sampler,
            device,
            mean=(0.5, 0.4, 0.3),
            std=(0.25, 0.2, 0.3),
            augment=True,
            seed=7,
            on_device=on_device,
            memory_format=torch.channels_last,
        )

    held, copied = loader(True), loader(False)
    copy_path = "prefetch" if device.type == "cuda" else "host"
    assert (held.placement, copied.placement) == ("device", copy_path), (
        held.placement,
        copied.placement,
    )
    batches, first_labels = 0, []
    for epoch in range(1, epochs + 1):
        held.set_epoch(epoch)
        copied.set_epoch(epoch)
        for step, ((x, y), (x2, y2)) in enumerate(zip(held, copied, strict=True)):
            where = f"epoch {epoch} batch {step}"
            assert x.device == x2.device and x.device.type == device.type, (where, x.device)
            assert x.is_contiguous(memory_format=torch.channels_last), where
            assert torch.equal(y, y2), f"{where}: labels differ"
            assert torch.equal(x, x2), f"{where}: images differ, max {(x - x2).abs().max()}"
            if step == 0:
                first_labels.append(y)
            batches += 1
    assert not torch.equal(first_labels[0], first_labels[-1]), "set_epoch did not reshuffle"
    note = "" if device.type == "cuda" else " (CPU: the host path; the prefetcher needs CUDA)"
    return f"{batches} batches over {epochs} epochs identical: device vs {copy_path}{note}"


def check_grad_scaler_overflow(device: torch.device) -> str:
    """An inf gradient skips its step and halves the scale; the next step updates."""
    from torch.optim.lr_scheduler import LambdaLR

    torch.manual_seed(0)
    init_scale, note = 2.0**10, ""
    strategy = Strategy(
        ParallelismConfig(),
        device=device.type,
        precision=AmpConfig(init_scale=init_scale, growth_interval=1000),
    )
    strategy.setup()
    precision = strategy.precision
    if precision.scaler is None:  # a CPU: amp is bf16 autocast there, without a scaler
        precision.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
        note = " (CPU: this check set a GradScaler('cpu') on Precision; runs use none there)"
    elif strategy.device.type == "cuda":
        assert precision.compute_dtype is torch.float16, precision.compute_dtype
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10)).to(strategy.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    data = ImageSet(images, torch.randint(0, 10, (64,)))
    sampler = strategy.train_sampler(len(data), 0)
    loader = BatchLoader(data, 16, sampler, strategy.device, (0.5,) * 3, (0.25,) * 3, max_batches=1)
    scheduler = LambdaLR(optimizer, lambda _: 1.0)
    trainer = Trainer(model, optimizer, scheduler, strategy, 1, progress=False)
    poisoned = []

    def inject_inf(grad: torch.Tensor) -> torch.Tensor:
        if poisoned:
            return grad
        poisoned.append(True)
        grad = grad.clone()
        grad.view(-1)[0] = math.inf
        return grad

    hook = model[1].weight.register_hook(inject_inf)

    def params() -> list[torch.Tensor]:
        return [p.detach().clone() for p in model.parameters()]

    with warnings.catch_warnings():  # the scheduler steps after a skipped optimizer step
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        start = params()
        trainer.train_epoch(loader, epoch=1)  # the step with the inf gradient
        after_skip, scale_after_skip = params(), precision.grad_scale()
        trainer.train_epoch(loader, epoch=2)
        after_step, scale_after_step = params(), precision.grad_scale()
    hook.remove()
    assert poisoned, "the gradient hook never ran"
    assert all(torch.equal(a, b) for a, b in zip(start, after_skip, strict=True)), (
        "the step with an inf gradient changed the parameters"
    )
    assert scale_after_skip == init_scale / 2, f"scale {init_scale} -> {scale_after_skip}"
    changed = [not torch.equal(a, b) for a, b in zip(after_skip, after_step, strict=True)]
    assert all(changed), "the step after the overflow left parameters unchanged"
    assert all(torch.isfinite(p).all() for p in after_step), "non-finite parameters"
    assert scale_after_step == scale_after_skip, f"scale moved to {scale_after_step}"
    return (
        f"inf in one gradient: step skipped (parameters unchanged), scale {init_scale:g} -> "
        f"{scale_after_skip:g}; the next step updated them at scale {scale_after_step:g}{note}"
    )


def run_job(store: Path, name: str, *overrides: str, size: Sequence[str] = SMALL_RUN) -> dict:
    """`python run.py ...` as a user types it; returns the run's params and metrics. The jobs
    share one MLflow store, each in an experiment of its own name (a new store costs MLflow's
    schema migrations: seconds)."""
    uri = f"sqlite:///{store / 'mlflow.db'}"
    command = [
        sys.executable, "run.py", *size, *overrides,
        f"mlflow.tracking_uri={uri}", f"mlflow.experiment={name}", f"hydra.run.dir={store / name}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr}")
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    assert run.info.status == "FINISHED", run.info.status
    return {"params": run.data.params, "metrics": run.data.metrics, "tags": run.data.tags}


def parse_only(text: str | None) -> set[int] | None:
    """`--only 1,7,8` -> {1, 7, 8}; None: every check."""
    if not text:
        return None
    return {int(part) for part in text.split(",") if part.strip()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run every check on the CPU instead")
    parser.add_argument("--only", metavar="N,N", help="run only these checks, e.g. 1,7,8")
    parser.add_argument("--json", type=Path, help="also write the results here (JSON)")
    parser.add_argument(
        "--keep", action="store_true", help="keep the runs' folder even when every check passed"
    )
    args = parser.parse_args(argv)
    only = parse_only(args.only)
    gpus = 0 if args.cpu else torch.cuda.device_count()
    if not args.cpu and gpus == 0:
        print(
            "No CUDA GPU is visible: run this on a GPU machine, or with --cpu to test the script."
        )
        return 2
    if args.cpu:
        devices, device_flag = ["cpu", "cpu"], ["device=cpu"]
    else:
        devices, device_flag = (["cuda:0", "cuda:1"] if gpus >= 2 else ["cuda:0", "cuda:0"]), []
    per_replica = 2 if gpus >= 2 else 1
    replicas = max(1, gpus // 2) if gpus else 2
    placement = f"parallelism.devices=[{','.join(devices)}]"
    hybrid = (
        "parallelism=hybrid", f"parallelism.nprocs={replicas}",
        f"parallelism.devices_per_replica={per_replica}", "parallelism.stages=2",
        "parallelism.chunks=2", "model=resnet18",
    )  # fmt: skip
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}; {gpus} GPU(s): "
          f"{torch.cuda.get_device_name(0) if gpus else 'CPU run'}; stages on {devices}; "
          f"hybrid: {replicas} replica(s) x {per_replica} device(s)")  # fmt: skip

    store = Path(tempfile.mkdtemp(prefix="accelexp-gpu-check-"))
    size = CPU_RUN if args.cpu else SMALL_RUN

    def run(name: str, *overrides: str) -> dict:
        return run_job(store, name, *overrides, size=size)

    results: dict[str, str] = {}

    def check(name: str, fn: Callable[[], str]) -> None:
        if only is not None and int(name.split()[0]) not in only:
            return
        start = time.perf_counter()
        try:
            detail = fn()
            status = "SKIP" if detail.startswith("SKIP") else "PASS"
            results[name] = f"{status} ({time.perf_counter() - start:.0f}s) {detail}"
        except Exception as error:  # every check runs; the summary says which failed
            results[name] = f"FAIL {type(error).__name__}: {error}"
        print(f"{name}: {results[name]}", flush=True)

    def model_amp() -> str:
        job = run("model-amp", *device_flag, "parallelism=model", placement,
                  "parallelism.chunks=4", "precision=amp", "model=resnet18")  # fmt: skip
        params, metrics = job["params"], job["metrics"]
        assert [params["stage0_device"], params["stage1_device"]] == devices, params
        peaks = [metrics["stage0_peak_mem_mb"], metrics["stage1_peak_mem_mb"]]
        scale = metrics.get("grad_scale")
        if not args.cpu:
            assert scale and scale > 0, f"no GradScaler scale logged: {scale}"
        stage_params = f"{params['stage0_params']}/{params['stage1_params']}"
        return (f"test_acc {metrics['test_acc']:.3f}, grad_scale {scale}, stage params "
                f"{stage_params}, peak MiB {[round(p) for p in peaks]}")  # fmt: skip

    def model_bf16() -> str:
        job = run("model-bf16", *device_flag, "parallelism=model", placement,
                  "precision=bf16", "parallelism.balance=compute",
                  "model=resnet18")  # fmt: skip
        params, metrics = job["params"], job["metrics"]
        return f"split_points {params['split_points']}, test_acc {metrics['test_acc']:.3f}"

    def hybrid_run(sync: str) -> str:
        job = run(f"hybrid-{sync}", *device_flag, *hybrid,
                  f"parallelism.sync={sync}", "precision=amp")  # fmt: skip
        params = job["params"]
        shape = {k: params[k] for k in ("world_size", "replicas", "devices_per_replica")}
        assert int(params["replicas"]) == replicas, shape
        return f"{shape}, {job['metrics']['samples_per_s']:.0f} samples/s"

    def hybrid_horovod() -> str:
        try:
            import horovod.torch as hvd
        except ImportError as error:
            return f"SKIP Horovod is not importable ({error}); run make setup"
        if not args.cpu and not hvd.nccl_built():
            return "SKIP this Horovod has no GPU operations (built without NCCL)"
        return hybrid_run("horovod")

    def dp_run() -> str:
        job = run("dp", *device_flag, "parallelism=dp")
        params, metrics = job["params"], job["metrics"]
        assert int(params["num_devices"]) == max(1, gpus), params["num_devices"]
        assert params["device_type"] == ("cpu" if args.cpu else "cuda"), params["device_type"]
        return (
            f"{params['num_devices']} device(s) of type {params['device_type']}, "
            f"{metrics['samples_per_s']:.0f} samples/s, test_acc {metrics['test_acc']:.3f}"
        )

    def switches_run() -> str:
        switches = ("channels_last=true", "tf32=true", "compile=default", "optimizer_impl=fused")
        overrides = [f"speed.{switch}" for switch in switches]
        # val = test (one evaluation shape): the compiled model compiles its eval graph once
        job = run("switches", *device_flag, *overrides, "precision=amp",
                  "data.val_fraction=0")  # fmt: skip
        params, metrics, tags = job["params"], job["metrics"], job["tags"]
        expected = dict(switch.split("=") for switch in switches)
        expected["cudnn_benchmark"] = "true"  # the default
        wrong = {k: tags.get(k) for k, v in expected.items() if tags.get(k) != v}
        assert not wrong, f"tags {wrong}, expected {expected}"
        for key, value in expected.items():
            assert params.get(f"speed.{key}", "").lower() == value, (
                key,
                params.get(f"speed.{key}"),
            )
        assert "compile" in tags.get("speed", ""), tags.get("speed")
        compile_s = metrics.get("compile_s")
        assert compile_s and compile_s > 0, f"no compile_s logged: {compile_s}"
        scale = metrics.get("grad_scale")
        if not args.cpu:
            assert scale and scale > 0, f"no GradScaler scale logged: {scale}"
        return (
            f"speed={tags['speed']}, compile_s {compile_s:.1f}s, "
            f"{metrics['samples_per_s']:.0f} samples/s after it, grad_scale {scale}"
        )

    def fsdp_amp() -> str:
        # one worker per GPU (NCCL; Gloo with --cpu), fp16 + GradScaler over sharded (DTensor)
        # gradients, then the largest-batch search of the memory study
        workers = min(2, gpus) if gpus else 1
        job = run("fsdp-amp", *device_flag, "parallelism=fsdp",
                  f"parallelism.nprocs={workers}", "precision=amp", "model=resnet18",
                  "max_batch.search=true", "max_batch.limit=8192")  # fmt: skip
        params, metrics, tags = job["params"], job["metrics"], job["tags"]
        assert int(params["world_size"]) == workers, params["world_size"]
        state = metrics.get("state_mem_mb")
        assert state and state > 0, f"no state_mem_mb logged: {state}"
        scale, found = metrics.get("grad_scale"), metrics.get("max_batch")
        if args.cpu:  # no search on a CPU: the step's memory measured instead
            assert "not searched" in tags.get("max_batch", ""), tags.get("max_batch")
            assert metrics.get("step_peak_mb", 0) > 0, "no step_peak_mb logged"
        else:
            assert scale and scale > 0, f"no GradScaler scale logged: {scale}"
            assert found and found >= 64, f"max_batch {found}: {tags.get('max_batch')}"
        return (f"{workers} worker(s), grad_scale {scale}, state {state:.1f} MiB per worker, "
                f"test_acc {metrics['test_acc']:.3f}; max_batch {found} "
                f"({tags.get('max_batch')})")  # fmt: skip

    def fsdp_offload_vit() -> str:
        if args.cpu:
            return "SKIP parallelism.cpu_offload=true needs CUDA (shards in host memory)"
        job = run("fsdp-offload-vit", "parallelism=fsdp", "parallelism.nprocs=1",
                  "parallelism.cpu_offload=true", "precision=bf16",
                  "model=vit_tiny")  # fmt: skip
        metrics = job["metrics"]
        return (f"{metrics['samples_per_s']:.0f} samples/s, peak "
                f"{metrics.get('peak_mem_mb', float('nan')):.0f} MiB, state "
                f"{metrics.get('state_mem_mb', float('nan')):.1f} MiB on the GPU, test_acc "
                f"{metrics['test_acc']:.3f}")  # fmt: skip

    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    image_size = CPU_IMAGE_SIZE if args.cpu else 32
    check(
        "1 split == unsplit",
        lambda: check_same_numbers([torch.device(d) for d in devices], image_size),
    )
    check("2 model, amp (fp16 + GradScaler)", model_amp)
    check("3 model, bf16, balance=compute", model_bf16)
    check("4 hybrid, sync=ddp", lambda: hybrid_run("ddp"))
    check("5 hybrid, sync=horovod", hybrid_horovod)
    check("6 dp", dp_run)
    check("7 speed switches (cl, tf32, compile, fused, amp)", switches_run)
    check("8 data on device == copied per batch", lambda: check_loader_paths(device))
    check("9 GradScaler overflow", lambda: check_grad_scaler_overflow(device))
    check("10 fsdp, amp, largest-batch search", fsdp_amp)
    check("11 fsdp, cpu_offload, bf16, vit_tiny", fsdp_offload_vit)
    for path in (store / "results.json", args.json):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=2))
    failed = [name for name, result in results.items() if result.startswith("FAIL")]
    summary = f"\n{len(results) - len(failed)}/{len(results)} passed or skipped"
    if failed or args.keep:  # the runs of a failed check are what to look at
        print(f"{summary}; runs in {store}")
    else:
        shutil.rmtree(store, ignore_errors=True)
        print(f"{summary}; runs removed (--keep keeps them)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
