"""Who uses the engine now: the sampling lane generating, or the training lane changing what the engine holds.

The two lanes of a worker run at the same time (worker/serving/sampling_lane.py), but an engine in this process
serves one caller at a time, and a sync must never change weights under a running sample. So every call that
changes the engine's models (a sync, a create, a load, a restore) and every run of generation holds the gate; a
run asks `wanted()` between its steps and admits nothing more while someone waits, so a change waits at most for
the run in hand to drain, never for a stream of samples."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class EngineGate:
    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entered by a restore that replays a sync
        self._count = threading.Lock()
        self._waiting = 0

    @contextmanager
    def hold(self) -> Iterator[None]:
        with self._count:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count:
                self._waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    def wanted(self) -> bool:
        """Someone waits for the engine: a running batch should drain rather than admit more."""
        return self._waiting > 0
