#!/usr/bin/env bash
# One process, MirroredStrategy over NP replicas (GPUs, else logical CPU devices).
#   NP=2 launch/mirrored.sh launch/train.py
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-.venv/bin/python}" launch/launch.py --launcher mirrored -np "${NP:-2}" -- "$@"
