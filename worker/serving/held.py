"""Training ops held for their turn (worker/serving/sequencing.py): per model, the held request ids by seq_id and their
payloads; per shard, each held op's deadline. An op leaves through `take`, which only one caller wins. Every write
is fenced (worker/shards/fencing.py): a former owner woken from a pause can neither park an op nor take one out.

What is read back is untrusted, as a popped job is (worker/consumer/admission.py): anyone who can write to Redis can
park an op. A member that names no request (not UTF-8, not a request id, a deadline of a model routed to another shard)
is dropped; a taken op is judged as admission judges a job's payload, and must be the op it was parked as (its model and
seq_id), else it is refused, to be answered with that ErrorResponse."""

import json
import logging

from redis import Redis

from schemas import ErrorResponse, Request, seq_id_of
from tinkerq import keys
from worker.consumer.admission import Admission, Admitted, Refused, Verdict, job_id
from worker.shards.fencing import Fence

log = logging.getLogger(__name__)

# KEYS: (lease), payloads, held set, deadlines. ARGV: (token), id, payload, seq_id, deadline member, deadline.
_HOLD = """
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[6], ARGV[5])
return 1
"""

# KEYS: (lease), held set, payloads, deadlines. ARGV: (token), id, deadline member. {payload ('' if it is gone),
# seq_id it was held under}, or false if another caller took it first.
_TAKE = """
local seq_id = redis.call('ZSCORE', KEYS[2], ARGV[2])
if not seq_id then return false end
redis.call('ZREM', KEYS[2], ARGV[2])
local payload = redis.call('HGET', KEYS[3], ARGV[2]) or ''
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[3])
return {payload, seq_id}
"""

# KEYS: (lease), deadlines. ARGV: (token), deadline member.
_FORGET_DEADLINE = """
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""

# KEYS: (lease), held set, payloads. ARGV: (token), member. A member that names no request.
_DROP = """
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
return 1
"""


class HeldOps:
    def __init__(self, connection: Redis, fence: Fence, admission: Admission) -> None:
        self.connection = connection
        self.admission = admission
        self._hold = fence.script(_HOLD)
        self._take = fence.script(_TAKE)
        self._forget_deadline = fence.script(_FORGET_DEADLINE)
        self._drop = fence.script(_DROP)

    def hold(self, shard: int, rid: str, request: Request, deadline: float) -> None:
        model_id = request.model_id
        self._hold(shard, [keys.held_payload_key(model_id), keys.held_key(model_id), keys.held_deadlines_key(shard)],
                   [rid, request.model_dump_json(), request.seq_id, _member(rid, model_id), deadline],
                   f"held op {rid}")

    def take(self, shard: int, rid: str, model_id: str) -> Verdict | None:
        """Take a held op out of the parked set, judged: Admitted (run it) or Refused (answer it with its error); None
        if someone else already took it. Not retried across an outage: a take whose reply was lost would look like
        someone else's."""
        taken = self._take(shard, [keys.held_key(model_id), keys.held_payload_key(model_id),
                                   keys.held_deadlines_key(shard)], [rid, _member(rid, model_id)],
                           f"the take of held op {rid}", retry=False)
        if not taken:
            return None
        payload, seq_id = taken
        return self._judge(shard, rid, model_id, payload, float(seq_id))

    def _judge(self, shard: int, rid: str, model_id: str, payload: bytes, seq_id: float) -> Verdict:
        try:
            data = json.loads(payload)
        except Exception as exc:  # noqa: BLE001 - whatever the bytes are
            return _refused(rid, shard, f"the parked op's payload is not JSON: {type(exc).__name__}: {exc}")
        verdict = self.admission.judge_payload(rid, shard, data)
        if isinstance(verdict, Admitted):
            request = verdict.request
            if request.model_id != model_id or seq_id_of(request) != seq_id:
                return _refused(rid, shard, f"the parked op is seq_id {seq_id_of(request)} of model "
                                f"{request.model_id!r}, but it was parked as seq_id {seq_id:g} of model {model_id!r}")
        return verdict

    def first(self, shard: int, model_id: str) -> tuple[str, float] | None:
        """The model's held op of the lowest seq_id: (request id, the seq_id it is held under, which its `take`
        checks). A member that names no request is dropped on the way."""
        while True:
            head = self.connection.zrange(keys.held_key(model_id), 0, 0, withscores=True)
            if not head:
                return None
            raw, seq_id = head[0]
            rid = job_id(raw)
            if rid is not None:
                return rid, seq_id
            log.error("%s held %r, which is not a request id; dropped", keys.held_key(model_id), raw[:200])
            self._drop(shard, [keys.held_key(model_id), keys.held_payload_key(model_id)], [raw],
                       f"a held entry of {model_id!r}")

    def deadlines(self, shards: list[int]) -> dict[int, list[tuple[bytes, float]]]:
        """Per shard, the deadlines of the ops held on it as Redis lists them (untrusted: read them with `named`), by
        deadline: one read for all the shards, made once per turn of the worker's loop (nearly always of empty sets)."""
        with self.connection.pipeline(transaction=False) as pipe:
            for shard in shards:
                pipe.zrange(keys.held_deadlines_key(shard), 0, -1, withscores=True)
            return dict(zip(shards, pipe.execute()))

    def named(self, shard: int, members: list[tuple[bytes, float]]) -> list[tuple[str, str, float]]:
        """(request id, model id, deadline) of each deadline member that names a request of a model on this shard; the
        others are dropped (a fenced write: FencedOut if the shard is not ours)."""
        named = []
        for member, deadline in members:
            split = _split(member)
            if split is not None and keys.shard_of(split[1], self.admission.config.num_shards) == shard:
                named.append((*split, deadline))
                continue
            log.error("%s held %r, which names no held op of this shard; dropped", keys.held_deadlines_key(shard),
                      member[:200])
            self._forget_deadline(shard, [keys.held_deadlines_key(shard)], [member], "a held op's deadline")
        return named

    def forget_deadline(self, shard: int, rid: str, model_id: str) -> None:
        self._forget_deadline(shard, [keys.held_deadlines_key(shard)], [_member(rid, model_id)],
                              f"the deadline of held op {rid}")


def _member(rid: str, model_id: str) -> str:
    return f"{rid}|{model_id}"


def _split(member: bytes) -> tuple[str, str] | None:
    """(request id, model id) of a deadline member, or None if it names none."""
    raw_rid, sep, raw_model = member.partition(b"|")
    rid = job_id(raw_rid)
    try:
        model_id = raw_model.decode()
    except UnicodeDecodeError:
        return None
    return (rid, model_id) if rid is not None and sep and model_id else None


def _refused(rid: str, shard: int, error: str) -> Refused:
    return Refused(rid, shard, ErrorResponse(error=error, status=400, code="invalid_request"), forged=False)
