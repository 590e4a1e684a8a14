"""RQ's SimpleWorker, adapted to a long-lived, stateful, GPU-resident process.

- Jobs run in this process (never a fork): the loaded model and its snapshots persist.
- Every job read from Redis is untrusted: a queue entry that is not a request id is dropped at the pop, and
  every job RQ loads is judged by `admit` (worker/consumer/admission.py) before RQ acts on it. A job hash is loaded
  without the RQ fields through which RQ would import code, send HTTP requests or enqueue and re-run jobs.
- Only jobs named in `tinkerq/jobs.py` run, and their names are never imported: each runs in the worker's context
  (its dispatcher). JSON gives no code execution, but importing func_name would.
- A side thread renews the shard leases and keeps RQ's heartbeats alive during long jobs, so
  RQ's registry cleanup never marks a running job abandoned.
- Every failure path ends with an ErrorResponse stored for the request.
- The idle loop ticks every `tick_s`, which lets the worker answer held ops whose deadline passed.
- A queued id whose job hash is gone is answered too (RQ would drop it without a trace).
- The pop is worker/consumer/claim.py's: a job moves from its queue to the queue's intermediate list (the claimed
  list) in one step that checks the lease, and leaves that list only once it ended (or went back to the queue head).
- A Redis outage anywhere in the loop ends `work()` with `outage` set, never a crash: the job in hand stays in
  flight, or goes back to its queue when the lease was lost, and is never marked FAILED for it. WorkerProcess
  waits for Redis, recovers and starts a new incarnation.

RQ internals relied on (rq is pinned exactly in pyproject; each is re-checked by a test):
`Job.restore` (every load of a hash: `Job.fetch`, `Job.fetch_many`, `Queue.fetch_job`, the registries'
cleanup), the hash field names it reads, `Queue.lpop` / `Queue.lmove` (the pop, before `dequeue_any` decodes
the id), `Queue._fetch_dequeued_job`, `Queue.move_dependents_to_ready` / `enqueue_dependents` (called by the
worker's success and failure paths), `BaseWorker.work` and `dequeue_job_and_maintain_ttl` (both replaced; the loop
calls RQ's `bootstrap`, `check_for_suspension`, `execute_job` and `heartbeat`), `heartbeat`, `set_state` and
`handle_job_success` (wrapped or replaced to save round trips; the last calls `Job._handle_success`, `Job.cleanup`,
`cleanup_execution` and the worker's counters), `prepare_job_execution`,
`Job._execute` (where RQ would import and call the job's function),
`handle_exception` / `handle_job_failure` (in that order, from `_finalize_failure`), `heartbeat` and `teardown`,
`run_maintenance_tasks` and `Queue.intermediate_queue` (whose `cleanup` RQ's maintenance calls).
"""

import logging
import signal
import sys
import threading
import zlib
from collections.abc import Callable
from typing import Any, Protocol

from redis import Redis
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job
from rq.utils import now
from rq.worker import WorkerStatus

from tinkerq.jobs import JOB_NAMES, JobSerializer, QueuedJob
from tinkerq.keys import shard_of_queue
from worker.consumer import admission
from worker.consumer.admission import Refused, Verdict
from worker.consumer.claim import Claimer, shard_of_key
from worker.shards.fencing import FencedOut, FencedRedis
from worker.shards.outage import REDIS_DOWN, RedisGone

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 60

# Job hash fields through which RQ 3.0.0 would import code (the callbacks: `Job.success_callback` & co. call
# `import_attribute`, run by `BaseWorker._finalize_success/_finalize_failure` and `StartedJobRegistry.cleanup`),
# send HTTP requests (`webhooks`: `Job.send_webhooks`, urllib), enqueue or re-run jobs (dependencies, retries,
# repeats, rate-limit slots: `handle_job_success/failure`, `Repeat.schedule`, `release_slot`) or touch other
# keys (`group_id`). tinkerq never writes them (RQ writes '' for the callback names and group_id), so a hash
# that sets one was forged: it is refused, and the fields are never loaded.
HOOK_FIELDS = ("success_callback_name", "failure_callback_name", "stopped_callback_name", "webhooks",
               "dependency_ids", "dependency_id", "retries_left", "repeats_left", "rate_limit_key", "group_id")
# Their companions, meaningless without them (and parsed with int()/json.loads, so garbage there would make
# the whole hash unloadable): dropped too, not counted.
_COMPANION_FIELDS = ("success_callback_timeout", "failure_callback_timeout", "stopped_callback_timeout",
                     "allow_dependency_failures", "enqueue_at_front", "retry_intervals", "enqueue_at_front_on_retry",
                     "repeat_intervals", "rate_limit_concurrency")
_DROPPED = frozenset(HOOK_FIELDS + _COMPANION_FIELDS)


class ForbiddenJob(Exception):
    pass


class BadQueueEntry(Exception):
    """A queue entry that is not a request id (not UTF-8, or not an id a producer makes): nothing to answer."""

    def __init__(self, raw: bytes, queue_key: str) -> None:
        super().__init__(f"queue {queue_key} held {raw[:200]!r}, which is not a request id; dropped")
        self.raw, self.queue_key = raw, queue_key


def _field(name: bytes | str) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else name


class JobContext(Protocol):
    """What runs an admitted job (the dispatcher), handed to every job the worker takes."""

    def handle(self, job: Job) -> dict[str, Any]: ...

    def take_over(self, job: Job) -> bool:
        """Whether another lane of the worker took the claimed job over (it then leaves the claimed list, and RQ
        neither runs nor finishes it here)."""
        ...


class AllowlistJob(QueuedJob):
    """A job loaded as untrusted data: without RQ's hook fields (listed in `ignored_fields` when set), with its
    data bounded, and run only once the worker admitted it (`verdict`) and only if its function is allowed.
    Its function name is never imported: the job runs in the worker's `context`."""

    # Far above what a request within `Limits` serialises to (tens of MB), far below a worker's memory: a
    # zlib bomb in `data` is refused instead of inflated.
    max_data_bytes = 256 * 1024 * 1024
    verdict: Verdict | None = None
    context: JobContext | None = None
    ignored_fields: tuple[str, ...] = ()
    # Why the job stopped short without being answered: its lease was lost, or Redis went away. It then stays in
    # flight (or goes back to its queue) to run again, and RQ does not mark it FAILED.
    transient: Exception | None = None

    def restore(self, raw_data):  # noqa: ANN001, ANN201 - RQ's signature
        self.ignored_fields = tuple(name for name in HOOK_FIELDS
                                    if raw_data.get(name.encode(), raw_data.get(name)) not in (None, b"", ""))
        kept = {key: value for key, value in raw_data.items() if _field(key) not in _DROPPED}
        field = b"data" if b"data" in kept else "data"
        stored = kept.get(field)
        inflated = _check_size(stored, self.max_data_bytes)
        if inflated is not None:
            # RQ inflates the data again unless handed it inflated: a JSON array, which no zlib stream begins like
            # (RQ takes data that does not inflate as it is)
            kept[field] = inflated
        return super().restore(kept)

    def to_dict(self, include_meta: bool = True, include_result: bool = True) -> dict:
        """RQ's fields less `data`: a worker never changes a job's data, and each job it saves (RQ's finish, fail and
        requeue) it loaded from the hash, which keeps the data as it was stored (HSET leaves fields it is not given).
        Writing a large payload back through the fenced batch would cost every job a copy for nothing."""
        obj = super().to_dict(include_meta=include_meta, include_result=include_result)
        del obj["data"]
        return obj

    def perform(self):  # noqa: ANN201 - RQ's signature
        if self.verdict is None:
            raise ForbiddenJob("the job was not admitted by the worker")
        if isinstance(self.verdict, Refused) and self.verdict.forged:
            raise ForbiddenJob(self.verdict.error.error)
        if self.func_name not in JOB_NAMES:
            raise ForbiddenJob(f"function {self.func_name!r} is not an allowed tinkerq job function")
        return super().perform()

    def _execute(self) -> dict[str, Any]:
        # The worker has judged the job and parsed its payload (worker/consumer/admission.py); the context takes the
        # parsed request from the job's verdict.
        if self.context is None:
            raise ForbiddenJob("the job was not handed a context by the worker")
        return self.context.handle(self)


def _check_size(data: bytes | str | None, limit: int) -> bytes | None:
    """ValueError if `data` inflates to more than `limit` bytes. What it inflates to, where that is all of it, a
    JSON array, exactly what zlib.decompress (RQ's restore) would give; else None."""
    if not isinstance(data, bytes):
        return None  # missing: RQ says so itself
    inflater = zlib.decompressobj()
    try:
        inflated = inflater.decompress(data, limit + 1)
    except zlib.error:
        inflated = data  # RQ falls back to the raw bytes too
        inflater = None
    if len(inflated) > limit:
        raise ValueError(f"the job's data exceeds {limit} bytes")
    if inflater is None or not inflater.eof or inflater.unused_data or not inflated.startswith(b"["):
        return None
    return inflated


class LostJob(Exception):
    """A queued id whose RQ job hash is gone (deleted, or evicted by a Redis not set to noeviction)."""


# A job that raised one of these did not fail: it was interrupted, and runs again.
TRANSIENT: tuple[type[Exception], ...] = (FencedOut, RedisGone, *REDIS_DOWN)


class ClaimedList(IntermediateQueue):
    """A shard queue's intermediate list: the claimed jobs (worker/consumer/claim.py), emptied by the claim (which takes
    its head first) and by recovery, which read its entries as untrusted. RQ's own cleanup of it is off: it decodes and
    loads every entry (a non-UTF-8 one, or an id whose hash is of another type, ended the worker's loop) and marks a
    job it has seen there for a minute FAILED, with no ErrorResponse."""

    def cleanup(self, worker, queue) -> None:  # noqa: ANN001 - RQ's signature
        return None


class ShardQueue(Queue):
    job_class = AllowlistJob  # also the class RQ's registry cleanups load jobs with

    @property
    def intermediate_queue(self) -> IntermediateQueue:
        return ClaimedList(self.key, connection=self.connection)

    # The pop: RQ's `dequeue_any` decodes the popped id as UTF-8 (and would crash the worker on other bytes);
    # an entry that is no request id is refused here, before that.
    @classmethod
    def lpop(cls, queue_keys, timeout, connection=None):  # noqa: ANN001, ANN206 - RQ's signature
        return _checked(super().lpop(queue_keys, timeout, connection=connection))

    @classmethod
    def lmove(cls, connection, queue_key, timeout):  # noqa: ANN001, ANN206 - RQ's signature
        return _checked(super().lmove(connection, queue_key, timeout))

    # RQ's dequeue skips an id without a job hash in silence, and its client would wait for a result
    # forever. Raised with job_id and queue attached, it takes the path of an unloadable job instead.
    @classmethod
    def _fetch_dequeued_job(cls, connection: Redis, queue_key: str, job_id: str, **kwargs: Any) -> Job:
        fetched = super()._fetch_dequeued_job(connection, queue_key, job_id, **kwargs)
        if fetched is None:
            lost = LostJob(f"job {job_id} was queued but its data is gone from Redis (deleted or evicted)")
            lost.job_id = job_id  # type: ignore[attr-defined]
            lost.queue = cls.from_queue_key(queue_key, connection=connection, serializer=kwargs.get("serializer"))  # type: ignore[attr-defined]
            raise lost
        return fetched

    # Dependents (the `rq:job:<id>:dependents` set, which anyone can write) are never released: tinkerq orders
    # jobs by queue position alone. RQ calls these after a job succeeds or fails.
    def move_dependents_to_ready(self, job, pipeline=None, exclude_job_id=None, refresh_job_status=True):  # noqa: ANN001, ANN201 - RQ's signature
        return {}

    def enqueue_dependents(self, job, exclude_job_id=None, refresh_job_status=True):  # noqa: ANN001, ANN201 - RQ's signature
        return {}


def _checked(popped):  # noqa: ANN001, ANN202 - (queue key, raw id) or None, as RQ's pops return
    if popped is not None and admission.job_id(popped[1]) is None:
        queue_key = popped[0].decode() if isinstance(popped[0], bytes) else popped[0]
        raise BadQueueEntry(popped[1] if isinstance(popped[1], bytes) else popped[1].encode(), queue_key)
    return popped


class ShardWorker(SimpleWorker):
    """One incarnation of RQ's loop over the shard queues whose leases the worker process holds now; it returns
    when the leases change, on a stop, or on a Redis outage (`outage`). It owns the loop and the job in hand
    (`running`), not the leases (the claimer's fence) nor the models (the dispatcher, its `context`). Invariants: a
    job is taken only by the claim, under its shard's lease, and stays in the claimed list until it ended; every
    job is admitted before RQ acts on it; on a fenced connection RQ's writes for a job need its shard's lease; a job
    interrupted by an outage or a lost lease is never marked FAILED (recovery requeues it)."""

    job_class = AllowlistJob
    queue_class = ShardQueue

    def __init__(
        self,
        *args: Any,
        claimer: Claimer,
        tick_s: int = 1,
        on_tick: Callable[[], None] | None = None,
        on_unloadable: Callable[[str, object, Exception], None] | None = None,
        admit: Callable[[Job, str], Verdict] | None = None,
        context: JobContext | None = None,
        on_signal: Callable[[int], None] | None = None,
        **kwargs: Any,
    ) -> None:
        self.tick_s = tick_s  # read by RQ's __init__ (connection timeout)
        self.claimer = claimer
        self.on_tick = on_tick
        self.on_unloadable = on_unloadable
        self.admit = admit
        self.context = context
        self.on_signal = on_signal
        super().__init__(*args, job_class=AllowlistJob, serializer=JobSerializer, **kwargs)
        self.running: tuple | None = None
        self.stop_reason: str | None = None
        self.outage: Exception | None = None  # set when Redis went away and ended the loop
        self._heartbeat_lock = threading.Lock()

    def _install_signal_handlers(self) -> None:
        # Not RQ's: its second signal raises SystemExit (status 1), and its warm stop writes to Redis from the
        # signal handler, which blocks there when Redis is frozen.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_signal)
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.on_signal is not None:
            self.on_signal(signum)  # the worker process's stop: its watchdog bounds the rest
        self.stop(f"signal {signum}")
        if self.get_state() != WorkerStatus.BUSY:
            raise StopRequested()  # out of a blocking wait for a job; a busy worker returns after the job

    def work(self, burst: bool = False, logging_level: str | None = None,  # type: ignore[override]
             dequeue_strategy: str = "default", **_unused: object) -> bool:
        """RQ's loop (`BaseWorker.work` of rq 3.0.0), owned: RQ's own ends the worker on any error of a turn, a
        redis-py TimeoutError or ConnectionError from any of its Redis calls included. Here a Redis outage anywhere
        in a turn (RQ's bookkeeping or ours, the job in hand) ends the loop with `outage` set: the job in hand stays
        in flight, or goes back to its queue when the lease was lost, and WorkerProcess rides the outage out. Any
        other error ends the loop as RQ's would, logged."""
        self._dequeue_strategy = dequeue_strategy
        completed = 0
        try:
            self.bootstrap(logging_level)
            self._install_signal_handlers()
            while self._turn(burst):
                completed += 1
        except StopRequested:
            pass
        except (*REDIS_DOWN, RedisGone) as exc:
            log.warning("worker %s: Redis went away (%s); this incarnation stops", self.name, exc)
            self.outage = exc
        except Exception:  # as RQ's loop: logged, the loop ends, the worker process decides
            log.exception("worker %s: unhandled error in its loop; it stops", self.name)
        finally:
            self.teardown()
        return completed > 0

    def _turn(self, burst: bool) -> bool:
        """One job, as RQ's loop takes it (suspension, the pop, the job). False: stop. The heartbeat, the maintenance
        and the tick RQ's loop also runs here come with every claim (`_claim_next`): once per job, not twice."""
        self.check_for_suspension(burst)
        if self._stop_requested:
            return False
        result = self.dequeue_job_and_maintain_ttl(None if burst else self.dequeue_timeout)
        if result is None:
            return False
        self.execute_job(*result)
        return True

    def heartbeat(self, timeout: int | None = None, pipeline=None) -> None:  # noqa: ANN001 - RQ's signature
        """RQ's three writes (the worker hash's last_heartbeat, two expiries) in one round trip, not three."""
        if pipeline is not None:
            return super().heartbeat(timeout, pipeline)
        with self.connection.pipeline() as own:
            super().heartbeat(timeout, own)
            own.execute()
        return None

    def set_state(self, state: str, pipeline=None) -> None:  # noqa: ANN001 - RQ's signature
        """A round trip only when the state changes (RQ writes IDLE at the end of a job and again at the next pop)."""
        if pipeline is None and state == self._state:
            return
        super().set_state(state, pipeline)

    def handle_job_success(self, job: Job, queue, started_job_registry, execution) -> None:  # noqa: ANN001 - RQ's signature
        """RQ's, less what tinkerq's jobs never have (dependents: ShardQueue releases none; repeats and rate-limit
        slots: their fields are never loaded): without the WATCH of the job's dependents, one round trip."""
        with self.connection.pipeline() as pipeline:
            self.increment_successful_job_count(pipeline=pipeline)
            self.increment_total_working_time(job.ended_at - job.started_at, pipeline)
            result_ttl = job.get_result_ttl(self.default_result_ttl)
            if result_ttl != 0:
                job._handle_success(result_ttl, pipeline=pipeline, worker_name=self.name, execution_id=execution.id,
                                    execution_started_at=execution.created_at, execution_ended_at=job.ended_at)
            job.cleanup(result_ttl, pipeline=pipeline, remove_from_queue=False)
            self.cleanup_execution(job, pipeline=pipeline, execution=execution)
            pipeline.execute()
        self.log.info("Successfully completed job %s in %ss on worker %s", job.id, job.ended_at - job.started_at,
                      self.name)

    @property
    def dequeue_timeout(self) -> int:
        return self.tick_s

    @property
    def should_run_maintenance_tasks(self) -> bool:
        # RQ evaluates this once per loop turn, in the main thread, at least every tick_s.
        if self.on_tick is not None:
            try:
                self.on_tick()
            except Exception:  # a failed tick must not kill the loop
                log.exception("worker tick failed")
        return super().should_run_maintenance_tasks

    def run_maintenance_tasks(self) -> None:
        # RQ's cleanup of its registries loads whatever they list, and an entry anyone wrote (not UTF-8, not
        # `<id>:<execution>`, a job key of another type) raises: RQ's loop would end on it, at every start. It is RQ's
        # bookkeeping for the dashboard, not the claimed list (recovery reads that): a failed round is skipped.
        try:
            super().run_maintenance_tasks()
        except REDIS_DOWN:
            raise
        except Exception:  # whatever a registry holds
            log.exception("worker %s: RQ's registry maintenance failed; skipped until its next round", self.name)
            self.last_cleaned_at = now()

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return HEARTBEAT_TTL_S

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        # RQ drops the id from the intermediate list here when it serves one queue; it stays there until the job
        # ended (execute_job), whatever the number of queues: the claimed list does not depend on RQ's TTLs.
        super().prepare_job_execution(job, remove_from_intermediate_queue=False)

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            if self.context is not None and self.context.take_over(job):
                return
        except FencedOut:
            self.lost_shard(shard_of_queue(queue.name))
            return
        fenced = isinstance(self.connection, FencedRedis)
        if fenced:  # RQ's writes for this job, from here to its end, only under the shard's lease
            self.connection.shard = shard_of_queue(queue.name)
        try:
            execution = self.prepare_execution(job)
            self.running = (job, execution)
            try:
                self.perform_job(job, queue, execution)
            finally:
                with self._heartbeat_lock:
                    self.running = None
            if job.transient is None:
                self.claimer.done(queue.key, job.id)
        except FencedOut as exc:  # a fenced write outside the job (RQ's bookkeeping, the end of the claim)
            job.transient = exc
        finally:
            if fenced:
                self.connection.shard = None
        if isinstance(job.transient, FencedOut):
            self.lost_shard(shard_of_queue(queue.name))
        self.set_state(WorkerStatus.IDLE)
        if job.transient is not None and not isinstance(job.transient, FencedOut):
            raise job.transient  # Redis went away during the job: the loop's outage (RedisGone ends the worker)

    def lost_shard(self, shard: int) -> None:
        """A fenced write was refused: the shard is someone else's now. This worker stops treating it as its own
        and touches nothing of it (its claims, parked ops and jobs are the new owner's to recover)."""
        log.warning("worker %s: shard %d is no longer its own (a fenced write was refused); it stops", self.name,
                    shard)
        self.claimer.fence.forget([shard])
        self.stop("lost leases")

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        if isinstance(exc_info[1], TRANSIENT):
            job.transient = exc_info[1]  # no error result, and (handle_job_failure) no FAILED
            return
        super().handle_exception(job, *exc_info)

    def handle_execution_ended(self, job: Job, queue, heartbeat_ttl: int) -> None:  # noqa: ANN001 - RQ's signature
        # RQ writes the job's heartbeat here, unfenced, even for a job that failed because its lease was lost.
        job.ended_at = now()
        if not isinstance(sys.exc_info()[1], TRANSIENT):
            job.heartbeat(now(), heartbeat_ttl)

    def handle_job_failure(self, job: Job, queue, started_job_registry=None, exc_string="",  # noqa: ANN001 - RQ's signature
                           execution: Execution | None = None) -> None:
        if job.transient is None:
            return super().handle_job_failure(job, queue, started_job_registry, exc_string, execution)
        # Redis is away: the job stays in flight; recovery requeues it once Redis is back. Lease lost: the job, its
        # claim and its execution record are the new owner's (its recovery requeues them): nothing is written.
        return None

    def keep_running_job_alive(self) -> None:
        """Called from the side thread: refresh RQ's heartbeats for the job in progress, only while its shard is
        ours (the lease renewal just before says so; after a takeover the job's records are the new owner's)."""
        with self._heartbeat_lock:
            if self.running is not None:
                job, execution = self.running
                if self.claimer.fence.owns(shard_of_queue(job.origin)):
                    try:
                        self.maintain_heartbeats(job, execution)
                    except FencedOut:  # lost meanwhile: the main loop finds out at its next fenced write
                        log.warning("worker %s: the lease on %s was lost; its job's heartbeat stops", self.name,
                                    job.origin)

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):  # noqa: ANN001, ANN201 - RQ's signature
        """Claim the next job (worker/consumer/claim.py) instead of RQ's pop. A job that cannot be loaded is answered, a
        queue entry that names no request is dropped, and every job returned carries the worker's verdict."""
        self.set_state(WorkerStatus.IDLE)
        while True:
            result = self._claim_next(timeout)
            if result is not False:
                return result

    def _claim_next(self, timeout: int | None):  # noqa: ANN202 - (job, queue), None (stop or idle burst), False
        if self.last_heartbeat is None or (now() - self.last_heartbeat).total_seconds() >= self.tick_s:
            self.heartbeat()  # RQ's worker_ttl is minutes: once a tick is plenty, not once a job
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()
        if self._stop_requested:
            return None
        queue_keys = [queue.key for queue in self._ordered_queues]
        popped, lost = self.claimer.claim(queue_keys)
        if lost:
            log.error("worker %s: the leases on shards %s are no longer its own", self.name, lost)
            self.claimer.fence.forget(lost)
            self.stop("lost leases")
        if popped is None:
            if lost or timeout is None:
                return None
            self.claimer.wait(queue_keys, timeout)
            return False
        queue_key, raw = popped
        if admission.job_id(raw) is None:
            log.error("%s", BadQueueEntry(raw, queue_key))
            try:
                self.claimer.done(queue_key, raw)
            except FencedOut:
                self.lost_shard(shard_of_key(queue_key))
            return False
        job_id = raw.decode()
        try:
            job, queue = self.queue_class._fetch_dequeued_job(
                self.connection, queue_key, job_id, job_class=self.job_class, serializer=self.serializer,
                death_penalty_class=self.death_penalty_class)
        except (*REDIS_DOWN, StopRequested):
            # RQ tags every fetch error with the job id, these too: neither is the job's fault. A stop signal
            # raises StopRequested while the worker is not yet busy; the claimed job stays in flight for recovery.
            raise
        except Exception as exc:
            if getattr(exc, "job_id", None) is None:
                raise
            # The job hash exists but RQ cannot even load it: answer it and move on.
            log.error("job %s cannot be loaded (%s); answering it with an error", job_id, exc)
            if self.on_unloadable is not None:
                self.on_unloadable(job_id, exc.queue, exc)
            return False
        self.reorder_queues(reference_queue=queue)
        self.log.info("Worker %s: %s: %s", self.name, queue.name, job.id)
        job.context = self.context
        if self.admit is not None:
            job.verdict = self.admit(job, queue.name)
        return job, queue

    def subscribe(self) -> None:
        """RQ's, polling every second instead of every 60 s. redis-py 8's PubSubWorkerThread.stop() waits for the
        thread without a bound, and a thread that read the UNSUBSCRIBE reply before its flag was cleared waits a
        whole poll for a new subscription first: every end of the loop (a lease change, a rebalance, a stop) could
        stall for a minute."""
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=1, daemon=True,
                                                       exception_handler=self._pubsub_exception_handler)

    def teardown(self) -> None:
        try:
            super().teardown()
        except REDIS_DOWN as exc:  # its death is not recorded; the worker key expires on its own
            log.warning("worker %s: could not record its end (%s)", self.name, exc)
            if self.pubsub_thread is not None:
                self.pubsub_thread.stop()
                self.pubsub_thread.join(timeout=1)

    def stop(self, reason: str) -> None:
        """Ask the loop to return after the current job (used when leases change)."""
        self.stop_reason = reason
        self._stop_requested = True
