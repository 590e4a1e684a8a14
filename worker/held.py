"""Training ops held for their turn (worker/sequencing.py): per model, the held request ids by seq_id and their
payloads; per shard, each held op's deadline. An op leaves through `take`, which only one caller wins. Every write
is fenced (worker/fencing.py): a former owner woken from a pause can neither park an op nor take one out."""

import json
import time

from redis import Redis

from schemas import Request, parse_request
from tinkerq import keys
from worker.fencing import Fence

# KEYS: (lease), payloads, held set, deadlines. ARGV: (token), id, payload, seq_id, deadline member, deadline.
_HOLD = """
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[6], ARGV[5])
return 1
"""

# KEYS: (lease), held set, payloads, deadlines. ARGV: (token), id, deadline member. The payload, or false if
# another caller took it first.
_TAKE = """
if redis.call('ZREM', KEYS[2], ARGV[2]) == 0 then return false end
local payload = redis.call('HGET', KEYS[3], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[3])
return payload
"""

# KEYS: (lease), deadlines. ARGV: (token), deadline member.
_FORGET_DEADLINE = """
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""


class HeldOps:
    def __init__(self, connection: Redis, fence: Fence) -> None:
        self.connection = connection
        self._hold = fence.script(_HOLD)
        self._take = fence.script(_TAKE)
        self._forget_deadline = fence.script(_FORGET_DEADLINE)

    def hold(self, shard: int, rid: str, request: Request, deadline: float) -> None:
        model_id = request.model_id
        self._hold(shard, [keys.held_payload_key(model_id), keys.held_key(model_id), keys.held_deadlines_key(shard)],
                   [rid, request.model_dump_json(), request.seq_id, _member(rid, model_id), deadline],
                   f"held op {rid}")

    def take(self, shard: int, rid: str, model_id: str) -> Request | None:
        """Take a held op out of the parked set; None if someone else already did. Not retried across an outage: a
        take whose reply was lost would look like someone else's."""
        payload = self._take(shard, [keys.held_key(model_id), keys.held_payload_key(model_id),
                                     keys.held_deadlines_key(shard)], [rid, _member(rid, model_id)],
                             f"the take of held op {rid}", retry=False)
        return parse_request(json.loads(payload)) if payload else None

    def first(self, model_id: str) -> tuple[str, int] | None:
        """The model's held op of the lowest seq_id: (request id, seq_id)."""
        head = self.connection.zrange(keys.held_key(model_id), 0, 0, withscores=True)
        return (head[0][0].decode(), int(head[0][1])) if head else None

    def seq_id(self, model_id: str, rid: str) -> float | None:
        return self.connection.zscore(keys.held_key(model_id), rid)

    def waiting(self, shard: int) -> list[tuple[str, str]]:
        """(request id, model id) of every op held on the shard, by deadline."""
        return [_split(member) for member in self.connection.zrange(keys.held_deadlines_key(shard), 0, -1)]

    def expired(self, shard: int) -> list[tuple[str, str]]:
        """(request id, model id) of the shard's held ops whose deadline has passed."""
        return [_split(member) for member in
                self.connection.zrangebyscore(keys.held_deadlines_key(shard), "-inf", time.time())]

    def forget_deadline(self, shard: int, rid: str, model_id: str) -> None:
        self._forget_deadline(shard, [keys.held_deadlines_key(shard)], [_member(rid, model_id)],
                              f"the deadline of held op {rid}")


def _member(rid: str, model_id: str) -> str:
    return f"{rid}|{model_id}"


def _split(member: bytes) -> tuple[str, str]:
    rid, model_id = member.decode().split("|", 1)
    return rid, model_id
