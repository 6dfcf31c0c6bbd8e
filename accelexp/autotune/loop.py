"""The loop: rounds of the best and its candidates, interleaved, and the decision on each
(`decide`); the package's docstring says how it goes."""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from omegaconf import DictConfig

from accelexp import record, stats
from accelexp.errors import ConfigError
from accelexp.report.compare import Group, lockstep_ratio, measure_estimate, ratio
from accelexp.stats import Estimate
from accelexp.sweeper import OWN_KEYS
from accelexp.tracking.query import RunRecord

log = logging.getLogger(__name__)

BASE, CANDIDATE = "base", "candidate"
# the quiet pairs a ratio is taken over, when there are this many: 2 pairs' t quantile is 12.7,
# whose interval nearly always holds 1.0; fewer, and every pair is (the module doc)
MIN_QUIET_PAIRS = 3

# runs a batch of jobs (each a list of override strings) in order, returns each job's run (None:
# the job left no run)
RunJobs = Callable[[list[list[str]]], list[RunRecord | None]]
# what keeps a job from composing ("" when it composes)
Composes = Callable[[list[str]], str]
# sets tags on a run
TagRun = Callable[[str, Mapping[str, str]], None]


def key_of(override: str) -> str:
    """`+model.depth=2` -> `model.depth`."""
    return override.split("=", 1)[0].lstrip("+~")


def merged(base: Sequence[str], change: str) -> list[str]:
    """`base`'s overrides with each `key=value` of `change` in place of the same key's."""
    tokens = change.split()
    changed = {key_of(token) for token in tokens}
    return [o for o in base if key_of(o) not in changed] + tokens


def difference(base: Sequence[str], best: Sequence[str]) -> list[str]:
    """The overrides of `best` that `base` does not have as they are."""
    return [o for o in best if o not in base]


@dataclass
class Candidate:
    override: str  # one or more `key=value`, space-separated
    why: str  # the verdict's reason


@dataclass
class Step:
    """One candidate measured against the best so far, in one round."""

    round: int
    base: list[str]  # the overrides of the best it was measured against
    candidate: Candidate
    runs: list[RunRecord]
    base_runs: list[RunRecord]
    speedup: Estimate | None = None
    base_acc: float | None = None
    acc: float | None = None
    kept: bool = False
    why: str = ""
    chosen: bool = False  # kept, and the new best

    def as_dict(self) -> dict:
        speedup = self.speedup
        return {
            "round": self.round,
            "candidate": self.candidate.override,
            "suggested_because": self.candidate.why,
            "speedup": None if speedup is None else speedup.value,
            "speedup_low": None if speedup is None else speedup.low,
            "speedup_high": None if speedup is None else speedup.high,
            "paired": "" if speedup is None else speedup.method,
            "base_test_acc": self.base_acc,
            "test_acc": self.acc,
            "decision": record.AUTOTUNE_KEPT if self.kept else record.AUTOTUNE_REJECTED,
            "chosen": self.chosen,
            "why": self.why,
            "runs": [r.run_id for r in self.runs],
            "base_runs": [r.run_id for r in self.base_runs],
        }


@dataclass
class AutotunePath:
    """Where the loop went: its steps in order, the overrides it started from and ended with,
    and why it stopped."""

    start: list[str]
    best: list[str]
    steps: list[Step] = field(default_factory=list)
    stopped: str = ""
    trials: int = 0
    seconds: float = 0.0

    @property
    def kept(self) -> list[Step]:
        return [step for step in self.steps if step.chosen]

    def paste(self) -> str:
        """The overrides that the path found, to add to the command line."""
        return " ".join(difference(self.start, self.best))

    def as_dict(self) -> dict:
        return {
            "start": self.start,
            "best": self.best,
            "found": self.paste(),
            "stopped": self.stopped,
            "trials": self.trials,
            "seconds": round(self.seconds, 1),
            "steps": [step.as_dict() for step in self.steps],
        }


def decide(step: Step, tolerance: float) -> None:
    """Measure `step`'s candidate against its base (their runs of one round) and decide."""
    finished = [r for r in step.runs if r.status == record.FINISHED]
    base_finished = [r for r in step.base_runs if r.status == record.FINISHED]
    step.acc = _mean_acc(finished)
    step.base_acc = _mean_acc(base_finished)
    if not finished:
        states = ", ".join(sorted({r.status for r in step.runs})) or "no run"
        step.why = f"its runs did not finish ({states})"
        return
    if not base_finished:
        step.why = "the base's runs of this round did not finish: nothing to compare with"
        return
    measured = {r.run_id: measure_estimate(r) for r in finished + base_finished}
    mine = Group(step.candidate.override, finished, measured)
    theirs = Group(BASE, base_finished, measured)
    shared = ""
    if (paired := lockstep_ratio(mine, theirs)) is not None:  # compare=lockstep: by round
        step.speedup = paired
        shared = f" ({paired.method})"
    elif len(mine.by_repeat().keys() & theirs.by_repeat().keys()) >= MIN_QUIET_PAIRS:
        step.speedup = ratio(mine, theirs)  # the quiet pairs, as the report pairs them
    else:  # on a machine always shared (a VM's steal), pairs of contended runs too
        mine_all, theirs_all = _by_repeat(finished, measured), _by_repeat(base_finished, measured)
        common = sorted(mine_all.keys() & theirs_all.keys())
        if len(common) < 2:
            why = next((m[1] for m in measured.values() if m[1]), "fewer than 2 pairs ran")
            step.why = f"not measured: {why}"
            return
        step.speedup = stats.ratio(
            [mine_all[i] for i in common], [theirs_all[i] for i in common], paired=True
        )
        shared = " (runs timed while the machine was shared: what a pair shared cancels)"
    said = stats.format_estimate(step.speedup, suffix="×") + shared
    verdict = stats.verdict(step.speedup)
    if verdict != "faster":
        step.why = f"{verdict}: {said}"
        return
    accuracy = f"test accuracy {step.acc:.3f} vs {step.base_acc:.3f}"
    if step.acc is not None and step.base_acc is not None and step.acc < step.base_acc - tolerance:
        step.why = f"faster ({said}) but less accurate: {accuracy}, more than {tolerance:g} lower"
        return
    step.kept = True
    step.why = f"faster: {said}, {accuracy}"


def _by_repeat(runs: Sequence[RunRecord], measured: Mapping) -> dict[str, Estimate]:
    """Each measured run's throughput by its repeat index, contended or not."""
    return {
        r.tags.get(record.REPEAT_INDEX, r.run_id): measured[r.run_id][0]
        for r in runs
        if measured[r.run_id][0] is not None
    }


def _mean_acc(runs: Sequence[RunRecord]) -> float | None:
    values = [r.metrics[record.TEST_ACC] for r in runs if record.TEST_ACC in r.metrics]
    return statistics.fmean(values) if values else None


def advice_of(runs: Sequence[RunRecord]) -> list[Candidate]:
    """The overrides the runs' verdicts offer, in order, each once (every repeat's verdict: a
    contended one may advise otherwise)."""
    found: dict[str, str] = {}
    for run in runs:
        for override, why in json.loads(run.tags.get(record.DIAGNOSIS_ADVICE) or "[]"):
            found.setdefault(override, why)
    return [Candidate(override, why) for override, why in found.items()]


def why_not(candidate: Candidate, freeze: Sequence[str]) -> str:
    """Why `candidate` is no override the loop can try ("" when it is)."""
    tokens = candidate.override.split()
    if not tokens or not all("=" in token and not token.startswith("-") for token in tokens):
        return "not an override of the run's config"
    for token in tokens:
        key = key_of(token)
        if key in OWN_KEYS or key.startswith("hydra."):
            return f"{key} is how a sweep runs, not a setting"
        frozen = [f for f in freeze if key == f or key.startswith(f"{f}.")]
        if frozen:
            return f"{key} is frozen (autotune.freeze)"
    return ""


class Autotune:
    """The loop (the module doc), over jobs run by `run_jobs`."""

    def __init__(
        self,
        cfg: DictConfig,
        start: Sequence[str],
        run_jobs: RunJobs,
        composes: Composes,
        tag_run: TagRun,
        on_round: Callable[[AutotunePath], None] = lambda path: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`cfg`: the sweep's config (`repeats`, `autotune.*`), `start`: the base's overrides as
        typed, `on_round`: called with the path after every round (it writes the report)."""
        if cfg.repeats < 2:
            raise ConfigError(
                f"autotune runs every trial `repeats` times to put an interval on its speedup, "
                f"and repeats={cfg.repeats}: use repeats=2 or more (3 by default)."
            )
        self.settings, self.repeats = cfg.autotune, cfg.repeats
        self.run_jobs, self.composes, self.tag_run = run_jobs, composes, tag_run
        self.on_round, self.clock = on_round, clock
        self.path = AutotunePath(list(start), list(start))
        self.began = clock()
        self.next_index = 0  # the repeat_index of the next round of jobs
        # (the best's overrides, a candidate) already decided on, or left out
        self.tried: set[tuple[tuple[str, ...], str]] = set()

    def run(self) -> AutotunePath:
        best_runs = self._measure([self.path.best], [None], rounds=1, round_no=0)[0]
        if not best_runs:
            self.path.stopped = "the base's run failed: fix it first (its run says why)"
        round_no = 1
        while not self.path.stopped:
            self._round(round_no, best_runs)
            steps = [s for s in self.path.steps if s.round == round_no]
            kept = [s for s in steps if s.kept]
            if kept:
                chosen = max(kept, key=lambda s: s.speedup.value)
                chosen.chosen = True
                self.path.best = merged(self.path.best, chosen.candidate.override)
                best_runs = chosen.runs
                log.info(
                    "Autotune round %d keeps %s (%s); the best is now: %s",
                    round_no,
                    chosen.candidate.override,
                    chosen.why,
                    self.path.paste(),
                )
            elif not self.path.stopped:
                self.path.stopped = (
                    f"none of the {len(steps)} candidate(s) of round {round_no} helped"
                )
            round_no += 1
        self.path.seconds = self.clock() - self.began
        self.on_round(self.path)
        return self.path

    def candidates(self, best_runs: Sequence[RunRecord]) -> list[Candidate]:
        """The verdict's untried overrides of the best that compose; the others said why."""
        found = []
        for candidate in advice_of(best_runs):
            if (tuple(self.path.best), candidate.override) in self.tried:
                continue
            why = why_not(candidate, self.settings.freeze) or self.composes(
                merged(self.path.best, candidate.override)
            )
            if why:
                log.info("Autotune leaves %s out: %s", candidate.override, why)
                self.tried.add((tuple(self.path.best), candidate.override))
                continue
            found.append(candidate)
        return found

    def _round(self, round_no: int, best_runs: Sequence[RunRecord]) -> None:
        """Measure the best and its candidates, interleaved, and decide on each candidate."""
        candidates = self.candidates(best_runs)
        if not candidates:
            bounds = ", ".join(sorted({f"{r.tags.get(record.DIAGNOSIS)}-bound" for r in best_runs}))
            self.path.stopped = f"the best's verdict ({bounds}) offers nothing left to try"
            return
        room = (self.settings.max_trials - self.path.trials) // self.repeats - 1
        if room < 1:
            self.path.stopped = f"autotune.max_trials={self.settings.max_trials} reached"
            return
        candidates = candidates[:room]
        jobs = [self.path.best] + [merged(self.path.best, c.override) for c in candidates]
        log.info(
            "Autotune round %d: %s on top of %s, %d repeats interleaved",
            round_no,
            ", ".join(c.override for c in candidates),
            " ".join(self.path.best) or "the defaults",
            self.repeats,
        )
        labels = [None, *(c.override for c in candidates)]
        base_runs, *runs = self._measure(jobs, labels, self.repeats, round_no)
        if len(base_runs) < min(2, self.repeats) and self.path.stopped:
            return  # the budget ran out before a pair was measured
        for candidate, its_runs in zip(candidates, runs, strict=True):
            step = Step(round_no, list(self.path.best), candidate, its_runs, base_runs)
            decide(step, self.settings.accuracy_tolerance)
            self.path.steps.append(step)
            if not step.kept:
                self.tried.add((tuple(step.base), candidate.override))
            log.info(
                "  %s: %s — %s",
                candidate.override,
                record.AUTOTUNE_KEPT if step.kept else record.AUTOTUNE_REJECTED,
                step.why,
            )
            setting = next((r.tags.get(record.SETTING_ID) for r in base_runs), None) or ""
            for run in its_runs:
                self.tag_run(
                    run.run_id,
                    {
                        record.AUTOTUNE_DECISION: (
                            record.AUTOTUNE_KEPT if step.kept else record.AUTOTUNE_REJECTED
                        ),
                        record.AUTOTUNE_WHY: step.why,
                        record.AUTOTUNE_BASE_SETTING: setting,
                    },
                )
        self.on_round(self.path)

    def _measure(
        self, jobs: list[list[str]], labels: list[str | None], rounds: int, round_no: int
    ) -> list[list[RunRecord]]:
        """Each job `rounds` times, round-robin; each job's runs (those that left a run).
        `labels`: the candidate each job tries (None: the base)."""
        runs: list[list[RunRecord]] = [[] for _ in jobs]
        for _ in range(rounds):
            spent = self.clock() - self.began
            if spent >= self.settings.budget_s:
                self.path.stopped = f"autotune.budget_s={self.settings.budget_s:g} spent"
                break
            index, self.next_index = self.next_index, self.next_index + 1
            # every other round backwards (A B, B A, A B...): a drift within a round falls on
            # each side alike, not always on the one that runs second
            order = list(range(len(jobs)))[:: -1 if index % 2 else 1]
            batch = [[*jobs[position], f"repeat_index={index}"] for position in order]
            for position, run in zip(order, self.run_jobs(batch), strict=True):
                self.path.trials += 1
                if run is None:
                    continue
                label = labels[position]
                role = BASE if label is None else CANDIDATE
                tags = {record.AUTOTUNE_ROUND: str(round_no), record.AUTOTUNE_ROLE: role}
                if label is not None:
                    tags[record.AUTOTUNE_CANDIDATE] = label
                self.tag_run(run.run_id, tags)
                runs[position].append(run)
        return runs
