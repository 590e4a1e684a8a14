"""Put a dead owner's unfinished jobs back at the front of a shard queue, in enqueue order.

Runs when a worker takes a shard, and when it resumes after a Redis outage, before it consumes anything. Jobs
claimed but never finished sit in the queue's intermediate list (where the claim moved them), RQ's started
registry, or the shard's in-flight list (batched samples); those without a stored result go back to the head of
the queue (RQ's own cleanup would fail them or append them at the tail, out of order). Running it twice puts
nothing in twice: an id already queued is moved, not copied.
"""

import logging

from redis import Redis
from rq import Queue
from rq.executions import Execution, ExecutionRegistry
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from tinkerq import keys
from tinkerq.keys import shard_of_queue
from worker.fencing import Fence
from worker.inflight import InFlightList

log = logging.getLogger(__name__)


def recover(connection: Redis, queue: Queue, fence: Fence) -> list[str]:
    """Requeue unfinished in-flight jobs at the front; return their ids in the order requeued. Each move is fenced
    by the shard's lease (FencedOut once it is not ours): a recovery paused and resumed after a successor took the
    shard moves nothing of its."""
    intermediate = IntermediateQueue(queue.key, connection)
    registry = StartedJobRegistry(queue=queue)
    candidates = [i.decode() if isinstance(i, bytes) else i for i in connection.lrange(intermediate.key, 0, -1)]
    # Registry entries are read as they are, never through RQ's Execution objects: an execution hash expires
    # 60 s before the registries that list it (RQ's own margins), and loading one then raises ValueError.
    started: dict[str, list[str]] = {}
    for job_id, execution_id in registry.get_job_and_execution_ids(cleanup=False):
        started.setdefault(job_id, []).append(execution_id)
    candidates += list(started)
    inflight = InFlightList(shard_of_queue(queue.name), connection)
    candidates += inflight.job_ids()
    ordered = sorted(set(candidates), key=lambda rid: _created(connection, rid))
    requeued = []
    for rid in reversed(ordered):  # pushing at the front in reverse keeps the original order
        job = _fetch(connection, queue, rid)
        with fence.pipeline(shard_of_queue(queue.name)) as pipe:
            pipe.lrem(intermediate.key, 0, rid)
            inflight.remove(rid, pipe, count=0)
            for execution_id in started.get(rid, ()):
                pipe.zrem(registry.key, f"{rid}:{execution_id}")
                pipe.delete(Execution(execution_id, rid, connection).key)
            pipe.delete(ExecutionRegistry(rid, connection).key)  # every execution of an in-flight job is over
            if job is not None and not connection.exists(keys.result_key(rid)):
                job.set_status(JobStatus.QUEUED, pipeline=pipe)
                pipe.lrem(queue.key, 0, rid)  # put back already (a worker's own put-back after a lost lease)
                queue.push_job_id(rid, pipeline=pipe, at_front=True)
                requeued.append(rid)
            pipe.execute()
    if requeued:
        log.warning("shard queue %s: requeued %d unfinished job(s) at the front", queue.name, len(requeued))
    return list(reversed(requeued))


def _fetch(connection: Redis, queue: Queue, rid: str) -> Job | None:
    try:
        return Job.fetch(rid, connection=connection, serializer=queue.serializer)
    except Exception:  # noqa: BLE001 - gone or unloadable: nothing to requeue
        log.warning("in-flight job %s cannot be loaded; dropping it", rid)
        return None


def _created(connection: Redis, rid: str) -> float:
    created = connection.hget(keys.request_key(rid), "created")
    return float(created) if created else 0.0
