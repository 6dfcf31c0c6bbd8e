"""How a job's workers are started, or joined. Knows launchers, not training.

- Inside a world already (horovodrun, torchrun, srun, mpirun set the environment: see
  `parallel/world.py`), or with `nprocs: 1`, the job trains in this process.
- Otherwise the strategy's real launcher starts `nprocs` workers on this machine: torch's elastic
  launcher (torchrun, `accelexp.launch.torchrun`) for DDP, `horovodrun --gloo`
  (`accelexp.launch.horovodrun`) for Horovod, and its sync's for `hybrid`; both are the
  launchers themselves, which also keep their record of how each worker ended
  (`accelexp.launch.exits`). Each worker runs `python -m accelexp.worker SPEC_DIR` on the
  *resolved* config saved there: workers do not re-run Hydra nor make output folders of their
  own. Their whole output goes to `SPEC_DIR/output.log`; the console shows their log records
  (`accelexp.launch.output`).

A worker that fails brings the job down: the launcher stops the others, the job exits non-zero
with one message naming the first rank to fail — by its error, or by the signal that killed it
without one (`accelexp.launch.failures`) — and every process the job started is killed so nothing
is left running (`accelexp.processes`: found by a token in their environment, across process
sessions). SIGINT or SIGTERM stops every worker too (SIGTERM first, so rank 0 closes its run
KILLED), and the launcher gets SIGTERM if this process dies.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch
from omegaconf import DictConfig, OmegaConf

from accelexp.config import ConfigError, validate
from accelexp.config.typed import typed
from accelexp.errors import AccelexpError
from accelexp.launch.failures import OomKills, clear, failure_message
from accelexp.launch.output import WorkerOutput
from accelexp.parallel import composition
from accelexp.parallel.config import DDPConfig, FSDPConfig, ParallelismConfig
from accelexp.parallel.rules import several_workers
from accelexp.parallel.world import World, current_world, port_in_use
from accelexp.processes import JOB_ENV, die_with_parent, kill_job, new_job_token, stop_job
from accelexp.signals import interruption
from accelexp.tracking import credentials

log = logging.getLogger(__name__)


class WorkerFailedError(AccelexpError):
    """A worker process failed; the message carries its error."""


def take_world_size(cfg: DictConfig, world: World) -> None:
    """A world its launcher made (torchrun, horovodrun, srun, mpirun) has the workers its flags
    said, whatever `parallelism.nprocs` says (its default, under `torchrun --nproc-per-node=8`):
    the config takes the world's size, so the checks (a pipeline's `pp` dividing it) and the
    run's record hold the real one."""
    if world.joined and cfg.parallelism.nprocs != world.world_size:
        cfg.parallelism.nprocs = world.world_size


def launch(cfg: DictConfig, output_dir: str | Path, overrides: Sequence[str] = ()) -> dict:
    """Run the job here, or start its workers and wait for them; returns rank 0's final metrics."""
    from accelexp.config.resources import check_resources

    world = current_world()
    take_world_size(cfg, world)
    validate(cfg)
    output_dir = Path(output_dir)
    nprocs = cfg.parallelism.nprocs
    if world.joined or nprocs == 1:  # the job trains in this process
        check_resources(cfg, workers=1)
        from accelexp.train import run  # after the checks: it loads MLflow and torchvision

        if world.joined:
            log.info(
                "Joining a world of %d started by %s as rank %d",
                world.world_size,
                world.source,
                world.rank,
            )
        return run(cfg, output_dir, overrides)
    parallelism = typed(cfg).parallelism  # the strategy's part, typed
    placement, sync = composition(parallelism)
    if sync.launcher is None:
        raise ConfigError(
            f"parallelism={parallelism.name} runs in one process, but parallelism.nprocs="
            f"{nprocs}: use parallelism={_one_of(several_workers())} for several workers."
        )
    gpus = torch.cuda.device_count() if cfg.device != "cpu" else 0
    per_worker = placement.devices_per_worker(parallelism)
    if gpus and nprocs * per_worker > gpus:
        raise AccelexpError(
            f"parallelism.nprocs={nprocs} workers with {per_worker} GPU(s) each, but this "
            f"machine has {gpus} GPU(s). Use parallelism.nprocs<={gpus // per_worker}, "
            f"or device=cpu."
        )
    check_resources(cfg, workers=nprocs)  # cores, memory, a batch per worker's share
    cfg = cfg.copy()
    if cfg.threads is None and not gpus:  # workers share this machine's cores
        cfg.threads = max(1, len(os.sched_getaffinity(0)) // nprocs)
    spec = _write_spec(cfg, output_dir, overrides)
    command = LAUNCHERS[sync.launcher](parallelism, spec)
    what = f"{nprocs} {parallelism.name} workers"
    log.info("Starting %s: %s", what, " ".join(command))
    oom_kills = OomKills.now()
    with WorkerOutput(spec, console=sys.stderr) as output:
        log.info("Their whole output: %s", output.path)
        returncode = _run_process_group(command, threads=cfg.threads, output=output.file)
    if returncode != 0:
        message = failure_message(what, spec, returncode, OomKills.now().since(oom_kills))
        raise WorkerFailedError(message)
    return json.loads((spec / "result.json").read_text())


def _one_of(names: Sequence[str]) -> str:
    """The names as "a, b or c"."""
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _write_spec(cfg: DictConfig, output_dir: Path, overrides: Sequence[str]) -> Path:
    spec = output_dir / "workers"
    clear(spec)
    OmegaConf.save(cfg, spec / "config.yaml", resolve=True)
    (spec / "job.json").write_text(
        json.dumps({"output_dir": str(output_dir), "overrides": list(overrides)})
    )
    return spec


def _torchrun(cfg: DDPConfig | FSDPConfig, spec: Path) -> list[str]:
    if cfg.master_port is not None:
        if port_in_use(cfg.master_port):
            raise AccelexpError(
                f"parallelism.master_port={cfg.master_port} is already in use on 127.0.0.1. "
                f"Pick another port, or leave it null to use a free one."
            )
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{cfg.master_port}"]
    else:
        rendezvous = ["--standalone"]
    return [
        sys.executable, "-m", "accelexp.launch.torchrun", str(spec), "--nnodes=1",
        f"--nproc-per-node={cfg.nprocs}", *rendezvous, f"--max-restarts={cfg.max_restarts}",
        f"--log-dir={spec / 'elastic'}",  # the agent's per-attempt folders, not a /tmp each
        "-m", "accelexp.worker", str(spec),
    ]  # fmt: skip


def _horovodrun(cfg: ParallelismConfig, spec: Path) -> list[str]:
    if importlib.util.find_spec("horovod") is None:  # accelexp.launch.horovodrun runs it
        raise AccelexpError(
            f"parallelism={cfg.name} starts its workers with horovodrun, which needs Horovod, not "
            f"installed in {Path(sys.executable).parent.parent}. Run the setup, which builds it: "
            "`make setup`."
        )
    return [
        sys.executable, "-m", "accelexp.launch.horovodrun", str(spec),
        "-np", str(cfg.nprocs), "-H", f"localhost:{cfg.nprocs}", "--gloo",
        sys.executable, "-m", "accelexp.worker", str(spec),
    ]  # fmt: skip


LAUNCHERS = {"torchrun": _torchrun, "horovodrun": _horovodrun}


def _run_process_group(command: list[str], threads: int | None, output: BinaryIO) -> int:
    """Run the launcher in its own session; whatever happens, leave none of its processes.

    On SIGINT/SIGTERM (`Interrupted`) every process of the job gets SIGTERM, so rank 0 can close
    the run KILLED, and SIGKILL after a grace period; on any other end the job's processes that
    are left (workers a launcher failed to stop) are killed.
    """
    token = new_job_token()
    env = {**os.environ, JOB_ENV: token}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with credentials.secrets_to_file(env):  # horovodrun would show them on command lines
        return _wait_for(command, env, token, output)


def _wait_for(command: list[str], env: dict[str, str], token: str, output: BinaryIO) -> int:
    process = subprocess.Popen(
        command,
        start_new_session=True,
        env=env,
        preexec_fn=die_with_parent,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
    )
    try:
        return process.wait()
    except KeyboardInterrupt as error:
        log.warning("%s: stopping the workers.", interruption(error).name)
        stop_job(token)
        raise
    finally:
        kill_job(token)
        process.wait()
