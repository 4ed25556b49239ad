#!/usr/bin/env bash
# Sets up a fresh machine (ci/setup.sh) and runs the main job: data-parallel training
# with dist_minimize's cross-replica global-norm clipping (launch/train.py).
# Extra arguments go to launch/train.py (e.g. `bash ci/main_job.sh --epochs 10`).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DM_VENV:-$ROOT/.venv}
bash "$ROOT/ci/setup.sh"
exec "$VENV/bin/python" "$ROOT/launch/train.py" "$@"
