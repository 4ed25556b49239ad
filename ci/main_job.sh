#!/usr/bin/env bash
# Sets up a fresh machine (ci/setup.sh) and runs the main job: data-parallel training of
# launch/train.py with dist_minimize's cross-replica global-norm clipping, by default on
# 2 processes through `horovodrun -np 2 -H localhost:2 --gloo` (its servers on 127.0.0.1:
# dist_minimize/launch/horovod_runner.py; see docs/security.md).
#   bash ci/main_job.sh [--launcher horovod-gloo|horovod-mpi|mpirun|multiworker|mirrored]
#                       [-np N] [train.py arguments, e.g. --epochs 10]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DM_VENV:-$ROOT/.venv}
launcher=horovod-gloo
np=2
while (($#)); do
  case "$1" in
    --launcher) launcher=$2; shift 2 ;;
    -np) np=$2; shift 2 ;;
    *) break ;;
  esac
done
bash "$ROOT/ci/setup.sh"
cd "$ROOT"
exec "$VENV/bin/python" launch/launch.py --launcher "$launcher" -np "$np" --timeout 1800 -- launch/train.py "$@"
