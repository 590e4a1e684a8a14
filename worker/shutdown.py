"""Stopping in bounded time, whatever Redis is doing.

SIGTERM or SIGINT asks the worker to stop: it takes no new job, admits no more samples into a running batch, and
returns once the job in hand is done. A worker whose Redis is frozen, down or slow may never get there (a call
blocked on a socket, a result write waiting out an outage), so a watchdog ends the process `grace_s` after the
first signal, with status 0: a stop, not a crash. Nothing acknowledged is dropped by that: the job in hand is
still in its shard's intermediate list (claims are atomic, worker/consumer/claim.py), parked ops are in Redis, and the
leases lapse after their TTL, so the next owner's recovery serves them. A second signal exits at once.
"""

import os
import threading
from collections.abc import Callable


class StopWatchdog:
    def __init__(self, grace_s: float, describe: Callable[[], str]) -> None:
        self.grace_s = grace_s
        self.describe = describe  # what the worker leaves behind, for the exit line; must not touch Redis
        self._armed = threading.Event()

    @property
    def armed(self) -> bool:
        return self._armed.is_set()

    def arm(self) -> None:
        """A stop was asked for (called from the signal handler): the grace starts. The second call exits at once."""
        if self._armed.is_set():
            _exit(f"second stop signal: exiting now ({self.describe()})")
        self._armed.set()
        timer = threading.Timer(self.grace_s, self._expire)
        timer.daemon = True  # dies with a clean exit: it fires only if the process has not exited by then
        timer.start()

    def _expire(self) -> None:
        _exit(f"did not stop within the {self.grace_s:g} s grace; exiting ({self.describe()}); what it had in "
              "hand stays in Redis for the next owner")


def _exit(message: str) -> None:
    # os.write, not logging: a handler's lock may be held by the stuck main thread
    os.write(2, f"tinkerq worker: {message}\n".encode())
    os._exit(0)
