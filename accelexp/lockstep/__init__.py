"""Lockstep: a sweep's configurations as live jobs that take turns at the machine.

    python run.py -m precision=fp32,bf16 compare=lockstep repeats=3

Whole-run repeats (`compare=repeats`, the default) pair runs minutes apart, so each pair carries
the machine's drift over a whole run. In lockstep every configuration of the sweep runs at the
same time as its own job, and the jobs take turns: one job runs a *slice* of
`lockstep.slice_steps` training steps while every other job waits blocked on a socket (no CPU
spinning: the jobs run with `OMP_WAIT_POLICY=PASSIVE`; no GPU work queued: a job synchronises its
device before it hands the turn on), then hands the turn to the next; a *round* is one slice of
each job, the order reversed every other round (A B, B A, A B...). Slice r of A and slice r of B
ran seconds apart, so the drift they share cancels in their ratio: the report pairs the slices
by round (`accelexp.stats.lockstep_ratio`). With `lockstep.slice_s` a job's slices are sized in
seconds instead (from its first timed slice); Python's garbage collector runs only at the gates
(`accelexp.engine._Turns`), never inside a slice.

What pairing by round cannot take away is a bias that lives as long as a process (3-22 % between
two identical processes here: `docs/statistics.md` has the measurement). Where every job is one
process that does not compile, the jobs of a repeat run as threads of one process
(`together`, `lockstep.process=auto|shared`): both sides then carry that bias and it cancels in
their ratio. Otherwise (`lockstep.process=own`, launched workers) each repeat is a fresh set of
processes (an *incarnation*), and the interval of a ratio is taken over incarnations, so that
bias is inside it, never hidden.

Every job still trains its whole run, evaluates, checkpoints and logs as a run of its own (a
child of the sweep's parent run): only *when* its steps run changes. A job holds the turn from
the gate it passed until the next one, so its evaluation, checkpoints and logging never run
during another job's timed slice.

- `turns.Turns` (in the sweeper's process) hands the turns, over a Unix socket;
- `gate.Gate` (in every rank of a job) is what the training loop passes before each slice;
- `jobs.run_incarnation` starts one incarnation's jobs as processes of `run.py` (or as threads
  of one `together` process), waits for them, and stops them all on SIGINT/SIGTERM.
"""

from __future__ import annotations

LOCKSTEP_ENV = "ACCELEXP_LOCKSTEP"  # a job's: "<socket path> <job index> <authkey hex>"
DESIGNS = ("repeats", "lockstep")  # the values of `compare`
