"""A shard's in-flight list: the sample jobs a worker took out of the queue to serve in one engine run.

RQ's intermediate list holds the one job RQ popped; this list holds the samples batched with it. A job moves
from the queue to here atomically, leaves when it is finished or put back, and recovery requeues what a dead
owner left here (worker/recovery.py)."""

from redis import Redis
from redis.client import Pipeline

from tinkerq import keys

# KEYS: queue, in-flight list. ARGV: job ids. Moves each id still queued; returns the ids moved.
_CLAIM = """
local claimed = {}
for _, id in ipairs(ARGV) do
  if redis.call('LREM', KEYS[1], 1, id) == 1 then
    redis.call('RPUSH', KEYS[2], id)
    table.insert(claimed, id)
  end
end
return claimed
"""


class InFlightList:
    def __init__(self, shard: int, connection: Redis) -> None:
        self.key = keys.inflight_key(shard)
        self.connection = connection
        self._claim = connection.register_script(_CLAIM)

    def claim(self, queue_key: str, job_ids: list[str]) -> list[str]:
        """Move the ids still in the queue here, in one step; returns those moved, in order."""
        if not job_ids:
            return []
        return [rid.decode() for rid in self._claim(keys=[queue_key, self.key], args=job_ids)]

    def job_ids(self) -> list[str]:
        return [rid.decode() for rid in self.connection.lrange(self.key, 0, -1)]

    def remove(self, job_id: str, pipeline: Pipeline, count: int = 1) -> None:
        """Drop `count` entries of the id (0: all of them)."""
        pipeline.lrem(self.key, count, job_id)

    def put_back(self, queue_key: str, job_ids: list[str], pipeline: Pipeline) -> None:
        """Move the ids back to the head of the queue, keeping their order."""
        for job_id in reversed(job_ids):
            pipeline.lrem(self.key, 1, job_id)
            pipeline.lpush(queue_key, job_id)
