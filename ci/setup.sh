#!/usr/bin/env bash
# Sets up a fresh Debian machine (run as root) for dist_minimize:
#   apt: Open MPI (for Horovod and mpi4py), a virtual environment at $DM_VENV
#   (default: <repo>/.venv), pinned TensorFlow, Horovod 0.28.1 built from source with
#   TensorFlow + Gloo + MPI, mpi4py built against the same Open MPI, and the package
#   itself (editable).
# A second run with nothing changed only checks and returns in seconds.
#   --relock   rewrite requirements/lock.txt from what is installed (maintainers only)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DM_VENV:-$ROOT/.venv}
PYTHON=${DM_PYTHON:-python3.11}
HOROVOD_VERSION=0.28.1
APT_PACKAGES=(openmpi-bin libopenmpi-dev g++ make)
STAMP="$VENV/.dist_minimize-setup"

log() { echo "[setup] $*"; }

fingerprint() {
  local f
  for f in ci/setup.sh requirements/pins.txt requirements/lock.txt pyproject.toml; do
    [[ -f "$ROOT/$f" ]] && sha256sum "$ROOT/$f"
  done | sha256sum | cut -d' ' -f1
}

if [[ "${1:-}" == "--relock" ]]; then
  "$VENV/bin/pip" freeze --exclude-editable | grep -v -E '^(horovod|dist.minimize)==' \
    | grep -v '^-e ' > "$ROOT/requirements/lock.txt"
  log "wrote requirements/lock.txt"
  exit 0
fi

# 1. System packages: only touch apt when something is missing.
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Fast path: everything installed from these exact inputs already.
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(fingerprint)" ]] \
   && "$VENV/bin/python" -c "import dist_minimize, tensorflow, horovod.tensorflow, mpi4py" 2>/dev/null; then
  log "up to date ($VENV)"
  exit 0
fi

# 2. Virtual environment.
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade "pip==24.3.1" "setuptools==75.6.0" "wheel==0.45.1"

CONSTRAINTS=()
[[ -s "$ROOT/requirements/lock.txt" ]] && CONSTRAINTS=(-c "$ROOT/requirements/lock.txt")

# 3. Pinned Python dependencies (TensorFlow, cmake < 4 for Horovod's Gloo, test tools).
log "installing pinned packages"
grep -v -E '^(mpi4py)==' "$ROOT/requirements/pins.txt" > "$VENV/.pins-nompi.txt"
"${PIP[@]}" install "${CONSTRAINTS[@]}" -r "$VENV/.pins-nompi.txt"

# 4. mpi4py from source against Debian's Open MPI (the MPI Horovod links to).
if ! "$VENV/bin/python" -c "import mpi4py" 2>/dev/null; then
  log "building mpi4py against $(command -v mpicc)"
  # mpi4py's generated MPI.c takes >10 minutes at the default -O3 -g on 2 cores; its
  # speed does not matter here (communicator set-up only), so compile it quickly.
  MPICC=mpicc CFLAGS="-O1 -g0" "${PIP[@]}" install --no-binary=mpi4py --no-cache-dir "${CONSTRAINTS[@]}" \
    "$(grep '^mpi4py==' "$ROOT/requirements/pins.txt")"
fi

# 5. Horovod from its sdist, against the TensorFlow just installed.
if ! "$VENV/bin/python" -c "import horovod.tensorflow" 2>/dev/null; then
  log "building horovod==$HOROVOD_VERSION (about 2-4 minutes)"
  "${PIP[@]}" install "${CONSTRAINTS[@]}" cloudpickle psutil pyyaml packaging cffi
  PATH="$VENV/bin:$PATH" \
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "${PIP[@]}" install --no-build-isolation --no-cache-dir "horovod==$HOROVOD_VERSION"
fi

# 6. The package itself, editable.
"${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"

"$VENV/bin/python" - <<'PY'
import tensorflow as tf, keras, horovod, mpi4py
import horovod.tensorflow as hvd
print(f"[setup] tensorflow {tf.__version__}, keras {keras.__version__}, "
      f"horovod {horovod.__version__} (mpi={hvd.mpi_built()}, gloo={hvd.gloo_built()}), "
      f"mpi4py {mpi4py.__version__}")
PY
fingerprint > "$STAMP"
log "done ($VENV)"
