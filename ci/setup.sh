#!/usr/bin/env bash
# Sets up a fresh Debian machine (run as root) for dist_minimize.
#
# Profile DM_PROFILE (default "default"):
#   default  apt's Open MPI, a virtual environment, pinned tensorflow-cpu 2.18.1 + Keras 3,
#            mpi4py built against that Open MPI, Horovod 0.28.1 built from source with
#            TensorFlow + Gloo + MPI, and this package (editable).
#   tf221    tensorflow-cpu 2.21.0 + Keras 3, no Horovod or mpi4py (Horovod 0.28.1 does
#            not build against TF >= 2.19), and this package.
#   gpu      tensorflow[and-cuda] 2.18.1, mpi4py, Horovod with NCCL for GPU operations
#            (needs CUDA and NCCL headers, as in docker/gpu/Dockerfile).
# The virtual environment is DM_VENV (default: <repo>/.venv, or .venv-<profile>).
# Versions: requirements/pins-<profile>.txt, constrained by requirements/lock-<profile>.txt
# where it exists. A second run with nothing changed only checks and returns in seconds.
#   --relock   rewrite requirements/lock-<profile>.txt from what is installed (ci/lock.py:
#              `name==version` lines only, checked before setup.sh exits)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROFILE=${DM_PROFILE:-default}
case "$PROFILE" in
  default) DEFAULT_VENV=$ROOT/.venv; WITH_HOROVOD=1 ;;
  tf221)   DEFAULT_VENV=$ROOT/.venv-tf221; WITH_HOROVOD=0 ;;
  gpu)     DEFAULT_VENV=$ROOT/.venv; WITH_HOROVOD=1 ;;
  *) echo "[setup] DM_PROFILE must be default, tf221 or gpu. Received: DM_PROFILE=$PROFILE" >&2; exit 2 ;;
esac
VENV=${DM_VENV:-$DEFAULT_VENV}
PYTHON=${DM_PYTHON:-python3.11}
PINS=$ROOT/requirements/pins-$PROFILE.txt
LOCK=$ROOT/requirements/lock-$PROFILE.txt
HOROVOD_VERSION=0.28.1
APT_PACKAGES=(g++ make)
((WITH_HOROVOD)) && APT_PACKAGES+=(openmpi-bin libopenmpi-dev)
STAMP="$VENV/.dist_minimize-setup"

log() { echo "[setup] $*"; }

fingerprint() {
  local f
  for f in ci/setup.sh "requirements/pins-$PROFILE.txt" "requirements/lock-$PROFILE.txt" pyproject.toml; do
    [[ -f "$ROOT/$f" ]] && sha256sum "$ROOT/$f"
  done | sha256sum | cut -d' ' -f1
}

if [[ "${1:-}" == "--relock" ]]; then
  # name==version for every installed distribution, never pip freeze's `name @ file:///...`
  # (a wheel installed from a local path would pin a file only this machine has).
  "$VENV/bin/python" "$ROOT/ci/lock.py" write "$LOCK"
  exec "$VENV/bin/python" "$ROOT/ci/lock.py" check "$LOCK"
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

IMPORTS="import dist_minimize, tensorflow"
((WITH_HOROVOD)) && IMPORTS+=", horovod.tensorflow, mpi4py"

# Fast path: everything installed from these exact inputs already.
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(fingerprint)" ]] \
   && "$VENV/bin/python" -c "$IMPORTS" 2>/dev/null; then
  log "up to date ($PROFILE, ${VENV#$ROOT/})"
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
[[ -s "$LOCK" ]] && CONSTRAINTS=(-c "$LOCK")

# 3. Pinned Python dependencies (TensorFlow, cmake < 4 for Horovod's Gloo, test tools).
log "installing requirements/pins-$PROFILE.txt"
grep -v -E '^(mpi4py)==' "$PINS" > "$VENV/.pins-nompi.txt"
"${PIP[@]}" install "${CONSTRAINTS[@]}" -r "$VENV/.pins-nompi.txt"

if ((WITH_HOROVOD)); then
  # 4. mpi4py from source against Debian's Open MPI (the MPI Horovod links to).
  if ! "$VENV/bin/python" -c "import mpi4py" 2>/dev/null; then
    log "building mpi4py against $(command -v mpicc)"
    # mpi4py's generated MPI.c takes >10 minutes at the default -O3 -g on 2 cores; its
    # speed does not matter here (communicator set-up only), so compile it quickly.
    MPICC=mpicc CFLAGS="-O1 -g0" "${PIP[@]}" install --no-binary=mpi4py --no-cache-dir "${CONSTRAINTS[@]}" \
      "$(grep '^mpi4py==' "$PINS")"
  fi

  # 5. Horovod from its sdist, against the TensorFlow just installed.
  if ! "$VENV/bin/python" -c "import horovod.tensorflow" 2>/dev/null; then
    GPU_FLAGS=()
    [[ "$PROFILE" == gpu ]] && GPU_FLAGS=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED)
    log "building horovod==$HOROVOD_VERSION ${GPU_FLAGS[*]} (about 2-4 minutes)"
    "${PIP[@]}" install "${CONSTRAINTS[@]}" cloudpickle psutil pyyaml packaging cffi
    env PATH="$VENV/bin:$PATH" \
      HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
      HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 "${GPU_FLAGS[@]}" \
      "${PIP[@]}" install --no-build-isolation --no-cache-dir "horovod==$HOROVOD_VERSION"
  fi
fi

# 6. The package itself, editable.
"${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"

"$VENV/bin/python" - <<'PY'
import importlib.util
import tensorflow as tf, keras
line = f"[setup] tensorflow {tf.__version__}, keras {keras.__version__}"
if importlib.util.find_spec("horovod"):
    import horovod, mpi4py
    import horovod.tensorflow as hvd
    line += (f", horovod {horovod.__version__} (mpi={hvd.mpi_built()}, gloo={hvd.gloo_built()}, "
             f"nccl={hvd.nccl_built()}), mpi4py {mpi4py.__version__}")
else:
    line += ", no Horovod"
print(line)
PY
fingerprint > "$STAMP"
log "done ($PROFILE, $VENV)"
