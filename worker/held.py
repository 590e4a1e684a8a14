"""Training ops held for their turn (worker/sequencing.py): per model, the held request ids by seq_id and their
payloads; per shard, each held op's deadline. An op leaves through `take`, which only one caller wins."""

import json
import time

from redis import Redis

from schemas import Request, parse_request
from tinkerq import keys


class HeldOps:
    def __init__(self, connection: Redis) -> None:
        self.connection = connection

    def hold(self, shard: int, rid: str, request: Request, deadline: float) -> None:
        with self.connection.pipeline() as pipe:
            pipe.hset(keys.held_payload_key(request.model_id), rid, request.model_dump_json())
            pipe.zadd(keys.held_key(request.model_id), {rid: request.seq_id})
            pipe.zadd(keys.held_deadlines_key(shard), {_member(rid, request.model_id): deadline})
            pipe.execute()

    def take(self, shard: int, rid: str, model_id: str) -> Request | None:
        """Take a held op out of the parked set; None if someone else already did."""
        if not self.connection.zrem(keys.held_key(model_id), rid):
            return None
        with self.connection.pipeline() as pipe:
            pipe.hget(keys.held_payload_key(model_id), rid)
            pipe.hdel(keys.held_payload_key(model_id), rid)
            pipe.zrem(keys.held_deadlines_key(shard), _member(rid, model_id))
            payload = pipe.execute()[0]
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
        self.connection.zrem(keys.held_deadlines_key(shard), _member(rid, model_id))


def _member(rid: str, model_id: str) -> str:
    return f"{rid}|{model_id}"


def _split(member: bytes) -> tuple[str, str]:
    rid, model_id = member.decode().split("|", 1)
    return rid, model_id
