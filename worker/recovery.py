"""Put a dead owner's unfinished jobs back at the front of a shard queue, in enqueue order.

Runs when a worker takes a shard, before it consumes anything. Jobs popped but never finished sit
in RQ's intermediate list or its started registry; those without a stored result go back to the
head of the queue (RQ's own cleanup would fail them or append them at the tail, out of order).
"""

import logging

from redis import Redis
from rq import Queue
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from tinkerq import keys
from tinkerq.keys import shard_of_queue
from worker.inflight import InFlightList

log = logging.getLogger(__name__)


def recover(connection: Redis, queue: Queue) -> list[str]:
    """Requeue unfinished in-flight jobs at the front; return their ids in the order requeued."""
    intermediate = IntermediateQueue(queue.key, connection)
    registry = StartedJobRegistry(queue=queue)
    candidates = [i.decode() if isinstance(i, bytes) else i for i in connection.lrange(intermediate.key, 0, -1)]
    candidates += [job_id for job_id, _ in registry.get_job_and_execution_ids(cleanup=False)]
    inflight = InFlightList(shard_of_queue(queue.name), connection)
    candidates += inflight.job_ids()
    ordered = sorted(set(candidates), key=lambda rid: _created(connection, rid))
    requeued = []
    for rid in reversed(ordered):  # pushing at the front in reverse keeps the original order
        job = _fetch(connection, queue, rid)
        with connection.pipeline() as pipe:
            pipe.lrem(intermediate.key, 0, rid)
            inflight.remove(rid, pipe, count=0)
            if job is not None:
                registry.remove_executions(job, pipeline=pipe)
            if job is not None and not connection.exists(keys.result_key(rid)):
                job.set_status(JobStatus.QUEUED, pipeline=pipe)
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
