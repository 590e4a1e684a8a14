"""What else the process did while a stretch of work ran (worker/runtime/process_activity.py): the reading the vLLM
engine's run log line carries, to tell a run slowed from inside the worker process from one slowed outside it."""

import gc
import threading
import time

from worker.runtime.process_activity import Activity


def test_collections_and_a_busy_thread_show_and_an_idle_stretch_shows_neither():
    with Activity() as idle:
        time.sleep(0.05)
    assert idle.collections == 0 and idle.other_threads_cpu_ms < 20

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    busy = threading.Thread(target=spin, name="spinner")
    with Activity() as loaded:
        busy.start()
        gc.collect()
        gc.collect()
        time.sleep(0.3)
    stop.set()  # a thread that ended before the stretch did is not counted: /proc no longer lists it
    busy.join()
    assert loaded.collections >= 2 and loaded.gc_ms > 0
    assert loaded.other_threads_cpu_ms >= 50 and loaded.busiest[0] == "spinner", loaded.describe()
