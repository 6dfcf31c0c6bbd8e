#!/usr/bin/env bash
# Set up everything accelexp needs, on a fresh machine or again on a set-up one (then in seconds):
#   1. Debian's dataset-fashion-mnist (the real data of the default run), chromium (the tests
#      look at the MLflow UI in it) and postgresql (the tests start throwaway clusters of its
#      server for a team's tracking store: tests/postgres.py), when apt is usable;
#   2. a virtual environment at .venv with torch/torchvision and the project (editable, with
#      the dev and team extras: tests, and the clients of a PostgreSQL/S3 tracking server);
#   3. Holistic Trace Analysis (HTA), which analyses the profile=true traces, and Hydra's Optuna
#      sweeper plugin (hydra/sweeper=optuna), each without its declared dependencies;
#   4. Horovod, compiled against that torch once and cached as a wheel (scripts/build_horovod.sh).
# Re-running skips every step whose result is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
# The torch build this project is tested with; `pip install` takes both from this machine's disk.
TORCH_SPEC=${TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

# 1. System packages (root + apt only; elsewhere data.download or data.root must provide the data,
#    and tests/test_team_store.py needs a PostgreSQL server installed some other way)
apt_packages=(dataset-fashion-mnist chromium postgresql)
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    say "not root or no apt: skipping ${missing[*]} (Fashion-MNIST will be downloaded or read from data.root; the team-store tests need PostgreSQL's server)"
  fi
fi

# 2. Virtual environment, torch, and the project
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
fi
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

wanted_torch=$(sed -n 's/.*torch==\([^ ]*\).*/\1/p' <<<"$TORCH_SPEC")
have_torch=$("$VENV/bin/python" -c 'import torch, torchvision; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have_torch" != "$wanted_torch" ]; then
  say "installing $TORCH_SPEC"
  # shellcheck disable=SC2086
  pip_install $TORCH_SPEC
fi

stamp="$VENV/.accelexp-setup"
digest=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$digest" ]; then
  say "installing accelexp and its dependencies"
  pip_install -e ".[dev,team]"  # team: a PostgreSQL/S3 tracking server's clients
  echo "$digest" >"$stamp"
fi

# 3. Holistic Trace Analysis, without its declared dependencies: they pull in JupyterLab and ~70
#    notebook packages it never imports, and pytest. What it does import (pandas, plotly, numpy,
#    networkx, psutil, PyYAML) comes with the project's dependencies and torch above.
HTA_VERSION=0.5.0
have_hta=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("HolisticTraceAnalysis"))' 2>/dev/null || true)
if [ "$have_hta" != "$HTA_VERSION" ]; then
  say "installing HolisticTraceAnalysis==$HTA_VERSION (--no-deps)"
  pip_install --no-deps "HolisticTraceAnalysis==$HTA_VERSION"
fi

# 3b. Hydra's Optuna sweeper plugin, without its declared dependencies: it declares optuna<3,
#     whose study storage fails under SQLAlchemy 2 (MLflow's); it runs on the optuna 5 that
#     pyproject.toml installs (see there).
OPTUNA_SWEEPER_VERSION=1.3.0
have_sweeper=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("hydra-optuna-sweeper"))' 2>/dev/null || true)
if [ "$have_sweeper" != "$OPTUNA_SWEEPER_VERSION" ]; then
  say "installing hydra-optuna-sweeper==$OPTUNA_SWEEPER_VERSION (--no-deps)"
  pip_install --no-deps "hydra-optuna-sweeper==$OPTUNA_SWEEPER_VERSION"
fi

# 4. Horovod (built against the torch above; cached)
if [ -x scripts/build_horovod.sh ]; then
  bash scripts/build_horovod.sh "$VENV"
fi
say "ready: $("$VENV/bin/python" -c 'import torch, accelexp; print("torch", torch.__version__, "| accelexp", accelexp.__version__)')"
