"""Lock files that install on any machine: every line is `name==version`.

  python ci/lock.py write LOCK   writes LOCK from the distributions installed in this
                                 interpreter (not from `pip freeze`, which prints
                                 `name @ file:///...` for a wheel installed from a local
                                 path, a line no other machine can install)
  python ci/lock.py check FILE.. exits 1 naming every line that is not an exact pin

Runs on the interpreter of the environment being locked; needs nothing but the standard
library.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

# Built or installed by ci/setup.sh itself, not from the lock.
EXCLUDED = {"dist-minimize", "horovod", "pip", "setuptools", "wheel"}

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_VERSION = r"[0-9][A-Za-z0-9.+!_-]*"
PIN = re.compile(rf"^(?P<name>{_NAME})(?:\[[A-Za-z0-9,._-]+\])?==(?P<version>{_VERSION})$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def problems(path: str) -> list[str]:
    """Every line of a requirements file that is not `name==version` (or a comment)."""
    found = []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.split(" #")[0].strip() if not raw.lstrip().startswith("#") else ""
            if not line:
                continue
            where = f"{path}:{number}: {line!r}"
            if line.startswith("-"):
                found.append(f"{where}: an option line (editable, index, -r/-c or other); "
                             "pin `name==version` instead")
            elif "://" in line or line.startswith("file:") or " @ " in line or "@" in line:
                found.append(f"{where}: a URL or direct reference; pin `name==version` instead")
            elif "/" in line or "\\" in line or line.startswith("."):
                found.append(f"{where}: a path; pin `name==version` instead")
            elif ";" in line:
                found.append(f"{where}: an environment marker; lock files pin one platform")
            elif not PIN.match(line):
                found.append(f"{where}: not an exact pin `name==version`")
    return found


def installed_pins() -> list[str]:
    """`name==version` for every distribution this interpreter can import, sorted."""
    pins = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name or canonical(name) in EXCLUDED:
            continue
        pins[canonical(name)] = f"{name}=={dist.version}"
    return [pins[k] for k in sorted(pins)]


def write(path: str) -> int:
    lines = installed_pins()
    bad = [line for line in lines if not PIN.match(line)]
    if bad:
        print(f"[lock] refusing to write {path}: not exact pins: {bad}", file=sys.stderr)
        return 1
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"[lock] wrote {len(lines)} pins to {path}")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "write" and len(argv) == 2:
        return write(argv[1])
    if len(argv) >= 2 and argv[0] == "check":
        found = [p for path in argv[1:] for p in problems(path)]
        for p in found:
            print(f"[lock] {p}", file=sys.stderr)
        return 1 if found else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
