"""RQ's SimpleWorker, adapted to a long-lived, stateful, GPU-resident process.

- Jobs run in this process (never a fork): the loaded model and its snapshots persist.
- Only allowlisted job functions run (JSON gives no code execution, but func_name would).
- A side thread renews the shard leases and keeps RQ's heartbeats alive during long jobs, so
  RQ's registry cleanup never marks a running job abandoned.
- Every failure path ends with an ErrorResponse stored for the request.
- The idle loop ticks every `tick_s`, which lets the worker answer held ops whose deadline passed.
- A queued id whose job hash is gone is answered too (RQ would drop it without a trace).
"""

import logging
import threading
from collections.abc import Callable

from rq import Queue, SimpleWorker
from rq.job import Job
from rq.worker import WorkerStatus

from worker.jobs import ALLOWED_FUNCTIONS

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 60


class ForbiddenJob(Exception):
    pass


class AllowlistJob(Job):
    def perform(self):  # noqa: ANN201 - RQ's signature
        if self.func_name not in ALLOWED_FUNCTIONS:
            raise ForbiddenJob(f"function {self.func_name!r} is not an allowed tinkerq job function")
        return super().perform()


class LostJob(Exception):
    """A queued id whose RQ job hash is gone (deleted, or evicted by a Redis not set to noeviction)."""


class ShardQueue(Queue):
    # RQ's dequeue skips an id without a job hash in silence, and its client would wait for a result
    # forever. Raised with job_id and queue attached, it takes the path of an unloadable job instead.
    # (`_fetch_dequeued_job` is RQ-internal; rq is pinned exactly in pyproject.)
    @classmethod
    def _fetch_dequeued_job(cls, connection, queue_key: str, job_id: str, **kwargs):
        fetched = super()._fetch_dequeued_job(connection, queue_key, job_id, **kwargs)
        if fetched is None:
            lost = LostJob(f"job {job_id} was queued but its data is gone from Redis (deleted or evicted)")
            lost.job_id = job_id  # type: ignore[attr-defined]
            lost.queue = cls.from_queue_key(queue_key, connection=connection, serializer=kwargs.get("serializer"))  # type: ignore[attr-defined]
            raise lost
        return fetched


class ShardWorker(SimpleWorker):
    job_class = AllowlistJob
    queue_class = ShardQueue

    def __init__(
        self,
        *args,
        tick_s: int = 1,
        on_tick: Callable[[], None] | None = None,
        on_unloadable: Callable[[str, object, Exception], None] | None = None,
        **kwargs,
    ) -> None:
        self.tick_s = tick_s  # read by RQ's __init__ (connection timeout)
        self.on_tick = on_tick
        self.on_unloadable = on_unloadable
        super().__init__(*args, job_class=AllowlistJob, serializer="json", **kwargs)
        self.running: tuple | None = None
        self.stop_reason: str | None = None
        self._heartbeat_lock = threading.Lock()

    @property
    def dequeue_timeout(self) -> int:
        return self.tick_s

    @property
    def should_run_maintenance_tasks(self) -> bool:
        # RQ evaluates this once per loop turn, in the main thread, at least every tick_s.
        if self.on_tick is not None:
            try:
                self.on_tick()
            except Exception:  # noqa: BLE001 - a failed tick must not kill the loop
                log.exception("worker tick failed")
        return super().should_run_maintenance_tasks

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return HEARTBEAT_TTL_S

    def execute_job(self, job: Job, queue) -> None:
        execution = self.prepare_execution(job)
        self.running = (job, execution)
        try:
            self.perform_job(job, queue, execution)
        finally:
            with self._heartbeat_lock:
                self.running = None
        self.set_state(WorkerStatus.IDLE)

    def keep_running_job_alive(self) -> None:
        """Called from the side thread: refresh RQ's heartbeats for the job in progress."""
        with self._heartbeat_lock:
            if self.running is not None:
                self.maintain_heartbeats(*self.running)

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as exc:  # noqa: BLE001
                job_id = getattr(exc, "job_id", None)
                if job_id is None:
                    raise
                # The job hash exists but RQ cannot even load it: answer it and move on.
                log.error("job %s cannot be loaded (%s); answering it with an error", job_id, exc)
                if self.on_unloadable is not None:
                    self.on_unloadable(job_id, exc.queue, exc)

    def stop(self, reason: str) -> None:
        """Ask the loop to return after the current job (used when leases change)."""
        self.stop_reason = reason
        self._stop_requested = True
