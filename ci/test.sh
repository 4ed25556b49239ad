#!/usr/bin/env bash
# Sets up a fresh machine (ci/setup.sh; quick when already set up) and runs every test,
# on two TensorFlow versions:
#   1. profile "default": TensorFlow 2.18.1 + Keras 3 + Horovod 0.28.1 (Gloo, MPI) + mpi4py;
#   2. profile "tf221":   TensorFlow 2.21.0 + Keras 3 without Horovod (Horovod 0.28.1 does
#      not build against TF >= 2.19; its tests skip there, saying so), every test not
#      marked default_profile_only (launcher, supervision, restarts, repository tooling,
#      4-replica MirroredStrategy cases: tests/conftest.py says why).
# Unit tests run in two pytest-xdist worker processes (tests/unit), the rest in one;
# MirroredStrategy on logical CPU devices;
# MultiWorkerMirroredStrategy workers and horovodrun/mpirun jobs as local processes on
# 127.0.0.1 (each multi-process test starts, bounds and kills its own processes).
# Both profiles run even when the first fails; each one's pytest summary is printed at
# the end and the exit status is non-zero if either set-up or either test run failed.
#   DM_PROFILE="default" (or "tf221", or "default tf221") chooses the profiles.
#   DM_VENV_ROOT=DIR puts the virtual environments in DIR/.venv-<profile> (default: the
#   repository's .venv and .venv-tf221). Extra arguments go to pytest.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=2
profiles=${DM_PROFILE:-default tf221}
LOGS=$(mktemp -d "$ROOT/.test-logs.XXXXXX")
trap 'rm -rf "$LOGS"' EXIT
status=0
summaries=()
for profile in $profiles; do
  if [[ -n "${DM_VENV_ROOT:-}" ]]; then
    venv=$DM_VENV_ROOT/.venv-$profile
  elif [[ "$profile" == default ]]; then
    venv=${DM_VENV:-$ROOT/.venv}
  else
    venv=$ROOT/.venv-$profile
  fi
  echo "[test] profile $profile ($venv)"
  start=$SECONDS
  if ! DM_PROFILE=$profile DM_VENV=$venv bash "$ROOT/ci/setup.sh"; then
    status=1
    summaries+=("[test] profile $profile: SET-UP FAILED after $((SECONDS - start)) s")
    continue
  fi
  setup_s=$((SECONDS - start))
  only_once=()
  [[ "$profile" == default ]] || only_once=(-m "not default_profile_only")
  # The unit tests (one process each, starting nothing) on both cores (pytest-xdist),
  # then the rest one at a time (their jobs use both cores themselves). Arguments naming
  # tests (not only options) run as given, in one pytest.
  parts=("tests/unit -n 2" "tests --ignore=tests/unit")
  for arg in "$@"; do [[ "$arg" == -* ]] || { parts=(""); break; }; done
  rc=0
  : > "$LOGS/$profile.log"
  for part in "${parts[@]}"; do
    # shellcheck disable=SC2086
    DM_PROFILE=$profile "$venv/bin/python" -m pytest -p no:cacheprovider -ra --durations=25 "${only_once[@]}" $part "$@" 2>&1 \
      | tee -a "$LOGS/$profile.log"
    part_rc=${PIPESTATUS[0]}
    # (5: nothing collected in a part, e.g. options deselecting it all)
    ((part_rc == 0 || part_rc == 5)) || rc=$part_rc
  done
  ((rc == 0)) || status=1
  summary=$(grep -E '(passed|failed|errors?|skipped|deselected|no tests ran).* in [0-9.]+s' "$LOGS/$profile.log" \
            | sed -E 's/^=+ //; s/ =+$//' | paste -sd ';' | sed 's/;/; /g')
  summaries+=("[test] profile $profile: ${summary:-no pytest summary} (exit $rc; set-up ${setup_s} s, tests $((SECONDS - start - setup_s)) s)")
done
printf '%s\n' "${summaries[@]}"
exit $status
