"""A shard's batched list: the sample jobs a worker took out of the queue to serve in one engine run.

RQ's intermediate list holds the one job RQ popped; this list holds the samples batched with it. A job moves
from the queue to here atomically, leaves when it is finished or put back, and recovery requeues what a dead
owner left here (worker/consumer/recovery.py)."""

from redis import Redis
from redis.client import Pipeline

from tinkerq import keys
from worker.shards.fencing import Fence

# KEYS: (lease), queue, batched list. ARGV: (token), job ids. Moves each id still queued; returns the ids moved.
_TAKE = """
local moved = {}
for i = 2, #ARGV do
  if redis.call('LREM', KEYS[2], 1, ARGV[i]) == 1 then
    redis.call('RPUSH', KEYS[3], ARGV[i])
    table.insert(moved, ARGV[i])
  end
end
return moved
"""


class BatchedList:
    def __init__(self, shard: int, connection: Redis, fence: Fence | None = None) -> None:
        self.shard = shard
        self.key = keys.batched_key(shard)
        self.connection = connection
        self._take = fence.script(_TAKE) if fence is not None else None

    def take_from(self, queue_key: str, job_ids: list[str]) -> list[str]:
        """Move the ids still in the queue here, in one step under the shard's lease; returns those moved, in
        order (FencedOut if the lease is not ours)."""
        if not job_ids:
            return []
        if self._take is None:
            raise RuntimeError("a batched list built without a fence only reads and removes")
        return [rid.decode() for rid in self._take(self.shard, [queue_key, self.key], job_ids,
                                                   f"taking {len(job_ids)} samples", retry=False)]

    def entries(self) -> list[bytes]:
        """The list as it is in Redis, untrusted: anyone who can write to Redis may have pushed anything here."""
        return self.connection.lrange(self.key, 0, -1)

    def remove(self, job_id: str | bytes, pipeline: Pipeline, count: int = 1) -> None:
        """Drop `count` entries of the id (0: all of them)."""
        pipeline.lrem(self.key, count, job_id)

    def put_back(self, queue_key: str, job_ids: list[str], pipeline: Pipeline) -> None:
        """Move the ids back to the head of the queue, keeping their order."""
        for job_id in reversed(job_ids):
            pipeline.lrem(self.key, 1, job_id)
            pipeline.lpush(queue_key, job_id)
