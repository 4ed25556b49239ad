"""The expensive jobs of the distributed tests, each started at most once per test session
and shared by every test file that reads it (the first test that needs a job starts it;
a job that failed is not started again: every test that needs it fails with its log).

* `mirrored(n)`: tests/workers/mirrored_worker.py, every MirroredStrategy parity case on
  n logical CPUs (n = 2 and 4; a process each, since tf.distribute's collective group keys
  clash when strategies of different sizes share one);
* `multiworker(job, tmp_path_factory)`: 2 MultiWorkerMirroredStrategy worker processes
  (tests/workers/multiworker_worker.py) on 127.0.0.1, for the cases of MULTIWORKER_JOBS[job];
* `horovod(launcher, np, scenario, tmp_path_factory)`: one horovodrun (Gloo) or mpirun
  job of tests/workers/horovod_worker.py, bounded in time, its processes killed when it ends.

Also: the one-device references those jobs are compared with (`horovod_reference`,
`one_device`), and the run ids the tests take as their `run` parameter.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import parity_lib as P
import proc
from conftest import default_profile_only, requires_horovod
from dist_minimize import launcher

DEFAULT = tf.distribute.get_strategy()

# Multiworker parity cases ("OPT/MODE[/CLIP]"); model.fit through dm.integrate (stock
# Keras fit fails under MWMS: see test_parity.py's anchor).
MULTIWORKER_PARITY = ["sgd/callable", "adam/callable", "sgd/tape", "adam/tape",
                      "sgd-0.01/callable/never", "sgd-0.01/tape/never", "sgd-0.01/callable/some",
                      "sgd-0.01/tape/some",
                      "adam/fit_integrated/always", "sgd-0.01/fit_integrated/never", "sgd-0.01/fit_integrated/some"]
# Every update rule Keras exports: Keras's own trainer cannot run `fit` under
# MultiWorkerMirroredStrategy, so there it runs through `dist_minimize.integrate`.
# (Each rule's `fit` case runs under MirroredStrategy and horovodrun; under
# MultiWorkerMirroredStrategy, the test-time budget: the custom loop with the clip firing.)
KERAS_RULE_CASES = P.keras_rule_cases(keras)
MULTIWORKER_RULE_CASES = {case: case for case in KERAS_RULE_CASES if not case.endswith("/fit/none")}
MULTIWORKER_RULE_CASES.update({case: case for case in P.LAZY_CASES})
MULTIWORKER_JOBS = {
    "parity": MULTIWORKER_PARITY + ["lso_inf/0", "lso_inf/1", "accumulate/2", "accumulate/4", "sgd/fit_anchor"]
    + P.SAM_CASES + ["compress/fp16", "compress/powersgd:2"],
    "keras_rules": list(MULTIWORKER_RULE_CASES.values()),
    "sharded": [f"shard/{case}" for case in P.SHARD_CASES + P.SHARD_MORE_CASES + P.SHARD_MW_CASES]
    + ["shard_lso_inf/1"],
}

_results: dict = {}
_failed: dict = {}


def _once(key, start):
    """`start()`'s result, computed once per session; a failure is remembered."""
    if key in _failed:
        pytest.fail(_failed[key])
    if key not in _results:
        try:
            _results[key] = start()
        except (pytest.fail.Exception, AssertionError) as e:
            _failed.setdefault(key, str(e))
            raise
    return _results[key]


def mirrored(n: int) -> dict:
    """Results of every MirroredStrategy parity case on n replicas, by case."""
    def start():
        [(rc, out)] = proc.run_all([proc.python("tests/workers/mirrored_worker.py", str(n))],
                                   [proc.env()], timeout=proc.JOB_TIMEOUT)
        assert rc == 0, f"mirrored worker (N={n}) exited {rc}:\n{out[-5000:]}"
        line = next(l for l in out.splitlines() if l.startswith("RESULTS "))
        return json.loads(line[len("RESULTS "):])

    return _once(("mirrored", n), start)


def run_workers(out, cases, attempts: int = 4) -> list:
    """Both workers' (returncode, output); starts again on new ports when a worker could
    not bind its port (another process took it between the choice and the bind)."""
    for _ in range(attempts):
        ports = proc.free_ports(2)
        results = proc.run_all(
            [proc.python("tests/workers/multiworker_worker.py", str(out / f"w{i}.json"), *cases)
             for i in range(2)],
            [proc.env(TF_CONFIG=proc.tf_config(ports, i), DM_COLLECTIVE_TIMEOUT=60) for i in range(2)],
            timeout=proc.JOB_TIMEOUT,
        )
        if not any(rc != 0 and launcher.BIND_FAILURE in output for rc, output in results):
            break
    return results


def multiworker(job: str, tmp_path_factory) -> list:
    """Each of the 2 workers' results (by case) of the job MULTIWORKER_JOBS[job]."""
    def start():
        out = tmp_path_factory.mktemp(f"mw-{job}")
        for i, (rc, output) in enumerate(run_workers(out, MULTIWORKER_JOBS[job])):
            assert rc == 0, f"worker {i} exited {rc}:\n{output[-5000:]}"
        return [json.loads((out / f"w{i}.json").read_text())["results"] for i in range(2)]

    return _once(("multiworker", job), start)


def horovod(launcher_name: str, np_: int, scenario: str, tmp_path_factory) -> list:
    """The ranks' results of one horovodrun/mpirun job of tests/workers/horovod_worker.py."""
    def start():
        out = tmp_path_factory.mktemp(f"{launcher_name}-{np_}-{scenario}")
        log = out / "log.txt"
        try:
            with open(log, "w") as f:
                rc = launcher.launch(launcher_name, np_,
                                     [os.path.join(proc.ROOT, "tests/workers/horovod_worker.py"),
                                      str(out), scenario], timeout=proc.JOB_TIMEOUT, out=f, child_output=f)
        except BaseException:
            _failed[key] = f"{launcher_name} job was interrupted:\n{log.read_text()[-5000:]}"
            raise
        if rc != 0:
            pytest.fail(f"{launcher_name} job exited {rc}:\n{log.read_text()[-5000:]}")
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(np_)]

    key = ("horovod", launcher_name, np_, scenario)
    return _once(key, start)


def arrays(ws) -> list:
    return [np.array(w, dtype=np.float32) for w in ws]


_refs: dict = {}


def horovod_reference(opt_name, mode, clip="always") -> list:
    """dist_minimize on one device (no aggregation) on the global batches."""
    key = ("horovod", opt_name, mode, clip)
    if key not in _refs:
        _refs[key], _, _ = P.train(DEFAULT, opt_name, mode, aggregate="none", clip=clip)
    return _refs[key]


def split_case(case):
    """"OPT/MODE[_eager][/CLIP]" -> (OPT, MODE, CLIP) for a Horovod case."""
    opt_name, mode, clip = (case.split("/") + ["always"])[:3]
    return opt_name, mode.split("_")[0], clip


def run_param(run: str, *values, marks=()):
    """A pytest parameter (run, *values) whose id starts with the run's name; runs under
    Horovod are skipped (with the reason) where Horovod is not installed; runs on 4
    MirroredStrategy replicas are marked `default_profile_only` (see conftest.py)."""
    marks = [*marks, requires_horovod] if run.startswith("horovod") else list(marks)
    if run == "mirrored-4":
        marks.append(default_profile_only)
    return pytest.param(run, *values, id="-".join([run, *map(str, values)]), marks=marks)
