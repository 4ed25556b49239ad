#!/usr/bin/env bash
# Sets up a fresh machine (ci/setup.sh; quick when already set up) and runs every test,
# on two TensorFlow versions:
#   1. profile "default": TensorFlow 2.18.1 + Keras 3 + Horovod 0.28.1 (Gloo, MPI) + mpi4py;
#   2. profile "tf221":   TensorFlow 2.21.0 + Keras 3 without Horovod (Horovod 0.28.1 does
#      not build against TF >= 2.19; its tests skip there, saying so).
# Unit tests run in one process; MirroredStrategy on logical CPU devices;
# MultiWorkerMirroredStrategy workers and horovodrun/mpirun jobs as local processes on
# 127.0.0.1 (each multi-process test starts, bounds and kills its own processes).
# DM_PROFILE=default (or tf221) runs one profile only. Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=2
profiles=${DM_PROFILE:-default tf221}
for profile in $profiles; do
  echo "[test] profile $profile"
  DM_PROFILE=$profile bash "$ROOT/ci/setup.sh"
  case "$profile" in
    default) python=${DM_VENV:-$ROOT/.venv}/bin/python ;;
    *) python=$ROOT/.venv-$profile/bin/python ;;
  esac
  "$python" -m pytest -p no:cacheprovider -ra "$@"
done
