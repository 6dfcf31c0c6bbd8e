#!/usr/bin/env bash
# THE one script a session with a GPU runs on the device machine, from the repo root: checks, a
# lockstep A/A and the parity benchmark in one call that ends in under 9 minutes.
#
# Prepare, here, once per checkout (the device machine has torch 2.11, scipy and nvidia-ml-py but
# no hydra, omegaconf, mlflow or greenlet, and no internet):
#   bash ../shared/gpu/wheelhouse.sh        # fills ./.whl (~35 MB of wheels for Python 3.12)
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .whl greenlet   # lockstep's jobs in one process
#   echo /.whl/ >> .git/info/exclude        # keep them out of git; they travel by `carry`
#   DRY_RUN=1 bash scripts/gpu_session.sh   # prints the steps and their time limits, runs nothing
# Then make exactly this device call (the `run` tool), once:
#   run(command="bash scripts/gpu_session.sh", carry=[".whl"], timeout_s=570)
# and give the machine back (`give_back`) unless you rerun at once. What comes back under $OUT
# (at most 8 files): session.log, gpu_check.log, gpu_check.json, lockstep.log, lockstep.db (the
# A/A's MLflow store: every round), lockstep_sweep.log, parity.log, parity.md.
#
# The plan (PLAN=speed, the default), each step under `timeout` within SESSION_S (525 s) from the
# start (the ~ figures are estimates for an H200; the logs say what it took):
#   ~0:00  wheels into /tmp/site, nvidia-smi, torch/CUDA/GPU          ~20 s  (at most 120 + 60)
#   ~0:20  scripts/gpu_check.py, checks 1-9 (5 run.py jobs, one compiled) ~160 s (at most 170)
#   ~3:00  lockstep A/A (`benchmarks/noise.py --designs shared`): two identical ResNet-50 jobs,
#          32 px, batch 128, amp, 5 epochs of 300 steps, in one process taking turns in 0.25-s
#          slices; the ratio b / a with its interval, rounds and slices set aside. On the H200
#          machine a step of it took ~30 ms (host-bound: the GPU ~1 % busy), an epoch ~9.5 s a
#          job: ~130 s (at most 150)
#   ~5:30  benchmarks/gpu_parity.py --plan quick with what is left (~200 s) as --deadline-s: pairs
#          in plan order while they fit (measured 2026-12-04: 7 processes in 306 s, the first two
#          70-86 s), the rest skipped and listed, so it always ends with its table. Planned in
#          full (~11 min) it needs more than a session.
#
# PLAN=ladder (a session of its own, or after the others): the speed-up ladder, 6 rungs of
# ResNet-50 at 224 px, batch 256, 2 epochs of 12 steps (the compile rung compiles ~60 s), then its
# report (ladder.md, ladder.png) ~160 s. 12 steps per epoch (3072 images), not 30: each of its 6
# jobs generates its synthetic set on the host, and at 224 px that costs seconds per thousand images.
# PLAN=diagnosis (issue 11's checks, a session of their own) runs instead: ResNet-50 at 32 px,
# batch 128 with profile=true (expected: overhead-bound, the GPU kept waiting by launches; HTA's
# figures), the same with the override it suggests (speed.compile=reduce-overhead), and 224 px
# with the data forced to stay on the host (expected: input-bound); then
# `accelexp-report --diagnose` of the three (diagnosis.md). HTA needs three more wheels in .whl:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d .whl HolisticTraceAnalysis==0.5.0 plotly narwhals
# PLAN=memory (issue 13's checks, a session of their own; no extra wheels) runs gpu_check's FSDP
# checks 10 and 11 (fp16 GradScaler over sharded gradients and the largest-batch search; CPU
# offload with a ViT in bf16), then the memory-vs-speed study on this one GPU at 224 px, amp:
# vit_b_16 and resnet50 under fsdp (one worker: no sharding, but FSDP's mixed precision and the
# search) and model (2 stages on the GPU), each run searching its largest batch; its report
# (memory.md, memory_vs_speed.png). Out: session.log, gpu_check.log, gpu_check.json, memory.log,
# memory.md, memory_vs_speed.png.
# Environment: OUT (default outputs/gpu_session), PYTHON (default python3), SESSION_S, DRY_RUN,
# PLAN (speed | diagnosis | memory).
set -uo pipefail # no -e: one failed step must not stop the others
export PYTHONUNBUFFERED=1 GIT_PYTHON_REFRESH=quiet
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/outputs/gpu_session}
PY=${PYTHON:-python3}
SESSION_S=${SESSION_S:-525}
# the lockstep A/A's jobs: both sides' run.py overrides (set it to measure other ones)
LOCKSTEP_RUN=${LOCKSTEP_RUN:-model=resnet50 data=synthetic data.image_size=32 data.batch_size=128 \
data.num_train=38400 data.val_fraction=0 data.num_test=256 precision=amp}
DRY_RUN=${DRY_RUN:-}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/accelexp-session.XXXXXX)
LADDER_URI="sqlite:///$WORK/ladder.db"
FAILED=()

left() { echo $((SESSION_S - SECONDS)); }
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$OUT/session.log"; }

# step NAME LOG SECONDS COMMAND...: COMMAND under `timeout` (cut to the session's time left),
# its output shown and appended to $OUT/LOG; a non-zero exit (124: timed out) is remembered.
step() {
    local name=$1 logfile=$2 limit=$3
    shift 3
    local avail=$(($(left) - 5))
    ((limit > avail)) && limit=$avail
    if ((limit < 20)); then
        log "SKIP $name: only ${avail}s of the session left"
        FAILED+=("$name (skipped)")
        return
    fi
    log "START $name (timeout ${limit}s): $*"
    if [[ -n $DRY_RUN ]]; then
        return
    fi
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$OUT/$logfile"
    local rc=$?
    log "END $name: exit $rc$( ((rc == 124)) && echo ' (timed out)')"
    ((rc == 0)) || FAILED+=("$name (exit $rc)")
}

log "accelexp GPU session: OUT=$OUT, work in $WORK, ${SESSION_S}s"
if [[ -d .whl ]]; then
    step wheels session.log 120 "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
    log "no .whl here: hydra, omegaconf and mlflow must already be importable"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} # accelexp from the checkout, not installed
if [[ -z $DRY_RUN ]]; then
    { nvidia-smi || echo "nvidia-smi failed"; } 2>&1 | tee -a "$OUT/session.log"
fi
step versions session.log 60 "$PY" -c "import torch, hydra, omegaconf, mlflow, scipy, greenlet
print('scipy', scipy.__version__)
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'cuDNN', torch.backends.cudnn.version())
print('GPU', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print('hydra', hydra.__version__, 'omegaconf', omegaconf.__version__, 'mlflow', mlflow.__version__)"

if [[ ${PLAN:-speed} == diagnosis ]]; then
    DIAG_URI="sqlite:///$WORK/diagnosis.db"
    common=(model=resnet50 data=synthetic epochs=2 data.val_fraction=0 data.num_test=256
        progress=false mlflow.experiment=diagnosis "mlflow.tracking_uri=$DIAG_URI")
    small=(data.image_size=32 data.batch_size=128 data.num_train=7680 max_steps_per_epoch=60)
    step launch_bound diagnosis.log 120 "$PY" run.py "${common[@]}" "${small[@]}" profile=true \
        mlflow.run_name=resnet50-32px-eager "hydra.run.dir=$WORK/eager"
    step graphs diagnosis.log 150 "$PY" run.py "${common[@]}" "${small[@]}" \
        speed.compile=reduce-overhead mlflow.run_name=resnet50-32px-cudagraphs \
        "hydra.run.dir=$WORK/graphs"
    step input_bound diagnosis.log 120 "$PY" run.py "${common[@]}" data.image_size=224 \
        data.batch_size=256 data.num_train=3072 max_steps_per_epoch=12 data.on_device=false \
        mlflow.run_name=resnet50-224px-host-data "hydra.run.dir=$WORK/host"
    step diagnose diagnosis.log 60 "$PY" -m accelexp.report --experiment diagnosis --diagnose \
        --tracking-uri "$DIAG_URI" --format markdown --output-dir "$WORK/report"
    cp "$WORK/report/diagnosis.md" "$WORK/report/time_breakdown.png" "$OUT/" 2>/dev/null
    [[ -n $DRY_RUN ]] && rm -rf "$WORK"
    log "done in ${SECONDS}s; failed or skipped: ${FAILED[*]:-none}"
    ((${#FAILED[@]} == 0))
    exit
fi

if [[ ${PLAN:-speed} == memory ]]; then
    MEM_URI="sqlite:///$WORK/memory.db"
    step fsdp_checks gpu_check.log 150 "$PY" scripts/gpu_check.py --only 10,11 \
        --json "$OUT/gpu_check.json"
    step memory_study memory.log 300 "$PY" run.py -m +experiment=memory_vs_speed \
        model=vit_b_16,resnet50 parallelism=fsdp,model parallelism.nprocs=1 precision=amp \
        data.image_size=224 data.batch_size=64 data.num_train=1024 data.num_test=128 \
        max_steps_per_epoch=14 threads=null progress=false "mlflow.tracking_uri=$MEM_URI" \
        "hydra.sweep.dir=$WORK/memory"
    step memory_report memory.log 60 "$PY" -m accelexp.report --experiment memory_vs_speed \
        --memory --tracking-uri "$MEM_URI" --format markdown --output-dir "$WORK/report"
    cp "$WORK/report/memory.md" "$WORK/report/memory_vs_speed.png" "$OUT/" 2>/dev/null
    [[ -n $DRY_RUN ]] && rm -rf "$WORK"
    log "done in ${SECONDS}s; failed or skipped: ${FAILED[*]:-none}"
    ((${#FAILED[@]} == 0))
    exit
fi

if [[ ${PLAN:-speed} == ladder ]]; then
    step ladder ladder.log 200 "$PY" run.py -m +experiment=speedups model=resnet50 \
        data.image_size=224 data.batch_size=256 epochs=2 max_steps_per_epoch=12 \
        data.num_train=3072 data.val_fraction=0 data.num_test=256 data.eval_batch_size=256 \
        progress=false "mlflow.tracking_uri=$LADDER_URI" "hydra.sweep.dir=$WORK/ladder"
    report_s=$(($(left) - 5 < 60 ? $(left) - 5 : 60))
    log "START report (timeout ${report_s}s)"
    if [[ -z $DRY_RUN ]] && ((report_s > 5)); then
        timeout "$report_s" "$PY" -m accelexp.report --experiment speedups --tracking-uri "$LADDER_URI" \
            --format markdown --output-dir "$WORK/report" >"$OUT/ladder.md" 2>>"$OUT/ladder.log"
        rc=$?
        log "END report: exit $rc"
        ((rc == 0)) || FAILED+=("report (exit $rc)")
        cp "$WORK/report/ladder.png" "$OUT/" 2>/dev/null || cp "$WORK/ladder/report/ladder.png" \
            "$OUT/" 2>/dev/null || log "no ladder.png from the report"
        cat "$OUT/ladder.md"
    fi
    [[ -n $DRY_RUN ]] && rm -rf "$WORK"
    log "done in ${SECONDS}s; failed or skipped: ${FAILED[*]:-none}"
    ((${#FAILED[@]} == 0))
    exit
fi

step gpu_check gpu_check.log 170 "$PY" scripts/gpu_check.py --only 1,2,3,4,5,6,7,8,9 --json "$OUT/gpu_check.json"

# lockstep A/A on one GPU: two identical ResNet-50 jobs (32 px, launch-bound: where the host's
# noise shows) as greenlets of one process taking turns in 0.25-s slices; its store comes back
step lockstep_aa lockstep.log 150 env TMPDIR="$WORK" "$PY" benchmarks/noise.py --designs shared \
    --trials 1 --hogged-trials 0 --repeats 1 --epochs 5 --steps 300 --threads 4 --slice-s 0.25 \
    --keep --run-args "$LOCKSTEP_RUN"
cp "$WORK"/accelexp-aa-*/mlflow.db "$OUT/lockstep.db" 2>/dev/null
cp "$WORK"/accelexp-aa-*/shared-0.log "$OUT/lockstep_sweep.log" 2>/dev/null

deadline=$(($(left) - 25)) # the parity benchmark's own cut; `timeout` is the hard stop after it
step parity parity.log $((deadline + 15)) "$PY" benchmarks/gpu_parity.py --plan quick \
    --deadline-s "$deadline" --out "$OUT/parity.md"

if [[ -n $DRY_RUN ]]; then # what the parity benchmark would plan with the whole session
    "$PY" benchmarks/gpu_parity.py --plan quick --dry-run
    rm -rf "$WORK"
fi
log "done in ${SECONDS}s; failed or skipped: ${FAILED[*]:-none}"
[[ -f $OUT/gpu_check.json ]] && cat "$OUT/gpu_check.json"
ls -la "$OUT" | tee -a "$OUT/session.log"
((${#FAILED[@]} == 0))
