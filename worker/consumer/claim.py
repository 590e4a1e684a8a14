"""The pop: a job leaves its shard queue only into that queue's intermediate list (the claimed list),
in one Lua step that also checks the shard's lease, so a job is always in some Redis structure (a crash of Redis
or of the worker at any point leaves it where recovery finds it) and none is taken under a lapsed lease.

RQ pops with BLPOP when a worker has several queues: the id is then in no structure until RQ registers the
execution, and a crash in between (of the worker, or of Redis with the pop already in its AOF) loses it. No Redis
command moves from several lists while blocking, so an idle worker blocks instead on the queues' doorbells (one
short list per shard that producers push to in the transaction that enqueues): losing a doorbell costs at most
one tick of latency, never a job. Jobs pushed by anything else (recovery, RQ's dashboard) are seen at the next
tick or claim.
"""

from redis import Redis
from rq import Queue
from rq.intermediate_queue import IntermediateQueue

from tinkerq import keys
from worker.shards.fencing import Fence

# KEYS: per queue, in the order to serve them: queue, intermediate list, lease. ARGV: our lease token per queue.
# Returns {i, id, lost...}: the job claimed from queue i (its intermediate list's head when it holds one: a claim
# whose reply was lost, or a job put back there; else the queue's head, moved there), then the positions of the
# queues before it whose lease is not ours. {0, '', lost...}: nothing to claim.
_CLAIM = """
local lost = {}
for i = 1, #ARGV do
  local queue, claimed, lease = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if redis.call('GET', lease) ~= ARGV[i] then
    table.insert(lost, i)
  else
    local id = redis.call('LINDEX', claimed, 0)
    if not id then id = redis.call('LMOVE', queue, claimed, 'LEFT', 'RIGHT') end
    if id then return {i, id, unpack(lost)} end
  end
end
return {0, '', unpack(lost)}
"""

# KEYS: (lease), intermediate list. ARGV: (token), id, count. The claim ends (LREM), under the lease: a former
# owner woken from a pause must not remove its successor's claim of the same id.
_DONE = """
return redis.call('LREM', KEYS[2], ARGV[3], ARGV[2])
"""


def shard_of_key(queue_key: str) -> int:
    return keys.shard_of_queue(queue_key.removeprefix(Queue.redis_queue_namespace_prefix))


def intermediate_key(queue_key: str) -> str:
    return IntermediateQueue.get_intermediate_queue_key(queue_key)


class Claimer:
    """Claims jobs for one worker, under the leases in its `fence`."""

    def __init__(self, connection: Redis, fence: Fence) -> None:
        self.connection = connection
        self.fence = fence
        self._claim = connection.register_script(_CLAIM)
        self._done = fence.script(_DONE)

    def claim(self, queue_keys: list[str]) -> tuple[tuple[str, bytes] | None, list[int]]:
        """The (queue key, raw id) claimed, or None; and the shards whose lease turned out not to be ours."""
        shards = [shard_of_key(key) for key in queue_keys]
        script_keys = [k for key, shard in zip(queue_keys, shards)
                       for k in (key, intermediate_key(key), keys.lease_key(shard))]
        tokens = [self.fence.tokens.get(shard, "-") for shard in shards]  # "-": no lease holds it
        position, raw, *lost = self._claim(keys=script_keys, args=tokens)
        lost_shards = [shards[i - 1] for i in lost]
        if not position:
            return None, lost_shards
        raw = raw if isinstance(raw, bytes) else raw.encode()
        return (queue_keys[position - 1], raw), lost_shards

    def wait(self, queue_keys: list[str], timeout: int) -> None:
        """Block until a producer rings one of these queues' doorbells, or `timeout` seconds."""
        self.connection.blpop([keys.bell_key(shard_of_key(key)) for key in queue_keys], timeout)

    def done(self, queue_key: str, job_id: str | bytes, count: int = 1) -> None:
        """The job ended (its result is stored, or RQ marked it failed), or the entry is dropped: no longer in
        flight (`count` 0: every entry of it). FencedOut if the shard is no longer ours: the claim is then the
        next owner's to recover. A job whose lease was lost is never put back by this worker."""
        self._done(shard_of_key(queue_key), [intermediate_key(queue_key)], [job_id, count], f"the end of {job_id!r}")
