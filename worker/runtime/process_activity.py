"""What else this process did while a stretch of work ran: garbage collections (how many, how long) and the CPU time
of its other threads. A sampling run slower in the worker than the same work in a bare process is either slowed from
inside the process, which these tell, or from outside it (the GPU, the host).

Linux only for the threads (/proc/self/task); elsewhere their CPU time reads as 0."""

import gc
import os
import threading
import time
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


class _Collections:
    """Every collection of this process, counted and timed (one gc callback, installed once)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._started


_COLLECTIONS = _Collections()
_INSTALL = threading.Lock()


def _install() -> None:
    with _INSTALL:
        if _COLLECTIONS not in gc.callbacks:
            gc.callbacks.append(_COLLECTIONS)


def _thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process, by thread id."""
    out = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) * _TICK_S
    return out


class Activity:
    """`with Activity() as a:` ... then a.collections, a.gc_ms, a.other_threads_cpu_ms (the threads other than the one
    that entered, still running at the end) and a.busiest (thread name or id, its CPU ms) for the stretch."""

    def __init__(self) -> None:
        _install()
        self.collections, self.gc_ms, self.other_threads_cpu_ms, self.busiest = 0, 0.0, 0.0, ("", 0.0)

    def __enter__(self) -> "Activity":
        self._own = threading.get_native_id()
        self._gc = (_COLLECTIONS.count, _COLLECTIONS.seconds)
        self._cpu = _thread_cpu_s()
        return self

    def __exit__(self, *_: object) -> None:
        self.collections = _COLLECTIONS.count - self._gc[0]
        self.gc_ms = (_COLLECTIONS.seconds - self._gc[1]) * 1000
        used = {tid: (cpu - self._cpu.get(tid, 0.0)) * 1000 for tid, cpu in _thread_cpu_s().items()
                if tid != self._own}
        self.other_threads_cpu_ms = sum(used.values())
        if used:
            tid = max(used, key=used.__getitem__)
            names = {t.native_id: t.name for t in threading.enumerate()}
            self.busiest = (names.get(tid, str(tid)), used[tid])

    def describe(self) -> str:
        return (f"{self.collections} gc collections ({self.gc_ms:.1f} ms), "
                f"other threads' CPU {self.other_threads_cpu_ms:.0f} ms"
                f" (most: {self.busiest[0]} {self.busiest[1]:.0f} ms)")
