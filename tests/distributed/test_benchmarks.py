"""A smoke run of the benchmark suite (`benchmarks/run.py --quick`): it runs, writes
RESULTS.md and its JSON, and every ratio it reports is a finite positive number. It
measures nothing (the figures of a --quick run mean nothing; see benchmarks/RESULTS.md)."""

import json
import math

import pytest

import proc

pytestmark = pytest.mark.distributed


def test_quick_run_writes_finite_ratios(tmp_path):
    cmd = proc.python("benchmarks/run.py", "--quick", "--no-plot", "--only", "clip",
                      "--out", str(tmp_path), "--json", str(tmp_path / "r.json"))
    [(rc, out)] = proc.run_all([cmd], [proc.env()], timeout=120)
    assert rc == 0, out[-5000:]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "Clipping overhead" in text and "--quick" in text
    [section] = json.loads((tmp_path / "r.json").read_text())
    checks = section["checks"]
    assert checks and all(math.isfinite(c["median"]) and c["median"] > 0 for c in checks), checks
    assert "Targets" in out
