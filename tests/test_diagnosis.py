"""Where the time goes, and what bounds a run: each verdict made to happen for real, on a CPU.

An input pipeline slowed on purpose is input-bound; two Gloo workers on a model with many
parameters and a tiny batch are communication-bound, with a communication time that matches an
allreduce of the same size measured on its own; a tiny model with a tiny batch is
overhead-bound; a plain CNN at a normal batch is compute-bound. Out-of-memory errors end a run
with one message, and a sweep goes on past them.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import compose_config, new_store, only_run, output_of
from mlflow import MlflowClient

from accelexp import activation_checkpoint
from accelexp.advice import is_command
from accelexp.config import typed
from accelexp.config.resources import usable_cores
from accelexp.diagnosis.noise import NoiseSample
from accelexp.diagnosis.run import RunDiagnosis
from accelexp.diagnosis.verdict import ROOM_SHARE, RunFacts, diagnose, usable
from accelexp.engine import eager_warmup_steps
from accelexp.launch import launch
from accelexp.machine import IDLE_CORES_MIN, Machine
from accelexp.models import build_model
from accelexp.parallel import build_strategy, connect
from accelexp.parallel.ddp import TimedAllreduce
from accelexp.parallel.world import World, WorldShape
from accelexp.processes import JOB_ENV
from accelexp.timing import BACKWARD, FORWARD, INPUT, Breakdown, CommTime, StepClock
from accelexp.train import run

TIME_PARTS = [f"time/{p}_s" for p in Breakdown.PARTS]


def diagnosis_of(tracking_uri: str) -> tuple[dict[str, float], dict[str, str], str]:
    """(last metrics, tags, diagnosis.md) of the store's only run."""
    record = only_run(tracking_uri)
    path = MlflowClient(tracking_uri).download_artifacts(record.info.run_id, "diagnosis.md")
    return record.data.metrics, record.data.tags, Path(path).read_text()


# --- the accounting itself ----------------------------------------------------------------------


def test_the_phases_add_up_to_the_wall_time_and_waits_move_into_comm():
    clock = StepClock(torch.device("cpu"))
    start = time.perf_counter()
    clock.start()
    for _ in range(3):
        time.sleep(0.01)
        clock.mark(INPUT)
        time.sleep(0.02)
        clock.mark(FORWARD)
        time.sleep(0.03)
        clock.mark(BACKWARD)
    comm = CommTime()
    comm.wait("backward", 0.05)
    backward = clock.seconds[BACKWARD]  # as marked: a loaded machine oversleeps (0.086 s seen)
    breakdown = clock.stop(comm)
    wall = time.perf_counter() - start
    # every slept second is in a phase, none twice (a tolerance against the outer clock read
    # 0.1819 against 0.1857 s on a loaded machine: the statements around the clock take time)
    assert 3 * (0.01 + 0.02 + 0.03) <= breakdown.wall <= wall
    assert breakdown.input >= 0.03 and breakdown.forward >= 0.06 and backward >= 0.09
    # the wait moves out of the backward phase into comm, whole
    assert breakdown.comm == pytest.approx(0.05)
    assert breakdown.backward == pytest.approx(backward - 0.05)
    assert Breakdown.from_tensor(breakdown.to_tensor(torch.device("cpu"))) == breakdown


def test_a_timed_allreduce_counts_overlapping_buckets_once():
    timer = TimedAllreduce(hook=None)
    # three buckets: [0, 2] and [1, 3] overlap, [5, 6] alone; the last handed over at 5
    timer.buckets = [(0.0, [2.0]), (1.0, [3.0]), (5.0, [6.0])]
    timer.step_done()
    assert timer.comm.inflight == pytest.approx(4.0)
    assert timer.comm.exposed == {"backward": pytest.approx(1.0)}
    assert timer.buckets == []


# --- each verdict, from a real run -------------------------------------------------------------


@pytest.mark.alone  # a verdict read from timings: no other test beside it
def test_a_slowed_input_pipeline_is_input_bound(compose_cfg, tmp_path, tracking_uri):
    delay_ms, steps = 40, 6
    cfg = compose_cfg(
        "model=mlp", f"debug.input_delay_ms={delay_ms}", f"max_steps_per_epoch={steps}"
    )
    run(cfg, tmp_path / "out")
    metrics, tags, report = diagnosis_of(tracking_uri)
    assert tags["diagnosis"] == "input", report
    timed = steps - eager_warmup_steps(steps)  # the first epoch's warm-up steps are not timed
    assert metrics["time/input_s"] >= 0.9 * timed * delay_ms / 1e3
    assert metrics["time/input_s"] / sum(metrics[k] for k in TIME_PARTS) >= 0.5
    assert tags["diagnosis_next"] == "data.num_workers=2"
    assert "input-bound" in report and "data.num_workers=2" in report


@pytest.mark.alone  # a verdict read from timings: no other test beside it
def test_a_tiny_model_with_a_tiny_batch_is_overhead_bound(compose_cfg, tmp_path, tracking_uri):
    cfg = compose_cfg(
        "model=mlp", "model.widths=[8]", "data.batch_size=2", "max_steps_per_epoch=60"
    )
    run(cfg, tmp_path / "out")
    metrics, tags, report = diagnosis_of(tracking_uri)
    assert tags["diagnosis"] == "overhead", report
    assert metrics["flop_utilisation"] < 0.05
    assert metrics["peak_gflops"] > 1  # this CPU's matmul, measured
    assert tags["diagnosis_next"] == "data.batch_size=4"


@pytest.mark.alone  # a verdict read from timings: no other test beside it
def test_a_cnn_at_a_normal_batch_is_compute_bound(compose_cfg, tmp_path, tracking_uri):
    """... and, on one thread (the tests' default), is offered more workers: it left the
    machine's other cores idle, measured while it was timed."""
    cfg = compose_cfg("data.batch_size=128", "data.image_size=28", "max_steps_per_epoch=8")
    run(cfg, tmp_path / "out")
    metrics, tags, report = diagnosis_of(tracking_uri)
    assert tags["diagnosis"] == "compute", report
    assert metrics["flop_utilisation"] >= 0.05
    assert metrics["time/input_s"] / sum(metrics[k] for k in TIME_PARTS) < 0.25
    assert cfg.threads == 1 and idle_cores(metrics) >= IDLE_CORES_MIN, report
    cores = usable_cores()
    assert f"`parallelism=ddp parallelism.nprocs={cores} threads=1`" in report  # 1 each


@pytest.mark.alone  # reads the cores the run kept busy: no other test beside it
def test_a_run_that_kept_every_core_busy_is_offered_no_more_workers(
    compose_cfg, tmp_path, tracking_uri
):
    """Whatever bounds it (on this shared machine a 2-thread run is often contended by the
    hypervisor's steal), no more workers, and the evidence says why."""
    cores = usable_cores()
    cfg = compose_cfg(
        "data.batch_size=128", "data.image_size=28", "max_steps_per_epoch=8", f"threads={cores}"
    )
    run(cfg, tmp_path / "out")
    metrics, _, report = diagnosis_of(tracking_uri)
    if idle_cores(metrics) >= IDLE_CORES_MIN:
        pytest.skip(f"{cores} threads left cores idle on this machine: {report}")
    assert "parallelism.nprocs" not in report
    assert f"all {cores} usable cores busy while timed" in report


def idle_cores(metrics: dict[str, float]) -> float:
    """The cores a run left idle while timed, from its logged `noise/*` figures."""
    cores, busy = metrics["noise/host_cores"], metrics["noise/job_cores"]
    return cores * (1 - metrics["noise/steal"]) - busy - metrics["noise/others_cores"]


@pytest.mark.alone  # a verdict read from timings: no other test beside it
@pytest.mark.slow
def test_two_gloo_workers_on_a_big_model_with_a_tiny_batch_are_communication_bound(
    tmp_path, mlflow_template_db
):
    steps = 20
    big_and_tiny = (
        "model=mlp",
        "model.widths=[1024,1024]",
        "data.batch_size=2",
        f"max_steps_per_epoch={steps}",
        "parallelism=ddp",
        "parallelism.nprocs=2",
    )
    synced = new_store(tmp_path / "synced", mlflow_template_db)
    launch(compose_config(synced, *big_and_tiny), tmp_path / "synced" / "out")
    metrics, tags, report = diagnosis_of(synced)
    assert tags["diagnosis"] == "communication", report
    assert tags["diagnosis_next"] == "parallelism.accumulate_steps=4"
    assert "parallelism.comm_hook=fp16" in report
    wall = sum(metrics[k] for k in TIME_PARTS)
    assert metrics["time/comm_s"] / wall >= 0.3, report
    assert metrics["time/comm_inflight_s"] >= metrics["time/comm_s"]
    # measured directly: the same run with its gradient allreduce skipped (no_sync) on all
    # steps but the last. The time a step saves outside the optimizer (which steps only once
    # there) is the communication it waited for.
    unsynced = new_store(tmp_path / "unsynced", mlflow_template_db)
    launch(
        compose_config(unsynced, *big_and_tiny, f"parallelism.accumulate_steps={steps}"),
        tmp_path / "unsynced" / "out",
    )
    quiet, _, _ = diagnosis_of(unsynced)
    not_optimizer = [k for k in TIME_PARTS if k != "time/optimizer_s"]
    saved = sum(metrics[k] - quiet[k] for k in not_optimizer) / (steps - 1)
    waited = (metrics["time/comm_s"] - quiet["time/comm_s"]) / (steps - 1)
    print(f"communication per step: accounted {waited:.4f} s, saved without it {saved:.4f} s")
    # below 1: on 2 shared cores, Gloo's reductions also slow the backward's compute a little
    assert 0.6 * saved <= waited <= 1.25 * saved, (waited, saved)


# --- the verdict's rules ------------------------------------------------------------------------


def facts(device: str = "cpu", **parts: float) -> RunFacts:
    return RunFacts(Breakdown(**parts), device, batch_size=64, flop_utilisation=0.3)


def test_the_rules_in_order():
    assert diagnose(facts(input=3, forward=1, comm=2)).bound == "input"
    assert diagnose(facts(input=2, forward=1, comm=3)).bound == "communication"
    assert diagnose(facts(forward=1, backward=2)).bound == "compute"
    busy = facts("cuda", forward=1, backward=2)
    busy.breakdown.gpu_busy = 0.3
    verdict = diagnose(busy)
    assert verdict.bound == "overhead"
    assert verdict.advice[0][0] == "speed.compile=reduce-overhead"
    full = facts("cuda", forward=1, backward=2)
    full.peak_mem_mb, full.device_mem_mb = 950.0, 1000.0
    assert diagnose(full).bound == "memory"


def overrides_of(verdict) -> list[str]:
    return [override for override, _ in verdict.advice]


def test_a_compute_bound_gpu_run_is_offered_the_speed_switches_and_a_batch_that_fits():
    """What autotune tries on a GPU: compile among the switches; a doubled batch only where the
    step peaked well below the device's memory (`ROOM_SHARE`)."""
    roomy = facts("cuda", forward=1, backward=2)
    roomy.peak_mem_mb, roomy.device_mem_mb = 0.1 * 1000, 1000.0
    advice = overrides_of(diagnose(roomy))
    assert "speed.compile=default" in advice and "data.batch_size=128" in advice
    tight = facts("cuda", forward=1, backward=2)
    tight.peak_mem_mb, tight.device_mem_mb = (ROOM_SHARE + 0.1) * 1000, 1000.0
    assert "data.batch_size=128" not in overrides_of(diagnose(tight))


def scale_out(cfg, machine: Machine, world: World | None = None, devices: int = 1):
    """The strategy of `cfg`'s advice for more devices, as if set up in `world` (of one)."""
    strategy, world = build_strategy(typed(cfg)), world or World()
    strategy.world, strategy.shape = world, WorldShape(world.world_size, devices)
    return strategy.scale_out_advice(machine)


FOUR_GPUS = Machine("cuda", cores=16, gpus=4)
IDLE_CORE = Machine("cpu", cores=2, threads=1, job_cores=1.0, others_cores=0.04, worker_cores=1.0)
ACCELEXPS_TWO = World(0, 2, 0, "torchrun", by_accelexp=True)  # parallelism.nprocs=2 started it


def test_the_advice_is_the_runs_own(compose_cfg):
    """Nothing the run does already, nothing its config would refuse; more devices only where
    the machine has them idle; channels_last only for convolutions and only where it is off."""
    compute = facts("cuda", forward=1, backward=2)
    single = overrides_of(diagnose(compute))  # no config: every piece of advice
    assert single[:2] == ["precision=bf16", "precision=amp"]
    assert "speed.channels_last=true" in single
    assert not any("nprocs" in override for override in single)  # no machine: no more devices

    compute.config = compose_cfg("parallelism=ddp", "parallelism.nprocs=2", "precision=bf16")
    compute.scale_out = scale_out(compute.config, FOUR_GPUS, ACCELEXPS_TWO)
    compute.in_effect = {"speed.channels_last": "true"}  # what `auto` chose
    advice = overrides_of(diagnose(compute))
    assert advice == [
        "precision=amp",
        "speed.tf32=true",
        "speed.compile=default",
        "parallelism.nprocs=4",
    ]
    compute.in_effect, compute.convolutional = {}, False  # a ViT: no NHWC layout to offer
    assert "speed.channels_last=true" not in overrides_of(diagnose(compute))
    compute.config = compose_cfg("parallelism=model")
    compute.scale_out = scale_out(compute.config, FOUR_GPUS, devices=2)  # 2 stages
    assert overrides_of(diagnose(compute))[-1] == "parallelism=hybrid parallelism.nprocs=2"
    # on a CPU, amp is bf16 autocast: a run with either is offered neither
    on_cpu = facts("cpu", forward=1, backward=2)
    on_cpu.config = compose_cfg("precision=amp")
    on_cpu.in_effect = {"precision": "bf16"}  # amp on a CPU: Precision.effective_name
    on_cpu.scale_out = scale_out(on_cpu.config, IDLE_CORE)
    assert overrides_of(diagnose(on_cpu)) == ["parallelism=ddp parallelism.nprocs=2 threads=1"]

    # bf16_true computes in bf16 with bf16 weights: neither bf16 nor amp is offered to it
    bf16_weights = facts("cuda", forward=1, backward=2)
    bf16_weights.config = compose_cfg("precision=bf16_true")
    bf16_weights.in_effect = {"precision": "bf16_true"}  # Precision.effective_name
    assert not any(o.startswith("precision=") for o in overrides_of(diagnose(bf16_weights)))

    # fsdp refuses CUDA graphs: the overhead verdict offers the bigger batch and fused kernels
    busy = facts("cuda", forward=1, backward=2)
    busy.breakdown.gpu_busy = 0.3
    busy.config = compose_cfg("parallelism=fsdp")
    assert overrides_of(diagnose(busy)) == ["data.batch_size=128", "speed.compile=default"]
    busy.config = compose_cfg("parallelism=fsdp", "speed.compile=default")  # compiled already
    assert overrides_of(diagnose(busy)) == ["data.batch_size=128"]

    full = facts("cuda", forward=1, backward=2)
    full.peak_mem_mb, full.device_mem_mb = 950.0, 1000.0
    full.config = compose_cfg("parallelism=ddp")  # no reshard_after_forward in ddp's config
    assert overrides_of(diagnose(full))[2:5] == [
        "precision=bf16_true",  # the model's state in bf16: half its memory
        "data.batch_size=32 parallelism.accumulate_steps=2",
        "parallelism=fsdp",
    ]
    full.config = compose_cfg("parallelism=fsdp", "parallelism.reshard_after_forward=false")
    advice = overrides_of(diagnose(full))
    assert "parallelism=fsdp" not in advice
    assert "parallelism.reshard_after_forward=true" in advice


CHECKPOINT = "speed.activation_checkpointing=full"


def test_a_memory_bound_model_with_blocks_is_offered_activation_checkpointing(compose_cfg):
    """After the run's own ways (precision, a halved batch), before the strategies': only to a
    model with blocks to checkpoint, not to one checkpointing all of them already."""
    full = facts("cuda", forward=1, backward=2)
    full.peak_mem_mb, full.device_mem_mb = 950.0, 1000.0
    full.config = compose_cfg("parallelism=ddp", "model=vit_tiny")
    assert CHECKPOINT not in overrides_of(diagnose(full))  # not known to have blocks
    full.checkpointable = True
    assert overrides_of(diagnose(full))[3:6] == [
        "data.batch_size=32 parallelism.accumulate_steps=2",
        CHECKPOINT,
        "parallelism=fsdp",
    ]
    # every 2nd block checkpointed (the word SpeedSwitches.tags logs): all of them saves more
    full.config = compose_cfg("model=vit_tiny", "speed.activation_checkpointing=selective")
    full.in_effect = {"speed.activation_checkpointing": "every2"}
    assert CHECKPOINT in overrides_of(diagnose(full))
    full.config = compose_cfg("model=vit_tiny", CHECKPOINT)
    full.in_effect = {"speed.activation_checkpointing": "full"}
    assert CHECKPOINT not in overrides_of(diagnose(full))
    # a memory lever costs speed: never what a compute-bound run is offered
    compute = replace(facts("cuda", forward=1, backward=2), checkpointable=True)
    assert CHECKPOINT not in overrides_of(diagnose(compute))


def test_out_of_memory_offers_activation_checkpointing_to_a_model_with_blocks(compose_cfg):
    cfg = compose_cfg("model=vit_tiny", "device=cpu")
    strategy = connect(typed(cfg))
    error = RuntimeError("DefaultCPUAllocator: can't allocate memory")
    for checkpointable, in_effect, offered in [
        (False, "none", False), (True, "none", True), (True, "full", False),
    ]:  # fmt: skip
        diagnosis = RunDiagnosis(
            strategy, cfg, None, {"speed.activation_checkpointing": in_effect},
            convolutional=False, checkpointable=checkpointable,
        )  # fmt: skip
        message = str(diagnosis.out_of_memory(error, epoch=1))
        assert "Ways out: precision=bf16" in message
        assert (CHECKPOINT in message) is offered, message


def test_which_models_have_blocks_to_checkpoint(compose_cfg):
    """Asked of the model a strategy's `unwrap` gives back: its blocks checkpointed or not."""
    cfg = compose_cfg("model=vit_tiny", "model.dim=32", "model.depth=2", "model.heads=2")
    for mode, option in [("none", "2"), ("selective", "2"), ("full", "2")]:
        vit = build_model(typed(cfg).model, 3, 10, 16)
        activation_checkpoint.apply(vit, mode, option)  # selective: 1 of 2 blocks wrapped
        assert activation_checkpoint.checkpointable(vit), mode
    simple = build_model(typed(compose_cfg("model=simple_cnn")).model, 3, 10, 16)
    assert not activation_checkpoint.checkpointable(simple)
    assert not activation_checkpoint.checkpointable(torch.nn.Linear(2, 2))  # no layer sequence


# --- more devices: only where the machine has them idle -----------------------------------------


@pytest.mark.parametrize(
    ("cores", "threads", "workers", "job", "others", "expected"),
    [
        (2, 1, 1, 1.02, 0.03, (2, 1)),  # threads=1 on 2 cores: a core idle
        (2, 2, 1, 1.95, 0.02, None),  # the default run: both cores busy
        (2, 1, 1, 1.02, 0.60, None),  # the idle core was another process's
        (2, 1, 2, 1.98, 0.00, None),  # 2 workers x 1 thread: all busy
        (8, 2, 1, 2.05, 0.10, (4, 2)),  # one worker kept its 2 threads busy
        (8, 8, 1, 2.30, 0.00, (4, 2)),  # ... of 8: it kept 2 cores busy, workers get 2
        (8, 1, 2, 2.10, 0.00, (8, 1)),  # 2 workers x 1 thread on 8 cores
        (6, 6, 1, 4.10, 0.00, (2, 3)),  # 4 busy: 3 threads each, the divisor of 6 below 4
        (8, 4, 2, 7.40, 0.00, None),  # 2 x 4 threads, 0.6 idle: no more workers fit
        (2, 1, 1, None, None, None),  # not measured: nothing assumed
    ],
)
def test_more_workers_on_a_cpu_only_where_cores_were_idle(
    cores, threads, workers, job, others, expected
):
    worker = None if job is None else job / workers  # each worker's share of the job's
    machine = Machine("cpu", cores, threads, 0, job, others, worker)
    room = machine.room(workers)
    assert (room and (room.workers, room.threads)) == expected
    if room is not None:
        assert room.workers * room.threads == cores  # threads that sum to the cores
        assert f"{machine.idle_cores:.1f} of them idle while timed" in room.why


@pytest.mark.parametrize(
    ("gpus", "workers", "per_worker", "expected"),
    [
        (8, 1, 1, 8),  # one GPU of 8 in use
        (1, 1, 1, None),  # the only one
        (8, 8, 1, None),  # all in use
        (8, 2, 2, 4),  # 2 replicas of 2 stages: 4 fit
        (8, 1, 8, None),  # DataParallel over all of them
        (3, 1, 2, None),  # a third GPU, but not a second replica's two
    ],
)
def test_more_workers_on_a_gpu_only_where_more_are_visible(gpus, workers, per_worker, expected):
    room = Machine("cuda", cores=16, gpus=gpus).room(workers, per_worker)
    assert (room and room.workers) == expected
    assert room is None or room.threads is None


def test_no_idle_cores_no_scale_out_and_the_evidence_says_so(compose_cfg):
    busy = Machine("cpu", 2, threads=2, job_cores=1.93, others_cores=0.04, worker_cores=1.93)
    compute = facts("cpu", forward=1, backward=2)
    compute.config = compose_cfg("threads=2")
    compute.scale_out, compute.machine = scale_out(compute.config, busy), busy
    verdict = diagnose(compute)
    assert verdict.bound == "compute" and overrides_of(verdict) == ["precision=bf16"]
    assert "all 2 usable cores busy while timed (busiest epoch: the job's 1.9, others' 0.0)" in (
        verdict.markdown("run")
    )
    compute.machine = IDLE_CORE
    assert "1.0 of the 2 usable cores idle while timed" in diagnose(compute).markdown("run")


def test_the_measured_path_from_recorded_samples(compose_cfg, monkeypatch):
    """What RunDiagnosis makes of each epoch's contention figures: the epoch that left the
    fewest cores idle decides. Figures recorded on this 2-core machine (machine.py)."""
    cfg = compose_cfg("threads=1")
    strategy = connect(typed(cfg))
    diagnosis = RunDiagnosis(strategy, cfg, flops_per_sample=None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the run's, as train.run sets
    quiet = NoiseSample(2.0, 0.99, 0.03, 2, 0.0, 1.1, 1.1, job_cores=1.01)
    diagnosis.noise = [quiet, replace(quiet, others_cores=0.3)]
    machine = diagnosis.machine()
    assert machine.idle_cores == pytest.approx(2 - 1.01 - 0.3)
    assert strategy.scale_out_advice(machine) == (
        "parallelism=ddp parallelism.nprocs=2 threads=1",
        "2 workers × 1 thread on the 2 cores: 0.7 of them idle while timed",
    )
    diagnosis.noise.append(replace(quiet, job_cores=1.9))  # an epoch that kept both busy
    assert strategy.scale_out_advice(diagnosis.machine()) is None


LAUNCHERS = {
    "torchrun": {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
    "horovodrun": {
        "HOROVOD_RANK": "0",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "2",
    },
    "srun": {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_NODEID": "1",
    },
    "mpirun": {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    },
}


@pytest.mark.parametrize(
    ("launcher", "on_gpus", "on_cpus"),
    [  # a world of 2 hosts x 2 processes; each host has 4 GPUs, or 8 cores with 6 idle
        ("torchrun", "--nnodes=2 --nproc-per-node=4", "--nnodes=2 --nproc-per-node=8"),
        ("horovodrun", "-np 8 -H host1:4,host2:4", "-np 16 -H host1:8,host2:8"),
        ("srun", "--ntasks=8 --ntasks-per-node=4", "--ntasks=16 --ntasks-per-node=8"),
        ("mpirun", "-np 8 --map-by ppr:4:node", "-np 16 --map-by ppr:8:node"),
    ],
    ids=list(LAUNCHERS),
)
def test_in_a_launchers_world_more_workers_are_its_own_flags(
    compose_cfg, monkeypatch, launcher, on_gpus, on_cpus
):
    """Not `parallelism.nprocs`, which a joined world ignores: a command, shown as it is, never
    validated as an override nor the `diagnosis_next`."""
    monkeypatch.delenv(JOB_ENV, raising=False)
    for name, value in LAUNCHERS[launcher].items():
        monkeypatch.setenv(name, value)
    cfg = compose_cfg("parallelism=ddp")
    strategy = build_strategy(typed(cfg))
    strategy.world = world = strategy.sync.join()  # reads the launcher's environment
    assert (world.world_size, world.per_host, world.hosts) == (4, 2, 2)
    strategy.shape = WorldShape(world.world_size)
    advice = strategy.scale_out_advice(FOUR_GPUS)
    assert advice[0] == f"$ {launcher} {on_gpus} …" and is_command(advice)
    idle = Machine("cpu", 8, threads=1, job_cores=2.0, others_cores=0.0, worker_cores=1.0)
    assert strategy.scale_out_advice(idle)[0] == f"$ {launcher} {on_cpus} … threads=1"

    compute = facts("cuda", forward=1, backward=2)
    compute.config, compute.scale_out = cfg, advice
    verdict = diagnose(compute)
    assert verdict.advice[-1] == advice  # kept: not an override to validate
    assert usable([advice], cfg) == [advice]
    assert verdict.tags()["diagnosis_next"] == "precision=bf16"
    assert f"- `{advice[0]}` — 4 workers on the 4 GPUs visible here (2 used)" in (
        verdict.markdown("run")
    )
    # accelexp's own launcher made the world: parallelism.nprocs sizes it
    monkeypatch.setenv(JOB_ENV, "a-job")
    strategy.world = strategy.sync.join()
    assert strategy.scale_out_advice(FOUR_GPUS)[0] == "parallelism.nprocs=4"


def test_a_command_is_never_the_next_override(compose_cfg):
    """A launcher's command (accelexp.advice) is kept as it is, and no `diagnosis_next`."""
    bf16 = facts("cpu", forward=1, backward=2)
    bf16.config = compose_cfg("parallelism=ddp", "precision=bf16")
    bf16.scale_out = ("$ torchrun --nnodes=1 --nproc-per-node=2 … threads=1", "2 workers")
    verdict = diagnose(bf16)
    assert verdict.advice == [bf16.scale_out]  # the only advice left
    assert verdict.tags()["diagnosis_next"] == ""
    assert verdict.tags()["diagnosis_advice"] == "[]"  # nothing for autotune to try
    assert "try $ torchrun --nnodes=1 --nproc-per-node=2 … threads=1: 2 workers" in (
        verdict.console()
    )


# --- out of memory ------------------------------------------------------------------------------


@pytest.mark.slow
def test_out_of_memory_is_one_message_a_failed_run_and_a_sweep_goes_on(tmp_path, tracking_uri, cli):
    uri = tracking_uri
    result = cli(
        "-m",
        "data=synthetic",
        "data.num_train=256",
        "data.image_size=16",
        "data.batch_size=32",
        "epochs=1",
        "max_steps_per_epoch=3",
        "progress=false",
        "debug.raise_oom_at_step=2,null",  # the first job runs out of memory, the second not
        f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    output = output_of(result)
    assert result.returncode == 1, output
    assert "Out of memory on cpu in epoch 1 with data.batch_size=32 (peak" in output
    assert "precision=bf16" in output and "parallelism.accumulate_steps=2" in output
    assert "Traceback" not in output
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("accelexp").experiment_id])
    status = {
        r.data.params["debug.raise_oom_at_step"]: r.info.status
        for r in runs
        if "mlflow.parentRunId" in r.data.tags
    }
    assert status == {"2": "FAILED", "None": "FINISHED"}, status


def test_htas_figures_are_evidence_when_the_gpu_was_profiled():
    profiled = facts("cuda", forward=1, backward=2)
    profiled.hta = {"hta/idle_pct": 42.0, "hta/idle_host_wait_pct": 90.0, "hta/compute_pct": 50.0}
    evidence = diagnose(profiled).markdown("run")
    assert (
        "HTA (profiled steps): GPU idle 42% (host wait 90% of it), compute kernels 50%" in evidence
    )
