"""The run record: every metric, param and tag name a run writes to MLflow, spelled once.

Writers (`train`, `diagnosis`, `parallel`, `timing`, `tracking`) and readers (`report`,
`tracking.query`) import the names from here. The values are MLflow's keys: changing one splits
old runs from new ones. Which config keys a run's identity leaves out (`config_hash`, the report's
like-for-like comparisons) follows from the schema: `accelexp.config.identity`.

Imports nothing of accelexp and nothing heavy (no torch, no mlflow): the config and the report
read it cheaply.
"""

from __future__ import annotations

import re

# --- a run's status (MLflow's): which one it closes with is `accelexp.outcome.status_of` ------
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"
RUNNING = "RUNNING"  # while its process lives (and after it died without a word, until healed)

# --- metrics of every epoch (step = the epoch) -----------------------------------------------
TRAIN_LOSS = "train_loss"
TRAIN_ACC = "train_acc"
VAL_LOSS = "val_loss"
VAL_ACC = "val_acc"
LR = "lr"  # at the epoch's start
EPOCH_TIME_S = "epoch_time_s"
SAMPLES_PER_S = "samples_per_s"  # over the epoch's timed steps, all workers together
SAMPLES_PER_S_PER_DEVICE = "samples_per_s_per_device"
TIMED_STEPS = "timed_steps"  # the steps samples_per_s was measured over (warm-up left out)
GRAD_SCALE = "grad_scale"  # the AMP loss scale
COMPILE_S = "compile_s"  # seconds torch.compile took in the epoch
ELAPSED_S = "elapsed_s"  # training seconds since the run began (earlier attempts included)
ACHIEVED_GFLOPS = "achieved_gflops"  # per device
# memory since the epoch's start: the busiest device's allocator peak (CUDA), else peak RSS
PEAK_MEM_MB = "peak_mem_mb"
STATE_MEM_MB = "state_mem_mb"  # parameters, gradients, optimizer state on this process


def stage_peak_mem_mb(stage: int) -> str:
    """The peak of one stage's device, for a model cut into stages."""
    return f"stage{stage}_peak_mem_mb"


# where the timed steps' time went (accelexp.timing): seconds per part, and a few figures
TIME_PARTS = ("input", "forward", "backward", "optimizer", "comm", "other")
TIME_COMM_INFLIGHT_S = "time/comm_inflight_s"  # communication in flight, hidden or not
TIME_COMM_OVERLAP = "time/comm_overlap"  # the share of it hidden behind compute (0..1)
TIME_GPU_BUSY = "time/gpu_busy"  # the share of the timed steps the GPU was surely busy (0..1)
TIME_METRICS = "time/*"  # the family, as messages name it


def time_s(part: str) -> str:
    """Seconds of the timed steps spent in `part` (one of TIME_PARTS): `time/input_s`."""
    return f"time/{part}_s"


def noise_metric(figure: str) -> str:
    """A contention figure of the epoch's timed steps (accelexp.diagnosis.noise)."""
    return f"noise/{figure}"


# --- metrics at the run's end (step = the last epoch) ----------------------------------------
BEST_VAL_ACC = "best_val_acc"
TEST_LOSS = "test_loss"  # of the best checkpoint
TEST_ACC = "test_acc"  # of the best checkpoint
TOTAL_TIME_S = "total_time_s"
TIME_TO_TARGET_S = "time_to_target_s"  # when val_acc first reached target_accuracy
THROUGHPUT = "throughput"  # samples/s, steady state: the epochs after the first
THROUGHPUT_LOW = "throughput_low"  # its 95 % interval (batch means)
THROUGHPUT_HIGH = "throughput_high"
THROUGHPUT_STEPS = "throughput_steps"  # the timed steps it was measured over
FLOP_UTILISATION = "flop_utilisation"  # achieved FLOP/s over the device's measured peak (0..1)
PEAK_GFLOPS = "peak_gflops"  # the device's measured matmul peak
MAX_BATCH = "max_batch"  # the largest batch per worker that fit (also a tag: how it was found)
STEP_PEAK_MB = "step_peak_mb"  # one training step's peak of live tensors (CPU, MemTracker)


def step_peak_kind_mb(kind: str) -> str:
    """STEP_PEAK_MB's share of one kind of tensor: `step_peak_activation_mb`."""
    return f"step_peak_{kind}_mb"


# HTA's figures of the profiled epoch (accelexp.diagnosis.profiler), percentages
HTA_IDLE_PCT = "hta/idle_pct"
HTA_COMPUTE_PCT = "hta/compute_pct"
HTA_NON_COMPUTE_PCT = "hta/non_compute_pct"
HTA_COMPUTATION_KERNEL_PCT = "hta/computation_kernel_pct"
HTA_COMMUNICATION_KERNEL_PCT = "hta/communication_kernel_pct"
HTA_MEMORY_KERNEL_PCT = "hta/memory_kernel_pct"
HTA_IDLE_HOST_WAIT_PCT = "hta/idle_host_wait_pct"
HTA_IDLE_KERNEL_WAIT_PCT = "hta/idle_kernel_wait_pct"
HTA_COMM_COMP_OVERLAP_PCT = "hta/comm_comp_overlap_pct"
HTA_SHORT_KERNELS_PCT = "hta/short_kernels_pct"
HTA_LAUNCH_DELAY_OUTLIERS_PCT = "hta/launch_delay_outliers_pct"

# --- params: the resolved config flattened (`model.name`, `data.batch_size`...), and -----------
TORCH_VERSION = "torch_version"
NUM_PARAMS = "num_params"  # the model's
TRAIN_SAMPLES = "train_samples"
# what the weights, gradients and optimizer state are stored in (Precision.describe): bfloat16
# under precision=bf16_true, else float32
PARAM_DTYPE = "param_dtype"
# facts that follow from the model, data and precision config (which the report compares): not
# compared
DERIVED_PARAMS = frozenset({NUM_PARAMS, TRAIN_SAMPLES, PARAM_DTYPE})
DATA_PLACEMENT = "data_placement"  # where batches are made (also a tag)
# the world's shape (Strategy.describe)
WORLD_SIZE = "world_size"  # processes (also a tag)
REPLICAS = "replicas"
DEVICES_PER_REPLICA = "devices_per_replica"
NUM_DEVICES = "num_devices"
DEVICE_TYPE = "device_type"  # cpu, cuda
STAGES = "stages"  # a model cut into stages: how many
SPLIT_POINTS = "split_points"
FSDP_UNITS = "fsdp_units"
FSDP_FP32_NORM_GROUPS = "fsdp_fp32_norm_groups"
FSDP_COMPILED_LAYERS = "fsdp_compiled_layers"


def stage_fact(stage: int, fact: str) -> str:
    """A fact of one stage (`params`, `layers`, `device`): `stage0_params`."""
    return f"stage{stage}_{fact}"


STAGE_FACT = re.compile(r"stage\d+_\w+")  # every stage_fact (and stage_peak_mem_mb)
# what scaling changes (besides parallelism.*): the world's shape, and how a model is cut
WORLD_SHAPE = (WORLD_SIZE, REPLICAS, DEVICES_PER_REPLICA, NUM_DEVICES, STAGES, SPLIT_POINTS)

# --- tags: what a run is (tracking.run_tags), to group and filter by ---------------------------
PARALLELISM = "parallelism"
PRECISION = "precision"
MODEL = "model"
DATA = "data"
REPEAT_INDEX = "repeat_index"  # which of the sweep's `repeats` this run is
REPEATS = "repeats"
# how the sweep paired this run with the others (accelexp.lockstep): repeats | lockstep
COMPARE = "compare"
COMPARE_LOCKSTEP = "lockstep"
COMPARE_REPEATS = "repeats"
# a lockstep run's process: its own (one per job: the jobs' processes differ), or one that every
# job of its incarnation shared (accelexp.lockstep.together: what a process carries is shared)
LOCKSTEP_PROCESS = "lockstep_process"
PROCESS_OWN = "own"
PROCESS_SHARED = "shared"
# a lockstep run's slices, step = the round: samples/s of each steady slice (each epoch's
# warm-up rounds left out), whether a neighbour shared the machine during it (1) or not (0), and
# which of the job's processes ran it (0, 1, ...: lockstep.epochs_per_process)
LOCKSTEP_SAMPLES_PER_S = "lockstep/samples_per_s"
LOCKSTEP_CONTENDED = "lockstep/contended"
LOCKSTEP_INCARNATION = "lockstep/incarnation"


def lockstep_file(rank: int) -> str:
    """In the job's folder: a rank's lockstep turns and step ends (the host's monotonic clock)."""
    return f"lockstep.rank{rank}.json"


OVERRIDES = "overrides"  # the command line's, credentials redacted
PLACEMENT = "placement"  # where a replica's layers live (the strategy's first part)
SYNC = "sync"  # how replicas agree (its second part)
SPEED = "speed"  # the speed switches on (SpeedSwitches.summary); each switch also its own tag
# the switch speed.activation_checkpointing as a word (SpeedSwitches.checkpointing): none | full |
# every<k> | op; a run from before it existed had none
ACTIVATION_CHECKPOINTING = "activation_checkpointing"
DEVICE = "device"  # what one process computes on: `cpu`, `NVIDIA H200 x2`
CONFIG_HASH = "config_hash"  # the training a config describes (resume=auto looks runs up by it)
CONFIG_ID = "config_id"  # the same less seed and repeat index: one row of the report per repeats
# the same less how long it runs (epochs, max steps) and with its speed keys: what a verdict's
# advice depends on (autotune's rejections are looked up by it)
SETTING_ID = "setting_id"
OUTPUT_DIR = "output_dir"  # the job's folder, where its checkpoints are
RESUMED_AFTER_EPOCH = "resumed_after_epoch"
# a sharded checkpoint resumed on another number of processes: that number, the latest (the
# params keep the first world's `world_size`)
RESUMED_WORLD_SIZE = "resumed_world_size"
GIT_COMMIT = "git_commit"
# where the run's process lives (tracking.life, when the run starts or resumes; a sweep's parent
# too): the next command on this host that opens the store marks a run still RUNNING whose
# process is gone FAILED, with ENDED saying why (tracking.life.heal_stale_runs)
HOST = "host"  # the machine's name (platform.node())
PID = "accelexp.pid"  # the process that tracks the run (a job's rank 0)
PROCESS_START = "accelexp.process_start"  # when it started, s since the epoch: a reused pid differs
PID_NAMESPACE = "accelexp.pid_namespace"  # the pids it counts among: another container's differ
ENDED = "accelexp.ended"  # "process 1234 on host X is gone; found by run.py at <time>"
# the user's own (`mlflow.tags`), that the speed-up ladder's rungs set (conf/rung)
RUNG = "rung"
RUNG_INDEX = "rung_index"
# a sweep: its parent run is tagged SWEEP_PARENT=true and SWEEP_DIR; its jobs PARENT_RUN, SWEEP
SWEEP_PARENT = "accelexp.sweep"
SWEEP_DIR = "sweep_dir"
PARENT_RUN = "mlflow.parentRunId"  # MLflow's own: the UI nests the run under its parent
SWEEP = "sweep"  # the sweep's name
# what run.py returns to a sweeper (accelexp.objective): the objectives' names and directions,
# comma-separated in order (`test_acc,samples_per_s`, `maximize,maximize`); on a run, and on the
# parent of a sweeper that optimizes them
OBJECTIVE = "objective"
OBJECTIVE_DIRECTIONS = "objective_directions"
# what the run's end found (accelexp.diagnosis)
DIAGNOSIS = "diagnosis"  # the bound: input, overhead, compute, communication, memory, contended
DIAGNOSIS_DETAIL = "diagnosis_detail"
DIAGNOSIS_NEXT = "diagnosis_next"  # the first override to try
DIAGNOSIS_ADVICE = "diagnosis_advice"  # every override to try, with why: JSON [[override, why]]
# the autotune loop (accelexp.autotune): each trial run's round, role and candidate, and for a
# candidate's runs what was decided and why; the parent run's AUTOTUNE_BEST is the line to paste
AUTOTUNE_ROUND = "autotune.round"
AUTOTUNE_ROLE = "autotune.role"  # base (the best so far) | candidate
AUTOTUNE_CANDIDATE = "autotune.candidate"  # the override tried on top of the base
AUTOTUNE_DECISION = "autotune.decision"  # kept | rejected
AUTOTUNE_KEPT = "kept"
AUTOTUNE_REJECTED = "rejected"
AUTOTUNE_WHY = "autotune.why"
AUTOTUNE_BASE_SETTING = "autotune.base_setting"  # the base's SETTING_ID
AUTOTUNE_BEST = "autotune.best"  # the overrides the loop ended with
NOISE = "noise"  # quiet | contended: was the machine shared while the run was timed
NOISE_CONTENDED = "contended"
NOISE_QUIET = "quiet"
NOISE_EVIDENCE = "noise_evidence"
HTA = "hta"  # whether Holistic Trace Analysis ran on the profiled epoch, or why not
# MAX_BATCH (above) is also a tag
