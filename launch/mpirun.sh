#!/usr/bin/env bash
# Plain mpirun (Open MPI) on NP processes (default 2) over HOSTS or HOSTFILE.
#   NP=4 HOSTFILE=hosts.txt launch/mpirun.sh launch/train.py
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-.venv/bin/python}" launch/launch.py --launcher mpirun -np "${NP:-2}" ${HOSTS:+-H "$HOSTS"} ${HOSTFILE:+--hostfile "$HOSTFILE"} -- "$@"
