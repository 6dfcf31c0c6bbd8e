"""Data parallelism on the real engines: DDP over Gloo (torchrun) and Horovod (horovodrun --gloo).

Every multi-worker test here starts real worker processes on this machine's CPU: through
`accelexp.launch`, the way `python run.py parallelism=... parallelism.nprocs=2` does, or as
`python run.py` joining a world its launcher made (torchrun, horovodrun, srun's environment).
A sweep over worker counts, one run per job: DDP's, the README's scaling sweep
(tests/test_sweeps.py); Horovod's, tests/test_signals.py (its 2-worker job stopped by a signal).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, built_once, new_store, output_of, store_uri
from mlflow import MlflowClient

from accelexp import parallel
from accelexp.config import ConfigError, typed
from accelexp.launch import exits, failures, launch
from accelexp.launch.output import ConsoleFilter
from accelexp.parallel import build_strategy, connect
from accelexp.parallel.base import ShardSampler
from accelexp.parallel.rules import several_workers
from accelexp.parallel.world import World, WorldShape, current_world, free_port
from accelexp.processes import JOB_ENV

STRATEGIES = ("ddp", "horovod")


# The worlds a user's launcher makes, run.py joining them (`python -m torch.distributed.run` is
# torchrun), each with its sync's fp16 gradient compression under AMP: one launch per launcher,
# shared by the tests that join, write and train in it (`joined_world`)
LAUNCHERS = {
    "torchrun": (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
        ["parallelism=ddp", "parallelism.comm_hook=fp16"],
        "RANK",
    ),
    "horovodrun": (
        [str(Path(sys.executable).with_name("horovodrun")), "-np", "2", "-H", "localhost:2",
         "--gloo", sys.executable],
        ["parallelism=horovod", "parallelism.compression=fp16"],
        "HOROVOD_RANK",
    ),
}  # fmt: skip
JOINED_EPOCHS = 2


@pytest.fixture
def joined_world(tmp_path_factory, mlflow_template_db):
    """`joined_world(launcher)` -> (its folder, its store, the finished launcher process) of
    `LAUNCHERS[launcher] run.py ...`, run once per test session (`conftest.built_once`). Each
    rank's Hydra makes its own run folder, `rank<N>` (as on nodes without a shared filesystem)."""

    def made_by(launcher: str) -> tuple[Path, str, subprocess.CompletedProcess]:
        command, strategy, rank = LAUNCHERS[launcher]

        def run(folder: Path) -> subprocess.CompletedProcess:
            uri = new_store(folder, mlflow_template_db)
            return subprocess.run(
                [
                    *command,
                    "run.py",
                    *strategy,
                    "parallelism.nprocs=1",  # inside a world its size is the launcher's
                    "precision=amp",  # bf16 autocast on a CPU
                    "data=synthetic",
                    "data.num_train=256",
                    "data.num_test=64",
                    "data.image_size=16",
                    "data.batch_size=32",
                    f"epochs={JOINED_EPOCHS}",
                    "max_steps_per_epoch=2",
                    "progress=false",
                    "threads=1",
                    f"mlflow.tracking_uri={uri}",
                    f"hydra.run.dir={folder}/rank${{oc.env:{rank}}}",
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=300,
            )

        folder, result = built_once(tmp_path_factory, f"joined-{launcher}", run)
        assert result.returncode == 0, output_of(result)
        return folder, store_uri(folder), result

    return made_by


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_run_py_joins_a_world_its_launcher_made(launcher, joined_world):
    _, uri, _ = joined_world(launcher)
    runs = MlflowClient(uri).search_runs(["1"])
    assert len(runs) == 1  # only rank 0 tracks
    assert runs[0].data.params["world_size"] == "2"
    # the config takes the world's size (its checks too: a pipeline's pp must divide it)
    assert runs[0].data.params["parallelism.nprocs"] == "2"
    assert runs[0].info.status == "FINISHED"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_joined_world_needs_no_shared_folder(launcher, joined_world):
    """Each rank's Hydra makes its own run folder: only rank 0 writes, and the others get the
    best weights from it, not from its disk."""
    folder, _, _ = joined_world(launcher)
    assert (folder / "rank0" / "checkpoints" / "best.pt").is_file()
    assert not (folder / "rank1" / "checkpoints").exists(), "only rank 0 writes"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "launcher"), [("ddp", "torchrun"), ("horovod", "horovodrun")]
)  # the gradients through DDP's comm_hook=fp16, Horovod's compression=fp16: `LAUNCHERS`
def test_amp_with_fp16_gradient_compression_trains(name, launcher, joined_world):
    _, uri, _ = joined_world(launcher)
    client = MlflowClient(uri)
    (run,) = client.search_runs(["1"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["parallelism"] == name
    assert run.data.tags["precision"] == "amp"
    assert all(math.isfinite(v) for v in run.data.metrics.values())
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in history] == list(range(1, JOINED_EPOCHS + 1))


@pytest.mark.parametrize(("hook", "compressed"), [("fp16", True), ("none", False)])
def test_ddp_fp16_compression_sends_the_gradients_as_fp16(hook, compressed, compose_cfg):
    """The gradients a step applies went through fp16 (each one a value fp16 can hold) exactly
    when the comm hook compresses: DDP allreduces through its hook in a world of one process too.
    (Horovod skips its allreduce in a world of one, so its compression shows in two workers only.)
    """
    strategy = connect(typed(compose_cfg("parallelism=ddp", f"parallelism.comm_hook={hook}")))
    try:
        torch.manual_seed(0)
        model = strategy.wrap_model(torch.nn.Linear(64, 8))
        model(torch.randn(16, 64)).square().mean().backward()
        grads = [p.grad for p in model.parameters()]
        as_fp16 = [torch.equal(g, g.half().float()) for g in grads]
        assert all(as_fp16) if compressed else not any(as_fp16)
    finally:
        strategy.teardown()


def leftover_workers(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or []):
            found.append(proc)
    return found


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_worker_killed_without_a_word_is_named_as_the_cause_and_nothing_is_left(
    name, tmp_path, tracking_uri, cli
):
    """rank 1 dies by SIGKILL (as by the OOM killer): no error of its own, only its launcher's
    record; rank 0 then fails on the lost connection (its own error, recorded as a worker's error
    is). `python run.py` (its main, in this process) exits 2; the message names rank 1 and its
    signal first, in a few lines, and the file where every worker's output is; the console showed
    the workers' log records, not their tracebacks. The job, not the workers, closes the run:
    FAILED, its error.txt the message, what was logged kept."""
    result = cli(
        f"parallelism={name}",
        "parallelism.nprocs=2",
        "debug.raise_on_rank=1",
        "debug.raise_as=SIGKILL",
        "debug.raise_at_step=2",
        "data=synthetic",
        "data.num_train=256",
        "data.num_test=128",
        "data.batch_size=32",
        "data.image_size=16",
        "epochs=1",
        "max_steps_per_epoch=5",
        "progress=false",
        "threads=1",
        f"mlflow.tracking_uri={tracking_uri}",
        tmp_path=tmp_path,
    )
    assert result.returncode == 2, output_of(result)
    output = tmp_path / "job" / "workers" / "output.log"
    said = output_of(result).splitlines()
    first = said.index(next(line for line in said if f"2 {name} workers failed" in line))
    lines = said[first : first + 4]
    assert lines[1].startswith("First failure, rank1: killed by SIGKILL, without an error")
    assert lines[2].startswith("Then rank0: ")  # its consequence, in one line
    assert lines[3] == f"Every worker's whole output: {output}"
    training = "[rank 0][accelexp.train][INFO] - Training"
    assert training in output.read_text()
    assert training in output_of(result)
    assert "<stderr>:" not in output_of(result)  # horovodrun's prefix of each line
    assert "Traceback" not in output_of(result)
    time.sleep(0.5)
    assert leftover_workers(str(tmp_path / "job" / "workers")) == []
    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs(["1"])
    assert run.info.status == "FAILED"
    error = Path(client.download_artifacts(run.info.run_id, "error.txt", str(tmp_path)))
    assert "First failure, rank1: killed by SIGKILL" in error.read_text()
    assert "config_resolved.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_a_rank_the_launcher_stopped_while_it_started_is_not_the_cause(tmp_path):
    """rank 0 raised; the launcher's SIGTERM killed rank 1 before it could record anything (it
    was still importing torch): rank 0 is the cause, rank 1 its consequence."""
    failures.clear(tmp_path)
    (tmp_path / "errors" / "rank0.txt").write_text("CheckpointError: last.pt cannot be read\n")
    exits.write(tmp_path, [exits.WorkerExit.of_status(0, 2), exits.WorkerExit.of_status(1, -15)])
    lines = failures.failure_message("2 ddp workers", tmp_path, 1).splitlines()
    assert lines[1:3] == [
        "First failure, rank0: CheckpointError: last.pt cannot be read",
        "Then rank1: killed by SIGTERM.",
    ]


def test_the_console_shows_the_workers_log_records_and_not_the_rest():
    show = ConsoleFilter()
    output = {
        "[1]<stderr>:[2026-12-02 15:53:40,327][rank 1][accelexp][WARNING] - Stopped.": True,
        "[2026-12-02 15:53:40,327][rank 0][accelexp.diagnosis][INFO] - Diagnosis: ...": True,
        "  try precision=bf16: half-width arithmetic": True,  # the record's next lines
        "": True,
        "Traceback (most recent call last):": False,
        '  File "accelexp/step.py", line 64, in train_step': False,
        "RuntimeError: Connection reset by peer": False,
        "W1202 15:42:55.814000 3991 api.py:1028] Sending process 4008 closing signal": False,
    }
    shown = [show(line) for line in output]
    assert [line is not None for line in shown] == list(output.values())
    assert shown[0] == "[2026-12-02 15:53:40,327][rank 1][accelexp][WARNING] - Stopped."


def test_horovod_missing_is_one_clear_message(tmp_path):
    shadow = tmp_path / "shadow" / "horovod"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('horovod is hidden by this test')\n")
    result = subprocess.run(
        [sys.executable, "run.py", "parallelism=horovod", "parallelism.nprocs=1",
         "data=synthetic", f"hydra.run.dir={tmp_path / 'job'}",
         f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "shadow")},
    )  # fmt: skip
    assert result.returncode == 2
    assert "needs Horovod" in output_of(result) and "make setup" in output_of(result)
    assert "Traceback" not in output_of(result)


def test_a_taken_master_port_is_one_clear_message(tmp_path, compose_cfg):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = compose_cfg(
            "parallelism=ddp", "parallelism.nprocs=2", f"parallelism.master_port={port}"
        )
        with pytest.raises(Exception, match=f"master_port={port} is already in use"):
            launch(cfg, tmp_path / "out")


def test_several_workers_need_a_multi_process_strategy(compose_cfg, tmp_path):
    with pytest.raises(
        ConfigError,
        match="use parallelism=ddp, fsdp, horovod, hybrid or pipeline for several workers",
    ):
        launch(compose_cfg("parallelism.nprocs=2"), tmp_path / "out")


@pytest.mark.parametrize("name", list(parallel.STRATEGIES))
def test_the_table_says_which_strategies_start_workers(compose_cfg, name):
    """`rules.several_workers` (the launcher's advice, read without torch) agrees with the
    classes: a strategy starts workers exactly when its sync has a launcher."""
    _, sync = parallel.composition(compose_cfg(f"parallelism={name}").parallelism)
    assert (sync.launcher is not None) == (name in several_workers())


@pytest.mark.parametrize("name", list(parallel.STRATEGIES))
def test_the_table_says_which_strategies_shard(compose_cfg, name):
    """`Preset.shards` (the memory report's levers, read without torch) agrees with the classes:
    a preset shards exactly when each of its syncs does, and its `unsharded` twin does not."""
    preset = parallel.STRATEGIES[name]
    for sync_name in preset.syncs:
        cfg = compose_cfg(f"parallelism={name}", f"parallelism.sync={sync_name}")
        assert parallel.composition(cfg.parallelism)[1].shards == preset.shards
    if preset.shards:
        twin = compose_cfg(f"parallelism={preset.unsharded}").parallelism
        assert not parallel.composition(twin)[1].shards


def test_dp_on_a_cpu_runs_the_plain_module(compose_cfg, tmp_path, caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: DataParallel would wrap the model")
    cfg = compose_cfg("parallelism=dp", "parallelism.devices=[0,1]")
    with caplog.at_level("INFO"):
        metrics = launch(cfg, tmp_path / "out")
    assert "parallelism=dp on a CPU-only machine" in caplog.text
    assert 0 <= metrics["test_acc"] <= 1


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, World()),
        (
            {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1"},
            World(1, 4, 1, "horovodrun"),
        ),
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, World(3, 8, 3, "torchrun")),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, World(5, 8, 1, "slurm")),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}, World()),  # one task
        (  # 4 on each of two nodes, 3 on the third: this is the third
            {"SLURM_PROCID": "9", "SLURM_NTASKS": "11", "SLURM_LOCALID": "1",
             "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2",
             "SLURM_STEP_NUM_NODES": "3"},
            World(9, 11, 1, "slurm", local_size=3, nodes=3),
        ),
        (  # accelexp's own launcher started it (parallelism.nprocs=2)
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
             JOB_ENV: "a-job"},
            World(1, 2, 1, "torchrun", local_size=2, by_accelexp=True),
        ),
    ],
)  # fmt: skip
def test_the_world_is_read_from_the_launchers_environment(env, expected):
    assert current_world(env) == expected
    assert expected.hosts == (expected.nodes or 1)  # not said: all on this host


@pytest.mark.parametrize(("rule", "expected"), [("linear", 0.8), ("sqrt", 0.4), ("none", 0.2)])
def test_lr_scaling_rules(compose_cfg, rule, expected):
    strategy = build_strategy(
        typed(compose_cfg("parallelism=ddp", f"parallelism.lr_scaling={rule}"))
    )
    strategy.shape = WorldShape(replicas=2)
    strategy.cfg.accumulate_steps = 2  # 4 times the samples per step
    assert strategy.scale_lr(0.2) == pytest.approx(expected)


def test_evaluation_shards_cover_each_sample_once():
    for n in (7, 8):
        shards = [list(ShardSampler(n, 3, rank)) for rank in range(3)]
        assert sorted(i for shard in shards for i in shard) == list(range(n))


def test_horovod_refuses_a_world_it_cannot_join(tmp_path):
    # two srun tasks: a Gloo-only Horovod without horovodrun would form two worlds of one
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    result = subprocess.run(
        [sys.executable, "run.py", "parallelism=horovod", "data=synthetic",
         f"hydra.run.dir={tmp_path / 'job'}", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **slurm},
    )  # fmt: skip
    assert result.returncode == 2, output_of(result)
    assert "slurm started 2 processes, but Horovod formed a world of 1" in output_of(result)


def test_ddp_joins_a_slurm_world_from_its_environment(tmp_path, tracking_uri):
    """What `srun --ntasks 2 python run.py parallelism=ddp` does: two tasks with SLURM_* env."""
    uri = tracking_uri
    port = str(free_port())
    command = [
        sys.executable, "run.py", "parallelism=ddp", "data=synthetic", "data.image_size=16",
        "max_steps_per_epoch=3", "epochs=1", "progress=false", "threads=1",
        f"hydra.run.dir={tmp_path / 'job'}", f"mlflow.tracking_uri={uri}",
    ]  # fmt: skip

    def srun_task(rank: int) -> subprocess.Popen:
        slurm = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank)}
        env = {**os.environ, **slurm, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    tasks = [srun_task(0), srun_task(1)]
    outputs = [task.communicate(timeout=300)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    runs = MlflowClient(uri).search_runs(["1"])
    assert len(runs) == 1 and runs[0].data.params["world_size"] == "2"
