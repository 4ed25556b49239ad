"""A smoke run of the benchmark suite (`benchmarks/run.py --quick`): it runs, writes
RESULTS.md and its JSON, and every ratio it reports is a finite positive number. It
measures nothing (the figures of a --quick run mean nothing; see benchmarks/RESULTS.md)."""

import importlib.util
import json
import math
import os
import signal
import subprocess
import time

import pytest

import proc
from dist_minimize import launcher

pytestmark = pytest.mark.distributed


SECTIONS = {"clip": "Clipping overhead", "custom": "A wrapper written from the docs",
            "guard": "The guard's mechanism", "sam": "SAM: dm.SAM against the hand-written"}


def test_quick_run_writes_finite_ratios(tmp_path):
    """The in-process sections in one quick run (one process: TensorFlow starts once)."""
    cmd = proc.python("benchmarks/run.py", "--quick", "--no-plot", "--only", ",".join(SECTIONS),
                      "--out", str(tmp_path), "--json", str(tmp_path / "r.json"))
    [(rc, out)] = proc.run_all([cmd], [proc.env()], timeout=300)
    assert rc == 0, out[-5000:]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "--quick" in text and "Targets" in out
    sections = json.loads((tmp_path / "r.json").read_text())
    assert len(sections) == len(SECTIONS)
    for title in SECTIONS.values():
        [section] = [s for s in sections if title in s["title"]]
        assert title in text
        checks = section["checks"]
        assert checks and all(math.isfinite(c["median"]) and c["median"] > 0 for c in checks), (title, checks)


def test_a_timed_out_section_leaves_no_process(tmp_path):
    # horovodrun starts its ranks in sessions of their own; a section that times out
    # must stop them too, not only the launcher's group.
    spec = importlib.util.spec_from_file_location("bench_run", os.path.join(proc.ROOT, "benchmarks", "run.py"))
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    pidfile = tmp_path / "pid"
    script = f"setsid sleep 300 & echo $! > {pidfile}; sleep 300"
    with pytest.raises(subprocess.TimeoutExpired):
        run._run_group(["bash", "-c", script], timeout=3)
    pid = int(pidfile.read_text())
    stat = launcher._stat(pid)
    tree = {pid: stat[19]} if stat else {}
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and launcher._alive(tree):
            time.sleep(0.1)
        assert not launcher._alive(tree), f"pid {pid} outlived the section"
    finally:
        for left in launcher._alive(tree):
            launcher._kill(left, signal.SIGKILL)


def test_a_focused_comparison_averages_each_side_over_its_builds(monkeypatch):
    """Each side of a focused comparison is several builds, each timed in every turn, a
    side's time the mean over its builds (a clock that the steps advance by hand)."""
    from benchmarks import _timing

    clock = [0.0]
    monkeypatch.setattr(_timing.time, "perf_counter", lambda: clock[0])

    def step(seconds):
        def run(n):
            clock[0] += seconds * n
        return run

    f = _timing.focused([step(1.0), step(3.0)], [step(1.0), step(1.0)], [step(1.0), step(2.0)], reps=5,
                        block_seconds=0.0)
    assert f.ratio.per_rep == [2.0] * 5
    assert f.control.per_rep == [1.5] * 5
    assert f.timings.per_step["a"] == [2.0] * 5
    one = _timing.focused(step(2.0), step(1.0), step(1.0), reps=3, block_seconds=0.0)
    assert one.ratio.per_rep == [2.0] * 3 and one.control.per_rep == [1.0] * 3
