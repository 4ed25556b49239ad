#!/usr/bin/env bash
# Host discovery for an elastic job inside a Slurm allocation (launch/launch.py
# --host-discovery-script launch/discovery/slurm_hosts.sh): one `host:slots` line per node
# of the allocation that Slurm still reports usable (not down, drained or failing), with
# DM_SLOTS_PER_NODE slots (default: SLURM_NTASKS_PER_NODE, else 1). A node the scheduler
# takes away disappears from the list; one it gives back reappears, and the job grows.
set -euo pipefail
slots=${DM_SLOTS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-1}}
: "${SLURM_JOB_NODELIST:?run inside a Slurm allocation (SLURM_JOB_NODELIST is not set)}"
# %N: node name, %t: compact state (idle, alloc, mix, drain, down, ...); one line per node.
sinfo --noheader --Node --nodes="$SLURM_JOB_NODELIST" --format="%N %t" \
  | awk -v slots="$slots" '$2 !~ /^(down|drain|drng|fail|failg|maint|boot|unk)/ && !seen[$1]++ {print $1 ":" slots}'
