#!/usr/bin/env bash
# Sets up a fresh machine (ci/setup.sh; quick when already set up) and runs every test:
# unit tests in one process, MirroredStrategy on logical CPU devices, and
# MultiWorkerMirroredStrategy workers as local processes on 127.0.0.1 (each
# multi-process test starts, bounds and kills its own processes).
# Extra arguments go to pytest (e.g. `bash ci/test.sh -k mirrored`).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DM_VENV:-$ROOT/.venv}
bash "$ROOT/ci/setup.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=2
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -ra "$@"
