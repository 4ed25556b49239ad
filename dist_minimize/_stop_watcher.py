"""The stop request of `Checkpointer`: SIGTERM recorded as a flag, and a watchdog that
ends a process still blocked (on a dead peer's collective) `grace` seconds later."""

from __future__ import annotations

import os
import signal
import sys
import threading


class _StopWatcher:
    """Records SIGTERM as a stop request. A thread woken through `signal.set_wakeup_fd`
    sees the signal even while the main thread is blocked inside TensorFlow (a collective
    waiting for a dead peer) and ends the process with 128 + signal after `grace` seconds
    if it has not exited (or `close`d the watcher) by then."""

    SIGNALS = (signal.SIGTERM,)

    def __init__(self, grace: float):
        self.grace = grace
        self._event = threading.Event()
        self._closed = threading.Event()
        self._timer = None
        self._old = None
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only: stops then come from other workers
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old = ({s: signal.signal(s, self._handler) for s in self.SIGNALS}, signal.set_wakeup_fd(self._write))
        threading.Thread(target=self._watch, args=(read,), daemon=True, name="dm-stop-watcher").start()

    def _handler(self, signum, frame) -> None:
        self._event.set()

    def _watch(self, read: int) -> None:
        try:
            while not self._closed.is_set():
                data = os.read(read, 16)
                if not data or self._closed.is_set():
                    return
                signals = [b for b in data if b in {int(s) for s in self.SIGNALS}]
                if signals and self._timer is None:
                    self._event.set()
                    self._timer = threading.Timer(self.grace, _hard_exit, args=(128 + signals[0], self.grace))
                    self._timer.daemon = True
                    self._timer.start()
        finally:
            os.close(read)

    def requested(self) -> bool:
        return self._event.is_set()

    def close(self) -> None:
        if self._old is None:
            return
        self._closed.set()
        if self._timer is not None:
            self._timer.cancel()
        handlers, wakeup = self._old
        signal.set_wakeup_fd(wakeup)
        for s, h in handlers.items():
            signal.signal(s, h)
        self._old = None
        try:
            os.write(self._write, b"\0")  # wakes the thread, which closes its end
        finally:
            os.close(self._write)


def _hard_exit(code: int, grace: float) -> None:
    print(f"[dm] stop requested {grace:g} s ago and this process has not exited (blocked on a peer?); "
          f"exiting with {code}", file=sys.stderr, flush=True)
    os._exit(code)
