"""What a verdict tells a run to try next: `(text, why)` pairs, of two kinds.

- An **override**: `key=value` tokens for `run.py` (`precision=bf16`,
  `parallelism=ddp parallelism.nprocs=2 threads=1`). A verdict offers only those the run's config
  can take (`accelexp.diagnosis.verdict.usable`), the first is the run's `diagnosis_next` tag, and
  only these are what a program may try on its own (`overrides`: the `diagnosis_advice` tag that
  autotune reads).
- A **command**: in a world a launcher made (torchrun, horovodrun, srun, mpirun), more workers are
  that launcher's own flags — the world ignores `parallelism.nprocs`. The text starts with
  `COMMAND`, a shell's prompt: `$ torchrun --nnodes=2 --nproc-per-node=4 … threads=2`, where `…`
  is the rest of the run's command line and what follows it the overrides to add there. A command
  is shown as it is: never validated as an override, never a `diagnosis_next`, never handed to a
  program that tries overrides.
"""

from __future__ import annotations

from collections.abc import Iterable

Advice = tuple[str, str]  # (an override or a command, why)
COMMAND = "$ "


def command(line: str, why: str) -> Advice:
    """Advice to start the run otherwise: `line` is a launcher's command line."""
    return COMMAND + line, why


def is_command(item: Advice) -> bool:
    return item[0].startswith(COMMAND)


def overrides(advice: Iterable[Advice]) -> list[Advice]:
    """The overrides of `advice`, in order: what a program may try by itself."""
    return [item for item in advice if not is_command(item)]
