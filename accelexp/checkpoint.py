"""The full training state: written atomically at every epoch's end, read back to resume.

`checkpoints/last.pt` in the run's folder holds what an uninterrupted run would carry into its
next epoch: the model, optimizer, scheduler and GradScaler states, the epoch just finished, the
best validation accuracy and time to target so far, the training seconds spent, the RNG states
of every rank (Python, NumPy, torch CPU and CUDA, the train loader's augmentation generator),
the MLflow run id and the resolved config. `checkpoints/best.pt` holds the best weights.

Only the main rank writes (DDP and Horovod replicas are equal; a model cut into stages is one
module in its process), after the ranks' RNG states are gathered to it. Only the main rank reads;
the state reaches the others by broadcast (`Strategy.broadcast_object`), so no rank ever reads
another node's disk. Files are written to a temporary name, flushed and renamed: a checkpoint is
whole or absent, never half-written, whenever the job is stopped.

`resume` picks the checkpoint to continue from (`find_resume`); a restarted job — torchrun's
`--max-restarts`, a Slurm requeue — always continues from its own folder's.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accelexp import signals
from accelexp.config.identity import training_config
from accelexp.errors import AccelexpError, ConfigError

LAST, BEST = "last.pt", "best.pt"
# restarts of one job: torchrun's restarts of its workers, Slurm's requeues of a job
RESTART_ENV = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


@dataclass
class Progress:
    """Where training stands at an epoch's end."""

    epoch: int = 0  # epochs finished
    best_val_acc: float = -1.0
    time_to_target_s: float | None = None
    elapsed_s: float = 0.0  # training seconds in the epochs finished (earlier attempts included)


# --- RNG states ------------------------------------------------------------------------------
def rng_state(generator: torch.Generator) -> dict[str, Any]:
    """This process's random states; `generator` draws the train loader's augmentation."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        # as int64: a uint32 tensor does not survive torch.distributed's object pickling
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "loader": generator.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any], generator: torch.Generator) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    generator.set_state(state["loader"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- files -----------------------------------------------------------------------------------
class StorageError(AccelexpError):
    """A checkpoint could not be written (a full disk, a path that is not a writable folder)."""


def save(path: Path, payload: Mapping[str, Any]) -> None:
    """Write `payload` to `path` atomically: a temporary file, flushed to disk, then renamed.
    On failure the previous file at `path` is left as it was."""
    tmp = path.with_name(f".{path.name}.tmp")
    # a signal inside torch.save would surface as a RuntimeError: it stops the job after the write
    with signals.deferred():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as file:
                torch.save(dict(payload), file)
                file.flush()
                os.fsync(file.fileno())
            tmp.replace(path)
        except (OSError, RuntimeError) as error:  # torch.save reports a full disk as RuntimeError
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise StorageError(
                f"Could not write the checkpoint {path}: {error}. Free space there, or run in "
                f"another folder (hydra.run.dir=...). The run is FAILED; what it logged is kept in "
                f"MLflow, and the last checkpoint written before, if any, is intact (resume=auto)."
            ) from error


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def training_state(
    *,
    model: dict[str, Any],
    optimizer: dict[str, Any],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: dict,
    progress: Progress,
    rng: list[dict[str, Any]],
    run_id: str | None,
    config: dict,
) -> dict[str, Any]:
    """What `last.pt` holds: the whole model's and optimizer's states (gathered from their
    shards under FSDP), and `rng`, one entry per rank, in rank order."""
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler,
        "progress": asdict(progress),
        "rng": rng,
        "run_id": run_id,
        "config": config,
    }


def restore(
    state: Mapping[str, Any],
    *,
    load_model: Callable[[dict], None],
    load_optimizer: Callable[[dict], None],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    load_scaler: Callable[[dict], None],
    generator: torch.Generator,
    rank: int,
) -> Progress:
    """Put a `training_state` back into this rank's objects; returns where training stands."""
    if len(state["rng"]) <= rank:
        raise ConfigError(
            f"The checkpoint was written by a world of {len(state['rng'])} rank(s); this is rank "
            f"{rank}. Resume with the same parallelism.nprocs as the run it continues."
        )
    load_model(state["model"])  # the strategy's: FSDP reshards the whole state
    load_optimizer(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    load_scaler(state["scaler"])  # the precision's: its GradScaler's state, if it has one
    set_rng_state(state["rng"][rank], generator)
    return Progress(**state["progress"])


# --- which checkpoint to continue from ------------------------------------------------------
def restarted() -> bool:
    """True in a job its launcher restarted: torchrun's workers after a failure, a requeued
    Slurm job. Such a job continues from its own folder's last checkpoint."""
    return any(int(os.environ.get(name) or 0) > 0 for name in RESTART_ENV)


def find_resume(
    request: str | None,
    output_dir: Path,
    run_folder: Callable[[str], str | None],
    unfinished_folders: Callable[[], list[str]],
) -> Path | None:
    """The `last.pt` to continue from, or None to start afresh.

    - a restarted job (`restarted()`), or `resume=auto` whose run folder holds one: that one;
    - `resume=auto` otherwise: the newest unfinished run of this experiment with the same
      training config that left one (`unfinished_folders()`, from MLflow), or None;
    - `resume=<MLflow run id>`: that run's (`run_folder(run_id)`);
    - `resume=<path>`: a `last.pt` file, a run folder, or its `checkpoints/` folder.
    """
    own = output_dir / "checkpoints" / LAST
    if restarted() and own.is_file():
        return own
    if not request:
        return None
    if request == "auto":
        if own.is_file():
            return own
        found = (Path(folder) / "checkpoints" / LAST for folder in unfinished_folders())
        return next((path for path in found if path.is_file()), None)
    path = Path(request)
    if not path.exists() and len(request) == 32 and request.isalnum():  # an MLflow run id
        folder = run_folder(request)
        if folder is None:
            raise ConfigError(
                f"resume={request}: this experiment has no MLflow run with that id (or it has no "
                f"run folder). Use resume=auto, or the path of a run folder."
            )
        path = Path(folder)
    for candidate in (path, path / LAST, path / "checkpoints" / LAST):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"resume={request}: no checkpoint there (looked for {path}, {path / LAST} and "
        f"{path / 'checkpoints' / LAST}). Give a run folder, its last.pt, an MLflow run id, "
        f"or resume=auto."
    )


def check_same_training(saved: Mapping[str, Any], current: Mapping[str, Any], path: Path) -> None:
    """A checkpoint continues only the run it came from: refuse one of another config."""
    before, now = _flat(training_config(saved)), _flat(training_config(current))
    differ = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    if differ:
        shown = ", ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in differ[:6])
        raise ConfigError(
            f"The checkpoint {path} is of another configuration ({shown}). Resume with the "
            f"config of the run it continues, or start a new run without resume."
        )


def adopt_best(source: Path, checkpoints: Path) -> None:
    """Resuming into a new run folder: bring the best weights so far along."""
    best = source.parent / BEST
    if best.is_file() and best.resolve() != (checkpoints / BEST).resolve():
        checkpoints.mkdir(parents=True, exist_ok=True)
        shutil.copy2(best, checkpoints / BEST)


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
