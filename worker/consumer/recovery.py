"""Put a dead owner's unfinished jobs back at the front of a shard queue, in enqueue order.

Runs when a worker takes a shard, and when it resumes after a Redis outage, before it consumes anything. Jobs
claimed but never finished sit in the queue's intermediate list (where the claim moved them), RQ's started
registry, or the shard's batched list (samples taken with a job); those without a stored result go back to the head of
the queue (RQ's own cleanup would fail them or append them at the tail, out of order). Running it twice puts
nothing in twice: an id already queued is moved, not copied.

Those records are untrusted input, as the jobs are (worker/consumer/admission.py): anyone who can write to Redis can
write them, and a recovery that raised would stop this worker at takeover, and every later owner of the shard the same
way. So an entry that names no request is dropped; a request whose record cannot be read (not a hash, a `created`
that is no time) is refused with an ErrorResponse, as admission refuses a forged job (its place in the order is
unknown, so it is not run out of it); an id whose job hash is gone or unloadable goes back to the queue like any
other, where the claim answers it (`job_lost`, `invalid_job`); and the entries around them are recovered as usual.
"""

import logging
import math
from collections.abc import Callable

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import ResponseError
from rq import Queue
from rq.executions import Execution, ExecutionRegistry
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from schemas import ErrorResponse
from tinkerq import keys
from tinkerq.keys import shard_of_queue
from worker.consumer import admission
from worker.consumer.batched import BatchedList
from worker.shards.fencing import Fence
from worker.shards.outage import REDIS_DOWN

log = logging.getLogger(__name__)

# Stores a request's one result on a shard (the dispatcher's `store_result`: fenced, first writer wins).
Answer = Callable[[int, str, ErrorResponse], object]


def recover(connection: Redis, queue: Queue, fence: Fence, answer: Answer) -> list[str]:
    """Requeue unfinished in-flight jobs at the front; return their ids in the order requeued. Each move is fenced
    by the shard's lease (FencedOut once it is not ours): a recovery paused and resumed after a successor took the
    shard moves nothing of its. `answer` stores the error result of a request whose record cannot be read."""
    shard = shard_of_queue(queue.name)
    records = _Leftovers(connection, queue, fence)
    records.drop_bad_entries()
    created, unreadable = _created(connection, records.ids())
    for rid, why in unreadable.items():
        log.error("in-flight job %s: %s; refusing it", rid, why)
        answer(shard, rid, ErrorResponse(error=f"the request's record {why}; the request is refused", status=400,
                                         code="invalid_job"))
        records.release(rid, requeue=False)
    requeued = []
    for rid in reversed(sorted(created, key=created.__getitem__)):  # pushing at the front in reverse keeps order
        if records.release(rid, requeue=not connection.exists(keys.result_key(rid))):
            requeued.append(rid)
    if requeued:
        log.warning("shard queue %s: requeued %d unfinished job(s) at the front", queue.name, len(requeued))
    return list(reversed(requeued))


class _Leftovers:
    """A shard's records of in-flight jobs as recovery read them: the raw entries of the queue's intermediate list,
    its started registry and the shard's batched list, each judged as untrusted input."""

    def __init__(self, connection: Redis, queue: Queue, fence: Fence) -> None:
        self.connection, self.queue, self.fence = connection, queue, fence
        self.shard = shard_of_queue(queue.name)
        self.intermediate_key = IntermediateQueue.get_intermediate_queue_key(queue.key)
        self.registry = StartedJobRegistry(queue=queue)
        self.batched = BatchedList(self.shard, connection)
        self.lists = {self.intermediate_key: connection.lrange(self.intermediate_key, 0, -1),
                      self.batched.key: self.batched.entries()}
        # Registry entries are read as they are, never through RQ's Execution objects: an execution hash expires
        # 60 s before the registries that list it (RQ's own margins), and loading one then raises ValueError.
        self.started: dict[str, list[str]] = {}
        self.bad_started: list[bytes] = []
        for raw in connection.zrange(self.registry.key, 0, -1):
            entry = _started_entry(raw)
            if entry is None:
                self.bad_started.append(raw)
            else:
                self.started.setdefault(entry[0], []).append(entry[1])

    def ids(self) -> list[str]:
        """Every request id named in flight, once each."""
        named = [admission.job_id(raw) for entries in self.lists.values() for raw in entries]
        return list(dict.fromkeys([*filter(None, named), *self.started]))

    def drop_bad_entries(self) -> None:
        """Drop the entries that name no request (there is no one to answer), in one fenced step."""
        bad = {key: [raw for raw in entries if admission.job_id(raw) is None] for key, entries in self.lists.items()}
        if not self.bad_started and not any(bad.values()):
            return
        with self.fence.pipeline(self.shard) as pipe:
            for key, entries in bad.items():
                for raw in dict.fromkeys(entries):
                    log.error("%s held %r, which is not a request id; dropped", key, raw[:200])
                    pipe.lrem(key, 0, raw)
            for raw in self.bad_started:
                log.error("%s held %r, which is not <request id>:<execution id>; dropped", self.registry.key,
                          raw[:200])
                pipe.zrem(self.registry.key, raw)
            pipe.execute()

    def release(self, rid: str, requeue: bool) -> bool:
        """End every in-flight record of `rid` (every execution of an in-flight job is over) and, if `requeue`, put
        it back at the head of the queue, in one fenced step. True if it was requeued."""
        job = _fetch(self.connection, self.queue, rid) if requeue else None
        with self.fence.pipeline(self.shard) as pipe:
            pipe.lrem(self.intermediate_key, 0, rid)
            self.batched.remove(rid, pipe, count=0)
            for execution_id in self.started.get(rid, ()):
                pipe.zrem(self.registry.key, f"{rid}:{execution_id}")
                pipe.delete(Execution(execution_id, rid, self.connection).key)
            pipe.delete(ExecutionRegistry(rid, self.connection).key)
            if requeue:
                _requeue(self.queue, rid, job, pipe)
            pipe.execute()
        return requeue


def _requeue(queue: Queue, rid: str, job: Job | None, pipe: Pipeline) -> None:
    if job is not None:
        job.set_status(JobStatus.QUEUED, pipeline=pipe)
    pipe.lrem(queue.key, 0, rid)  # put back already (a worker's own put-back after a lost lease)
    queue.push_job_id(rid, pipeline=pipe, at_front=True)


def _started_entry(raw: bytes) -> tuple[str, str] | None:
    """(request id, execution id) of a started registry entry, or None if it names none."""
    rid, sep, execution_id = raw.partition(b":")
    job_id = admission.job_id(rid)
    if job_id is None or not sep or admission.job_id(execution_id) is None:
        return None
    return job_id, execution_id.decode()


def _fetch(connection: Redis, queue: Queue, rid: str) -> Job | None:
    """The job, to mark it queued again; None if its hash is gone or unloadable (the claim answers it)."""
    try:
        return Job.fetch(rid, connection=connection, serializer=queue.serializer)
    except REDIS_DOWN:
        raise  # an outage, not a job gone: recovery runs again once Redis is back
    except Exception:  # noqa: BLE001 - gone or unloadable: the claim answers it
        log.warning("in-flight job %s cannot be loaded; requeued for the claim to answer", rid)
        return None


def _created(connection: Redis, rids: list[str]) -> tuple[dict[str, float], dict[str, str]]:
    """When each request was submitted (its record's `created`; 0 for a record gone, expired), and why it cannot be
    read where it cannot: (created by id, why by id)."""
    with connection.pipeline(transaction=False) as pipe:
        for rid in rids:
            pipe.hget(keys.request_key(rid), "created")
        values = pipe.execute(raise_on_error=False)
    created, unreadable = {}, {}
    for rid, value in zip(rids, values):
        if isinstance(value, ResponseError):  # WRONGTYPE: not a hash
            unreadable[rid] = f"{keys.request_key(rid)} cannot be read ({value})"
            continue
        try:
            when = float(value) if value else 0.0
        except ValueError:
            when = math.nan
        if not math.isfinite(when):
            unreadable[rid] = f"{keys.request_key(rid)} says it was created at {value[:100]!r}, which is no time"
        else:
            created[rid] = when
    return created, unreadable
