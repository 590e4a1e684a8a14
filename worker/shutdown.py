"""Stopping in bounded time, whatever Redis is doing.

SIGTERM or SIGINT asks the worker to stop: it takes no new job, admits no more samples into a running batch, and
returns once the job in hand is done. A worker whose Redis is frozen, down or slow may never get there (a call
blocked on a socket, a result write waiting out an outage), so a watchdog ends the process `grace_s` after the
first signal, with status 0: a stop, not a crash. Nothing acknowledged is dropped by that: the job in hand is
still in its shard's intermediate list (claims are atomic, worker/claim.py), parked ops are in Redis, and the
leases lapse after their TTL, so the next owner's recovery serves them. A second signal exits at once.
"""

import os
import threading
import time
from collections.abc import Callable


class StopWatchdog:
    def __init__(self, grace_s: float, describe: Callable[[], str]) -> None:
        self.grace_s = grace_s
        self.describe = describe  # what the worker leaves behind, for the exit line; must not touch Redis
        self._armed = threading.Event()
        self._at = 0.0
        self._thread: threading.Thread | None = None

    @property
    def armed(self) -> bool:
        return self._armed.is_set()

    def start(self) -> None:
        """Start the watchdog thread (once); it waits for `arm` and then for the grace to run out."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="tinkerq-stop-watchdog", daemon=True)
            self._thread.start()

    def arm(self) -> None:
        """A stop was asked for (called from the signal handler). The second call exits at once."""
        if self._armed.is_set():
            _exit(f"second stop signal: exiting now ({self.describe()})")
        self._at = time.monotonic()
        self._armed.set()

    def _watch(self) -> None:
        self._armed.wait()
        time.sleep(max(0.0, self._at + self.grace_s - time.monotonic()))
        # Still here: the main thread is stuck. Daemon threads die with a clean exit, so reaching this line means
        # the process has not exited on its own within the grace.
        _exit(f"did not stop within the {self.grace_s:g} s grace; exiting ({self.describe()}); what it had in "
              "hand stays in Redis for the next owner")


def _exit(message: str) -> None:
    # os.write, not logging: a handler's lock may be held by the stuck main thread
    os.write(2, f"tinkerq worker: {message}\n".encode())
    os._exit(0)
