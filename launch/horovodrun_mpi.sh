#!/usr/bin/env bash
# horovodrun (mpi) on NP processes (default 2) over HOSTS (default localhost:NP).
#   NP=4 HOSTS=node1:2,node2:2 launch/horovodrun_mpi.sh launch/train.py --epochs 10
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-.venv/bin/python}" launch/launch.py --launcher horovod-mpi -np "${NP:-2}" ${HOSTS:+-H "$HOSTS"} -- "$@"
