#!/usr/bin/env bash
# build_horovod.sh - build, cache, install and verify Horovod 0.28.1 for the
# torch that is already installed in a virtualenv.
#
# Usage: scripts/build_horovod.sh [VENV_DIR]      (default: <repo root>/.venv)
#
# Why a script instead of `pip install horovod`:
#   * Horovod ships only an sdist and its native extension must be compiled
#     against the exact torch in the venv.  pip's build isolation hides that
#     torch, so we build with --no-build-isolation (and never reuse pip's wheel
#     cache, which may hold a wheel built against a different torch).
#   * Horovod 0.28.1 compiles as C++14 (`set(CMAKE_CXX_STANDARD 14)` in the
#     top CMakeLists.txt and in horovod/torch/CMakeLists.txt; the top
#     CMakeLists also strips any -std= from CXXFLAGS, so CXXFLAGS cannot fix
#     it).  torch 2.14 headers need C++20, so both lines of the unpacked sdist
#     are patched to 20.  Patching only the torch one is not enough: the
#     bundled gloo would stay C++14 and the link fails with "multiple
#     definition of gloo::rendezvous::Store::kDefaultTimeout" (a static
#     constexpr member is an inline variable from C++17 on, but a strong
#     out-of-line definition in C++14).
#   * A CUDA build of torch makes Horovod's CMake require a CUDA toolkit
#     ("Could NOT find CUDAToolkit"), so CUDA_HOME / CUDAToolkit_ROOT are
#     pointed at one (default /usr/local/cuda).
#   * Some bundled third-party CMakeLists (gloo, flatbuffers) declare
#     cmake_minimum_required < 3.5, which CMake >= 4 rejects unless
#     CMAKE_POLICY_VERSION_MINIMUM is set.
#   * Building takes minutes, so the wheel is cached per
#     (torch version, python tag, cpu|cuda-nccl) under
#     ${XDG_CACHE_HOME:-$HOME/.cache}/accelexp/wheels/ and reused.
#
# Build flavour: Gloo-only CPU collectives (no MPI/TensorFlow/MXNet).  When a
# working nvidia-smi is present (and torch is a CUDA build) NCCL GPU operations
# are added ("cuda-nccl"); override with ACCELEXP_HOROVOD_VARIANT=cpu|cuda-nccl.
#
# After installing, `horovodrun --check-build` must report PyTorch and Gloo,
# and a 2-process Gloo run (allreduce + one DistributedOptimizer step) must
# succeed.  If horovod is already installed and importable against the current
# torch, the script exits immediately.
set -euo pipefail

HOROVOD_VERSION=0.28.1

log() { printf '[build_horovod] %s\n' "$*"; }
die() { printf '[build_horovod] ERROR: %s\n' "$*" >&2; exit 1; }

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_ARG="${1:-$REPO_ROOT/.venv}"
[[ -d "$VENV_ARG" ]] || die "virtualenv '$VENV_ARG' does not exist"
VENV="$(cd "$VENV_ARG" && pwd)"
PY="$VENV/bin/python"
[[ -x "$PY" ]] || die "$PY not found (is '$VENV' a virtualenv?)"

# Everything below (pip, cmake from the venv, horovodrun -> `python`) must
# resolve to the venv first.
export PATH="$VENV/bin:$PATH"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# ---------------------------------------------------------------------------
# 1. Fast path: already installed, importable, built against this torch (and
#    with NCCL when a GPU build is wanted).
# ---------------------------------------------------------------------------
gpu_present() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

REQUESTED_VARIANT="${ACCELEXP_HOROVOD_VARIANT:-}"
case "$REQUESTED_VARIANT" in
    ''|cpu|cuda-nccl) ;;
    *) die "ACCELEXP_HOROVOD_VARIANT must be 'cpu' or 'cuda-nccl', got '$REQUESTED_VARIANT'" ;;
esac
WANT_NCCL=0
if [[ "$REQUESTED_VARIANT" == cuda-nccl ]] || { [[ -z "$REQUESTED_VARIANT" ]] && gpu_present; }; then
    WANT_NCCL=1
fi

installed_ok() {
    "$PY" - "$HOROVOD_VERSION" "$WANT_NCCL" >/dev/null 2>&1 <<'EOF'
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch, horovod, horovod.torch as hvd
assert horovod.__version__ == sys.argv[1], horovod.__version__
meta = os.path.join(os.path.dirname(horovod.__file__), "metadata.json")
with open(meta) as f:
    assert json.load(f).get("pytorch") == torch.__version__
if sys.argv[2] == "1" and torch.version.cuda:
    assert hvd.nccl_built()
EOF
}

if installed_ok; then
    log "horovod already installed ($HOROVOD_VERSION, built for this torch) in $VENV"
    exit 0
fi

# ---------------------------------------------------------------------------
# 2. Inspect torch / python and pick the build variant + cache directory.
# ---------------------------------------------------------------------------
"$PY" -c 'import torch' 2>/dev/null \
    || die "torch is not importable in $VENV; install torch first (this script never installs torch)"

read -r TORCH_VERSION TORCH_CUDA PY_TAG < <("$PY" - <<'EOF'
import sys, torch
print(torch.__version__, torch.version.cuda or "none",
      "cp%d%d" % sys.version_info[:2])
EOF
)

if [[ "$WANT_NCCL" == 1 && "$TORCH_CUDA" != none ]]; then
    VARIANT=cuda-nccl
elif [[ "$REQUESTED_VARIANT" == cuda-nccl ]]; then
    die "variant cuda-nccl requested but torch $TORCH_VERSION is not a CUDA build"
else
    VARIANT=cpu
fi

CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/accelexp"
CACHE_DIR="$CACHE_ROOT/wheels/horovod-${HOROVOD_VERSION}-torch${TORCH_VERSION}-${PY_TAG}-${VARIANT}"
BUILD_LOG="$CACHE_DIR/build.log"
mkdir -p "$CACHE_DIR"
log "venv=$VENV torch=$TORCH_VERSION (cuda: $TORCH_CUDA) python=$PY_TAG variant=$VARIANT"
log "wheel cache: $CACHE_DIR"

# Serialise concurrent runs on the same machine (same cache dir).
exec 9>"$CACHE_DIR/.lock"
flock 9

find_cached_wheel() {
    compgen -G "$CACHE_DIR/horovod-${HOROVOD_VERSION}-*.whl" | head -n 1 || true
}

# ---------------------------------------------------------------------------
# 3. Build the wheel (only when not cached).
# ---------------------------------------------------------------------------
ensure_build_deps() {
    # Build/runtime deps of horovod; torch is deliberately NOT in this list.
    local missing
    missing="$("$PY" - <<'EOF'
import importlib.util
mods = {"setuptools": "setuptools", "packaging": "packaging", "cmake": "cmake",
        "psutil": "psutil", "cloudpickle": "cloudpickle", "yaml": "pyyaml",
        "cffi": "cffi"}
print(" ".join(pkg for mod, pkg in mods.items()
               if importlib.util.find_spec(mod) is None))
EOF
)"
    if [[ -n "$missing" ]]; then
        log "installing missing build dependencies: $missing"
        # shellcheck disable=SC2086
        "$PY" -m pip install --quiet $missing
    fi
}

setup_cuda_env() {
    local cuda_home="${CUDA_HOME:-${CUDAToolkit_ROOT:-/usr/local/cuda}}"
    [[ -x "$cuda_home/bin/nvcc" ]] \
        || die "torch is a CUDA build (CUDA $TORCH_CUDA), so Horovod's CMake needs a CUDA toolkit, but $cuda_home/bin/nvcc does not exist; set CUDA_HOME"
    export CUDA_HOME="$cuda_home" CUDAToolkit_ROOT="$cuda_home" HOROVOD_CUDA_HOME="$cuda_home"
    log "using CUDA toolkit $cuda_home ($("$cuda_home/bin/nvcc" --version | tail -n 1))"
}

setup_nccl_env() {
    # Use an explicitly configured NCCL, else the one in the CUDA toolkit, else
    # the nvidia-nccl wheel that CUDA torch depends on.  That wheel only ships
    # libnccl.so.2, so give CMake's find_library a libnccl.so symlink.
    export HOROVOD_GPU_OPERATIONS=NCCL
    if [[ -n "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_LIB:-}" ]] \
            || [[ -e "$CUDA_HOME/include/nccl.h" ]] || [[ -e /usr/include/nccl.h ]]; then
        return
    fi
    local nccl_dir
    nccl_dir="$("$PY" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null)" \
        || die "no NCCL found (set HOROVOD_NCCL_HOME or install NCCL)"
    [[ -e "$nccl_dir/lib/libnccl.so.2" ]] || die "no libnccl.so.2 in $nccl_dir/lib"
    mkdir -p "$WORK_DIR/nccl/lib"
    ln -sf "$nccl_dir/lib/libnccl.so.2" "$WORK_DIR/nccl/lib/libnccl.so"
    export HOROVOD_NCCL_INCLUDE="$nccl_dir/include" HOROVOD_NCCL_LIB="$WORK_DIR/nccl/lib" \
           HOROVOD_NCCL_LINK=SHARED
    log "using NCCL from $nccl_dir"
}

build_wheel() {
    WORK_DIR="$(mktemp -d "${TMPDIR:-/tmp}/accelexp-horovod-build.XXXXXX")"
    trap 'rm -rf "$WORK_DIR"' EXIT
    : >"$BUILD_LOG"

    ensure_build_deps

    # Horovod feature selection (Gloo-only CPU collectives).
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
           HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
           HOROVOD_CPU_OPERATIONS=GLOO
    unset HOROVOD_GPU_OPERATIONS
    if [[ "$TORCH_CUDA" != none ]]; then setup_cuda_env; fi
    if [[ "$VARIANT" == cuda-nccl ]]; then setup_nccl_env; fi

    # setup.py passes -j8 to make unless MAKEFLAGS is set; match the machine.
    local jobs
    jobs="$(nproc)"
    export MAKEFLAGS="-j$jobs" CMAKE_BUILD_PARALLEL_LEVEL="$jobs"
    # Bundled gloo/flatbuffers use cmake_minimum_required(< 3.5); CMake 4 needs this.
    export CMAKE_POLICY_VERSION_MINIMUM=3.5

    local sdist_cache="$CACHE_ROOT/sdists"
    local sdist="$sdist_cache/horovod-$HOROVOD_VERSION.tar.gz"
    mkdir -p "$sdist_cache"
    if [[ -s "$sdist" ]]; then
        log "using cached sdist $sdist"
    else
        log "downloading horovod==$HOROVOD_VERSION sdist"
        "$PY" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
            --no-cache-dir -d "$WORK_DIR/dl" "horovod==$HOROVOD_VERSION" >>"$BUILD_LOG" 2>&1 \
            || fail_build "downloading the horovod sdist failed"
        mv "$WORK_DIR/dl/horovod-$HOROVOD_VERSION.tar.gz" "$sdist.tmp.$$"
        mv "$sdist.tmp.$$" "$sdist"
    fi
    tar -xzf "$sdist" -C "$WORK_DIR"
    local src="$WORK_DIR/horovod-$HOROVOD_VERSION"

    # Patch: compile Horovod (and the bundled gloo it links) as C++20, which
    # torch's headers require (see header comment).
    local cm
    for cm in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 20)/' "$cm"
        grep -q 'set(CMAKE_CXX_STANDARD 20)' "$cm" || die "C++20 patch did not apply to $cm"
        if grep -q 'set(CMAKE_CXX_STANDARD 14)' "$cm"; then
            die "C++20 patch left a C++14 line in $cm"
        fi
    done

    log "building wheel with $jobs parallel jobs (several minutes; log: $BUILD_LOG)"
    local start=$SECONDS
    "$PY" -m pip wheel --no-build-isolation --no-deps --no-cache-dir -v \
        -w "$WORK_DIR/wheel" "$src" >>"$BUILD_LOG" 2>&1 \
        || fail_build "building the horovod wheel failed"
    log "wheel built in $((SECONDS - start))s"

    local built
    built="$(compgen -G "$WORK_DIR/wheel/horovod-${HOROVOD_VERSION}-*.whl" | head -n 1 || true)"
    [[ -n "$built" ]] || fail_build "pip wheel finished but produced no horovod wheel"
    # Move into the cache atomically (a partially copied wheel is never visible).
    mv "$built" "$CACHE_DIR/.$(basename "$built").tmp"
    mv "$CACHE_DIR/.$(basename "$built").tmp" "$CACHE_DIR/$(basename "$built")"
}

fail_build() {
    # The real compiler/linker error is usually far above pip's traceback.
    printf '[build_horovod] ---- first errors in %s ----\n' "$BUILD_LOG" >&2
    grep -m 15 -E 'error:|Error [0-9]|CMake Error|undefined reference|multiple definition' \
        "$BUILD_LOG" | cut -c 1-400 >&2 || true
    printf '[build_horovod] ---- last 40 lines of %s ----\n' "$BUILD_LOG" >&2
    tail -n 40 "$BUILD_LOG" | cut -c 1-400 >&2 || true
    die "$1 (full log: $BUILD_LOG)"
}

WHEEL="$(find_cached_wheel)"
if [[ -n "$WHEEL" ]]; then
    log "using cached wheel $(basename "$WHEEL")"
else
    build_wheel
    WHEEL="$(find_cached_wheel)"
fi

# ---------------------------------------------------------------------------
# 4. Install.
# ---------------------------------------------------------------------------
ensure_build_deps   # runtime deps (cloudpickle, psutil, pyyaml, cffi, packaging)
log "installing $(basename "$WHEEL")"
"$PY" -m pip install --quiet --no-deps --force-reinstall --no-cache-dir "$WHEEL"
flock -u 9

# ---------------------------------------------------------------------------
# 5. Verify.
# ---------------------------------------------------------------------------
log "horovodrun --check-build:"
CHECK_OUT="$("$VENV/bin/horovodrun" --check-build 2>&1)" \
    || { printf '%s\n' "$CHECK_OUT"; die "horovodrun --check-build failed"; }
printf '%s\n' "$CHECK_OUT"
grep -q '\[X\] PyTorch' <<<"$CHECK_OUT" || die "horovod was built without PyTorch support"
grep -q '\[X\] Gloo' <<<"$CHECK_OUT" || die "horovod was built without Gloo support"
if [[ "$VARIANT" == cuda-nccl ]]; then
    grep -q '\[X\] NCCL' <<<"$CHECK_OUT" || die "horovod was built without NCCL support"
fi

log "2-process Gloo smoke test (allreduce + DistributedOptimizer step)"
VERIFY_PY='
import warnings; warnings.simplefilter("ignore")
import torch
import horovod.torch as hvd

hvd.init()
assert hvd.size() == 2, hvd.size()

# allreduce: ranks contribute 1 and 2, the average must be 1.5
t = torch.full((4,), float(hvd.rank() + 1))
avg = hvd.allreduce(t, name="check_avg", op=hvd.Average)
assert torch.allclose(avg, torch.full((4,), 1.5)), avg

# one DistributedOptimizer step on a tiny model, with rank-specific data
torch.manual_seed(1234 + hvd.rank())
model = torch.nn.Linear(4, 1)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
before = model.weight.detach().clone()
loss = model(torch.randn(8, 4) + hvd.rank()).pow(2).mean()
opt.zero_grad()
loss.backward()
opt.step()
w = model.weight.detach().clone()
assert not torch.equal(w, before), "optimizer step did not change the weights"
# gradients were averaged, so all ranks must hold identical weights
assert torch.allclose(w, hvd.broadcast(w, root_rank=0, name="check_w")), "ranks diverged"
print(f"rank {hvd.rank()}/{hvd.size()}: allreduce + DistributedOptimizer OK", flush=True)
'
start=$SECONDS
timeout 180 "$VENV/bin/horovodrun" -np 2 -H localhost:2 --gloo \
    "$VENV/bin/python" -c "$VERIFY_PY" \
    || die "2-process horovodrun smoke test failed"
log "smoke test passed in $((SECONDS - start))s; horovod $HOROVOD_VERSION is ready in $VENV"
