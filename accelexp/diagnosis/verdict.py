"""What bounds a run, the evidence, and the overrides to try next.

`diagnose(facts)` applies a few rules, in this order, to the last epoch's time accounting
(`accelexp.timing.Breakdown`) and the run's FLOP and memory figures:

1. **input** — the loop waited for its next batch for at least `INPUT_SHARE` of the step time.
2. **communication** — the host waited for gradient communication for at least `COMM_SHARE` of
   the step time (what was not hidden behind the backward pass).
3. **memory** — on a GPU, the peak allocation reached `MEMORY_SHARE` of the device's memory: the
   batch cannot grow, whatever else bounds the speed.
4. **overhead** — fixed per-step costs (Python, dispatch, kernel launches) outweigh the
   arithmetic: on a GPU, it was busy for less than `GPU_BUSY` of the time, since it kept up with
   the host; on a CPU, the model's FLOPs ran at less than `FLOP_SHARE` of this CPU's measured
   matmul peak.
5. **contended** — none of the above, and other work shared the machine while the run was timed
   (`accelexp.diagnosis.noise`): its speed is the neighbours' as much as its own, so what
   bounds it cannot be told; never called compute-bound. Its advice: repeats, then what a
   compute-bound run is advised, each "if the machine's arithmetic, not the neighbours, bounds
   it" (rules 1-4 did not fire: arithmetic is what is left).
6. **compute** — none of the above: the device's arithmetic is the limit. On a GPU the advice is
   the speed switches (bf16/amp, channels_last, TF32, `speed.compile`) and, where the step peaked
   below `ROOM_SHARE` of the device's memory, a doubled batch.

The advice is the run's own: with the run's config (`RunFacts.config`), an override already in
effect (`precision=bf16` to a bf16 run; `precision=bf16` or `amp` to a `bf16_true` or `fp8` run,
which computes in bf16 or less already: `HALF_WIDTH_ALREADY`) or one the config's validation
refuses (CUDA graphs,
`speed.compile=reduce-overhead`, to an `fsdp` run) is left out, the strategies' ways to need less
memory per device are theirs (`accelexp.parallel.rules.MEMORY_ADVICE`),
`speed.channels_last` is offered only to a model with convolutions, and
`speed.activation_checkpointing=full` (a memory verdict's, an out-of-memory run's) only to a model
with repeated blocks to checkpoint (`RunFacts.checkpointable`), not to one checkpointing all of
them already.

"More devices" (compute-bound runs) is the strategy's own (`Strategy.scale_out_advice`) and
knows the machine (`accelexp.machine`): on a CPU it is offered only where the run measurably
left idle cores while timed, as workers × threads that sum to the usable cores
(`parallelism=ddp parallelism.nprocs=2 threads=1` to a one-thread run on 2 cores); on a GPU only
where this process sees more GPUs than the run's workers on this host use; otherwise not at all,
and the evidence says all cores were busy. In a world the user's launcher made (torchrun,
horovodrun, srun, mpirun), it is that launcher's flags (`$ torchrun --nnodes=2
--nproc-per-node=4 …`): a command, not an override (`accelexp.advice`), so it is kept as it is,
never validated as one, never the `diagnosis_next` tag nor in the `diagnosis_advice` tag that
autotune tries.

An override autotune measured on this setting on this host and rejected (`RunFacts.rejected`,
looked up in the store) is not offered again; the evidence says so.

The thresholds are round numbers, chosen so that the cases accelexp's tests produce on purpose
(a slowed input pipeline, two Gloo workers on a large model with a tiny batch, a tiny model with
a tiny batch) land where they should, and a default run lands in compute; the evidence is
printed with every verdict, so a borderline case can be judged by the numbers.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from accelexp import record
from accelexp.advice import Advice, is_command, overrides
from accelexp.config import ConfigError, validate
from accelexp.config.catalog import flatten
from accelexp.machine import Machine
from accelexp.parallel.rules import MEMORY_ADVICE
from accelexp.precision import HALF_WIDTH_ALREADY
from accelexp.timing import Breakdown

INPUT_SHARE = 0.25
COMM_SHARE = 0.25
MEMORY_SHARE = 0.90
ROOM_SHARE = 0.40  # a compute-bound GPU run below this share of the memory may double its batch
GPU_BUSY = 0.60
FLOP_SHARE = 0.05
# precision options whose gain (half-width arithmetic and activations) a run of another
# precision has already: bf16_true computes in bf16 with bf16 weights besides, fp8 its matmuls in
# fp8 and the rest in bf16


@dataclass
class RunFacts:
    """What the verdict is drawn from (one run, its last epoch)."""

    breakdown: Breakdown
    device_type: str  # cpu | cuda
    batch_size: int
    flop_utilisation: float | None = None  # of the measured matmul peak
    peak_mem_mb: float | None = None
    device_mem_mb: float | None = None  # the device's total memory (CUDA)
    # the strategy's own overrides for communication, each with why (Strategy.comm_advice)
    comm_advice: list[tuple[str, str]] = field(default_factory=list)
    hta: dict[str, float] = field(default_factory=dict)  # HTA's figures (profile=true, GPU)
    # the run's resolved config and what it really ran with ("speed.channels_last": "true" where
    # `auto` chose it); None: advice as for any run
    config: DictConfig | None = None
    in_effect: Mapping[str, str] = field(default_factory=dict)
    convolutional: bool = True  # the model has 2-D convolutions (channels_last helps it)
    # the model has repeated blocks to checkpoint (accelexp.activation_checkpoint.checkpointable)
    checkpointable: bool = False
    # the strategy's advice for more devices, with why (Strategy.scale_out_advice, drawn from
    # `machine`); None: this host had no idle devices, or the run was not measured
    scale_out: Advice | None = None
    machine: Machine | None = None  # the host's idle cores or visible GPUs, for the evidence
    # the evidence that other work shared the machine while it was timed (NoiseVerdict), if any
    contention: list[str] = field(default_factory=list)
    # overrides autotune measured on this setting on this host and rejected, with why
    # (`Tracker.rejected_by_autotune`): not offered again
    rejected: Mapping[str, str] = field(default_factory=dict)

    @property
    def contended(self) -> bool:
        return bool(self.contention)


@dataclass
class Verdict:
    bound: str  # input | communication | memory | overhead | contended | compute
    detail: str  # one line of evidence
    evidence: list[str]
    advice: list[Advice]  # (override or command, why): `accelexp.advice`

    def tags(self) -> dict[str, str]:
        first = overrides(self.advice)[:1]  # a launcher's command is not an override to try
        return {
            record.DIAGNOSIS: self.bound,
            record.DIAGNOSIS_DETAIL: self.detail,
            record.DIAGNOSIS_NEXT: first[0][0] if first else "",
            # [[override, why], ...]: what a program (autotune) may try, no launcher's command
            record.DIAGNOSIS_ADVICE: json.dumps(overrides(self.advice)),
        }

    def console(self) -> str:
        lines = [f"Diagnosis: {self.bound}-bound — {self.detail}"]
        lines += [f"  try {override}: {why}" for override, why in self.advice[:3]]
        return "\n".join(lines)

    def markdown(self, run_name: str) -> str:
        lines = [
            f"# Diagnosis of {run_name}: **{self.bound}-bound**",
            "",
            self.detail[0].upper() + self.detail[1:] + ".",
            "",
            "## Evidence (last epoch)",
            "",
            *(f"- {line}" for line in self.evidence),
            "",
            "## What to try next",
            "",
            *(f"- `{override}` — {why}" for override, why in self.advice),
            "",
        ]
        return "\n".join(lines)


def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def evidence_lines(facts: RunFacts) -> list[str]:
    b = facts.breakdown
    lines = [
        f"step time {b.wall:.2f} s: input wait {_pct(b.share('input'))}, forward "
        f"{_pct(b.share('forward'))}, backward {_pct(b.share('backward'))}, optimizer "
        f"{_pct(b.share('optimizer'))}, communication waited for {_pct(b.share('comm'))}, "
        f"loop bookkeeping {_pct(b.share('other'))}"
    ]
    if b.comm_inflight:
        lines.append(
            f"communication in flight {b.comm_inflight:.2f} s, {_pct(b.comm_overlap or 0.0)} "
            f"of it hidden behind the backward pass"
        )
    if b.gpu_busy is not None:
        lines.append(f"GPU busy at least {_pct(b.gpu_busy)} of the time")
    if facts.flop_utilisation is not None:
        lines.append(
            f"model FLOPs at {100 * facts.flop_utilisation:.1f}% of this device's measured "
            f"matmul peak"
        )
    hta = defaultdict(lambda: float("nan"), facts.hta)
    if record.HTA_IDLE_PCT in hta:
        lines.append(
            f"HTA (profiled steps): GPU idle {hta[record.HTA_IDLE_PCT]:.0f}% (host wait "
            f"{hta[record.HTA_IDLE_HOST_WAIT_PCT]:.0f}% of it), compute kernels "
            f"{hta[record.HTA_COMPUTE_PCT]:.0f}%, communication overlapped "
            f"{hta[record.HTA_COMM_COMP_OVERLAP_PCT]:.0f}%, short kernels "
            f"{hta[record.HTA_SHORT_KERNELS_PCT]:.0f}% of launches"
        )
    if facts.peak_mem_mb is not None:
        of_total = f" of {facts.device_mem_mb:.0f} MB" if facts.device_mem_mb else ""
        lines.append(f"peak memory {facts.peak_mem_mb:.0f} MB{of_total}")
    machine = facts.machine and facts.machine.evidence()
    if machine:
        lines.append(machine)
    return lines


def diagnose(facts: RunFacts) -> Verdict:
    verdict = _diagnose(facts)
    advice = usable(verdict.advice, facts.config, facts.in_effect)
    verdict.advice = [item for item in advice if item[0] not in facts.rejected]
    verdict.evidence += [
        f"autotune measured {override} here and rejected it: {why}"
        for override, why in facts.rejected.items()
        if override in dict(advice)
    ]
    return verdict


def usable(
    advice: list[Advice], cfg: DictConfig | None, in_effect: Mapping[str, str] = {}
) -> list[Advice]:
    """The advice a run of `cfg` can take: overrides not in effect already (in `cfg`, or
    `in_effect`: what an `auto` chose) and not refused by the config's validation; a launcher's
    command as it is (`accelexp.advice`: not an override). No `cfg`: all of it."""
    if cfg is None:
        return advice
    settings = settings_of(cfg, in_effect)
    return [item for item in advice if is_command(item) or _usable(item[0], cfg, settings)]


def settings_of(cfg: DictConfig, in_effect: Mapping[str, str]) -> dict[str, str]:
    """Every key of the run's config as override text (`precision.init_scale` -> "65536.0"),
    each config group by its option's name (`model` -> "simple_cnn"), then `in_effect`."""
    tree = OmegaConf.to_container(cfg, resolve=True)
    settings = {key: _text(value) for key, value in flatten(tree).items()}
    for group, node in tree.items():
        if isinstance(node, dict) and "name" in node:
            settings[group] = _text(node["name"])
    return settings | {key: _text(value) for key, value in in_effect.items()}


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _usable(override: str, cfg: DictConfig, settings: Mapping[str, str]) -> bool:
    pairs = [token.split("=", 1) for token in override.split()]
    if all(settings.get(key) == value for key, value in pairs):
        return False  # in effect already
    already = HALF_WIDTH_ALREADY.get(settings.get("precision", ""), ())
    if any(key == "precision" and value in already for key, value in pairs):
        return False  # its gain is in effect already
    if any("." not in key for key, _ in pairs):
        return True  # a group's option: what it composes is Hydra's to know
    trial = copy.deepcopy(cfg)
    try:
        for key, value in pairs:
            OmegaConf.update(trial, key, yaml.safe_load(value), force_add=False)
        validate(trial)
    except (ConfigError, OmegaConfBaseException):
        return False
    return True


def _diagnose(facts: RunFacts) -> Verdict:
    b = facts.breakdown
    cuda = facts.device_type == "cuda"
    evidence = evidence_lines(facts)
    input_share, comm_share = b.share("input"), b.share("comm")
    bigger_batch = (
        f"data.batch_size={2 * facts.batch_size}",
        "more work per step for the same fixed per-step costs (scale optimizer.lr with it)",
    )
    if input_share >= INPUT_SHARE and input_share >= comm_share:
        advice = [
            ("data.on_device=true", "hold the dataset on the GPU: batches gathered there")
            if cuda
            else ("data.num_workers=2", "prepare the next batches while the step computes"),
            ("data.augment=false", "if augmentation is what the loader spends its time on"),
        ]
        return Verdict(
            "input",
            f"the loop waited for its next batch {_pct(input_share)} of the step time",
            evidence,
            advice,
        )
    if comm_share >= COMM_SHARE:
        fewer = [
            (
                "parallelism.accumulate_steps=4",
                "one gradient exchange per 4 batches instead of every batch",
            ),
            bigger_batch,
        ]
        # on a CPU, compressing to fp16 costs the same cores the exchange runs on (measured:
        # no gain on Gloo), so exchanging less often comes first there
        advice = [*facts.comm_advice, *fewer] if cuda else [*fewer, *facts.comm_advice]
        return Verdict(
            "communication",
            f"waiting for gradient communication took {_pct(comm_share)} of the step time",
            evidence,
            advice,
        )
    if cuda and facts.peak_mem_mb and facts.device_mem_mb:
        used = facts.peak_mem_mb / facts.device_mem_mb
        if used >= MEMORY_SHARE:
            return Verdict(
                "memory",
                f"the peak allocation reached {_pct(used)} of the GPU's memory",
                evidence,
                memory_advice(facts.batch_size, facts.checkpointable),
            )
    if cuda and b.gpu_busy is not None and b.gpu_busy < GPU_BUSY:
        return Verdict(
            "overhead",
            f"the GPU was busy only {_pct(b.gpu_busy)} of the time: it keeps up with the host's "
            f"kernel launches",
            evidence,
            [
                ("speed.compile=reduce-overhead", "CUDA graphs: one launch replays the whole step"),
                bigger_batch,
                ("speed.compile=default", "fused kernels: fewer launches per step"),
            ],
        )
    if not cuda and facts.flop_utilisation is not None and facts.flop_utilisation < FLOP_SHARE:
        return Verdict(
            "overhead",
            f"the model's arithmetic ran at {100 * facts.flop_utilisation:.1f}% of this CPU's "
            f"matmul peak: per-step costs (Python, operator dispatch, the optimizer's loop over "
            f"parameters) outweigh it",
            evidence,
            [
                bigger_batch,
                ("speed.optimizer_impl=foreach", "one batched kernel per optimizer operation"),
                ("speed.compile=default", "fused kernels, less dispatch per step"),
            ],
        )
    if facts.contended:
        unless = "if the machine's arithmetic, not the neighbours, bounds it: "
        return Verdict(
            "contended",
            "other work shared the machine while it was timed, so what bounds the run itself "
            "cannot be told: " + "; ".join(facts.contention),
            evidence + [f"contention: {line}" for line in facts.contention],
            [
                (
                    "repeats=3",
                    "with -m: repeats run round-robin, the report sets contended ones aside",
                ),
                *((override, unless + why) for override, why in _compute_advice(facts)),
            ],
        )
    detail = "the device's arithmetic is the limit"
    if facts.flop_utilisation is not None:
        detail += f" (model FLOPs at {100 * facts.flop_utilisation:.0f}% of the measured peak)"
    return Verdict("compute", detail, evidence, _compute_advice(facts))


def _compute_advice(facts: RunFacts) -> list[Advice]:
    """What speeds up arithmetic-bound steps: half precision and, on a GPU, the tensor cores'
    switches, compile, a bigger batch where memory has room; then more devices."""
    cuda = facts.device_type == "cuda"
    advice = [("precision=bf16", "half-width arithmetic (tensor cores on a GPU)")]
    if cuda:  # on a CPU, precision=amp is bf16 autocast
        advice.append(("precision=amp", "fp16 with loss scaling"))
    if cuda and facts.convolutional:
        advice.append(("speed.channels_last=true", "the layout tensor cores want for convolutions"))
    if cuda:
        advice.append(("speed.tf32=true", "TF32 tensor cores for what stays fp32"))
        advice.append(("speed.compile=default", "fused kernels: fewer round trips to memory"))
    used = facts.peak_mem_mb / facts.device_mem_mb if cuda and facts.device_mem_mb else None
    if used is not None and used < ROOM_SHARE:  # the batch can grow
        advice.append(
            (
                f"data.batch_size={2 * facts.batch_size}",
                f"the GPU has room (peak {_pct(used)} of its memory): more work per step",
            )
        )
    if facts.scale_out is not None:
        advice.append(facts.scale_out)
    return advice


CHECKPOINT_ADVICE = (
    "speed.activation_checkpointing=full",
    "each block keeps only its input and runs its forward again in the backward: most of the "
    "activations' memory for about a third more compute",
)


def memory_advice(batch_size: int, checkpointable: bool = False) -> list[Advice]:
    """The ways to need less memory per device, the cheapest first; activation checkpointing
    where the model has blocks to checkpoint (`checkpointable`)."""
    return [
        ("precision=bf16", "half-width activations: about half the memory they take"),
        ("precision=amp", "fp16 activations, with loss scaling"),
        ("precision=bf16_true", "bf16 weights, gradients and optimizer state: half their memory"),
        (
            f"data.batch_size={max(1, batch_size // 2)} parallelism.accumulate_steps=2",
            "the same samples per optimizer step, half the activations at a time",
        ),
        *([CHECKPOINT_ADVICE] if checkpointable else []),
        *MEMORY_ADVICE,  # the strategies' own
    ]
