"""Gather the samples that may share one engine call with the sample being run.

RQ pops one job at a time. Samples of a model between two of its barriers all see the same
weights, so the worker looks ahead in its shard queue and serves, together with the job at hand,
every queued sample whose model has no non-sample job (sync, training op) ahead of it. Results of
the gathered samples are stored at once; when RQ later pops their jobs, the dispatcher finds the
result and skips them. Nothing is removed from the queue, so a crash mid-batch loses nothing.
"""

import logging

from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from schemas import SampleRequest, parse_request
from tinkerq import keys

log = logging.getLogger(__name__)


def lookahead(connection: Redis, queue_key: str, limit: int) -> list[tuple[str, SampleRequest]]:
    """Up to `limit` queued samples that may be served now, in queue order."""
    if limit <= 0:
        return []
    ids = [i.decode() for i in connection.lrange(queue_key, 0, 2 * limit - 1)]
    with connection.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.hmget(keys.request_key(rid), "kind", "model")
            pipe.exists(keys.result_key(rid))
        replies = pipe.execute()
    blocked: set[str] = set()
    picked: list[str] = []
    for rid, (kind, model), done in zip(ids, replies[0::2], replies[1::2]):
        if kind is None:
            continue  # no record (malformed or foreign job): it gets its own error when popped
        kind, model = kind.decode(), model.decode()
        if kind != "sample":
            blocked.add(model)
        elif not done and model not in blocked:
            picked.append(rid)
            if len(picked) == limit:
                break
    return _load(connection, picked)


def _load(connection: Redis, ids: list[str]) -> list[tuple[str, SampleRequest]]:
    loaded = []
    for rid, job in zip(ids, Job.fetch_many(ids, connection=connection, serializer=JSONSerializer)):
        try:
            request = parse_request(job.args[0])
        except Exception:  # noqa: BLE001 - any malformed job is left for its own turn
            log.debug("lookahead skips %s: its payload does not parse; it will fail on its own", rid)
            continue
        if isinstance(request, SampleRequest):
            loaded.append((rid, request))
    return loaded
