#!/usr/bin/env bash
# NP MultiWorkerMirroredStrategy workers on this host (TF_CONFIG written for each,
# ports from PORT or free ones).
#   NP=2 PORT=23456 launch/multiworker_local.sh launch/train.py
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-.venv/bin/python}" launch/launch.py --launcher multiworker -np "${NP:-2}" ${PORT:+--port "$PORT"} -- "$@"
