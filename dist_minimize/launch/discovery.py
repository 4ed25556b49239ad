"""Which hosts and slots an elastic job may use now: a host discovery script (Horovod's
interface: it prints one `host:slots` line per host) run with a time bound, or a host
file read again at every ask. Part of `dist_minimize.launcher`; standard library only.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess

from dist_minimize.launch.plan import _read_hostfile

DISCOVERY_TIMEOUT = 10.0  # seconds a discovery script may take


class DiscoveryError(RuntimeError):
    """Discovery could not say which slots are available (the message says why)."""


def parse_slots(text: str, source: str) -> list[tuple[str, int]]:
    """`host:slots` lines (or `host`: one slot; blank lines and `#` comments ignored) ->
    [(host, slots)] in their order.

    Raises:
      DiscoveryError: a line that is not `host` or `host:slots` with slots >= 0, or a
        host named twice, naming `source` and the line.
    """
    found: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#")[0].strip()
        if not entry:
            continue
        host, sep, slots = entry.partition(":")
        valid = host and not any(c in host for c in " ,") and (not sep or (slots.isascii() and slots.isdigit()))
        if not valid or host in found:
            why = f"{host!r} is named twice" if valid else "expected `host:slots`"
            raise DiscoveryError(f"{source} printed line {number} {line.strip()!r}: {why}")
        found[host] = int(slots) if sep else 1
    return [(h, n) for h, n in found.items() if n > 0]


class Discovery:
    """Asks a host discovery script or a host file which slots are available.

    Args:
      script: a command (an executable and its arguments, split like a shell) printing
        `host:slots` lines and exiting with status 0.
      hostfile: a file of `host slots=N` or `host:N` lines, read again at every ask.
      timeout: seconds the script may run before it is killed and the ask fails.
    """

    def __init__(self, script: str | None = None, hostfile: str | None = None,
                 timeout: float = DISCOVERY_TIMEOUT):
        if (script is None) == (hostfile is None):
            raise ValueError(f"Give a host discovery script or a host file, one of them. Received: "
                             f"script={script!r}, hostfile={hostfile!r}")
        if not timeout > 0:
            raise ValueError(f"`timeout` must be > 0 seconds. Received: timeout={timeout!r}")
        self.script, self.hostfile, self.timeout = script, hostfile, timeout

    def __str__(self) -> str:
        return (f"the host discovery script {self.script!r}" if self.script is not None
                else f"the host file {self.hostfile!r}")

    def slots(self) -> list[tuple[str, int]]:
        """The hosts with free slots now, [(host, slots)].

        Raises:
          DiscoveryError: the script failed, ran past `timeout` or printed something
            else than `host:slots` lines; the host file cannot be read or is malformed.
        """
        if self.hostfile is not None:
            try:
                entries = _read_hostfile(self.hostfile)
            except (OSError, UnicodeDecodeError) as e:
                raise DiscoveryError(f"{self} cannot be read: {e}") from None
            return parse_slots("\n".join(entries), str(self))
        return parse_slots(self._run(), str(self))

    def _run(self) -> str:
        try:
            p = subprocess.Popen(shlex.split(self.script), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, errors="replace", start_new_session=True)
        except OSError as e:
            raise DiscoveryError(f"{self} cannot be started: {e}") from None
        try:
            out, err = p.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the script and whatever it started
            except ProcessLookupError:
                pass
            p.communicate()
            raise DiscoveryError(f"{self} did not finish within {self.timeout:g} s; it was killed") from None
        if p.returncode != 0:
            last = (err or out).strip().splitlines()[-1:] or ["(no output)"]
            raise DiscoveryError(f"{self} exited with status {p.returncode}: {last[0]}")
        return out


def take(slots: list[tuple[str, int]], n: int) -> str:
    """The `-H` host list of the first `n` of `slots`, in their order (`host:k,...`)."""
    chosen, left = [], n
    for host, count in slots:
        if left <= 0:
            break
        chosen.append(f"{host}:{min(count, left)}")
        left -= min(count, left)
    return ",".join(chosen)
