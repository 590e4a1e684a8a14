"""Shard leases with a fencing epoch, and the writes they guard.

A worker owns a shard while it holds `tq:shard:{k}:lease = "<worker>:<epoch>"`. Every authoritative
write (a result, an applied version, a sequence position) runs as one Lua script that first checks
the lease still holds our token, so a stalled former owner can never overwrite its successor's work.
Those writes ride out a Redis outage (each is idempotent: NX, max, or the same value again), so a job whose work
is done when Redis goes away stores its result once Redis is back instead of being run a second time.
"""

from redis import Redis

from tinkerq import keys
from worker.outage import retrying

_ACQUIRE = """
local epoch = redis.call('INCR', KEYS[2])
local token = ARGV[1] .. ':' .. epoch
if redis.call('SET', KEYS[1], token, 'NX', 'PX', ARGV[2]) then return token end
return false
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: lease, result, request record. ARGV: token, result json, ttl, channel, request id, status.
_PUT_RESULT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if not redis.call('SET', KEYS[2], ARGV[2], 'NX', 'EX', ARGV[3]) then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('HSET', KEYS[3], 'status', ARGV[6]) end
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
"""

# put_result plus the model's journal entry for a state-changing op (worker/journal.py), in one step: a result is
# published only once the op is recoverable. The model's last seq moves too (max), so an owner dying right after
# this write leaves the sequencer's position right. An optim_step counts towards the next durable checkpoint.
# Returns the journal's length counted from its first entry ever (trimmed ones too), 0 or -1 as _PUT_RESULT.
# KEYS: lease, result, request record, journal, last seq, journal base. ARGV: as _PUT_RESULT, then the entry, then
# the seq_id ('' for none), then '1' for an optim_step.
_PUT_JOURNALED = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if not redis.call('SET', KEYS[2], ARGV[2], 'NX', 'EX', ARGV[3]) then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('HSET', KEYS[3], 'status', ARGV[6]) end
local length = redis.call('RPUSH', KEYS[4], ARGV[7])
if ARGV[8] ~= '' then
  local current = tonumber(redis.call('GET', KEYS[5]))
  if current == nil or tonumber(ARGV[8]) > current then redis.call('SET', KEYS[5], ARGV[8]) end
end
if ARGV[9] == '1' then redis.call('HINCRBY', KEYS[6], 'steps', 1) end
redis.call('PUBLISH', ARGV[4], ARGV[5])
return length + tonumber(redis.call('HGET', KEYS[6], 'offset') or '0')
"""

# A durable checkpoint covers the whole journal as it stands: record it and drop every entry (worker/checkpointer.py).
# Refused (0) unless the journal is still exactly `upto` entries long, so no entry the checkpoint lacks is dropped.
# KEYS: lease, journal, journal base. ARGV: token, upto, the checkpoint's record.
_TRIM_JOURNAL = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local offset = tonumber(redis.call('HGET', KEYS[3], 'offset') or '0')
if offset + redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[3], 'offset', ARGV[2], 'json', ARGV[3], 'steps', 0)
return 1
"""

# KEYS: lease, counter. ARGV: token, value, mode ("max" keeps the larger value, "set" overwrites).
_SET_COUNTER = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local current = tonumber(redis.call('GET', KEYS[2]))
local value = tonumber(ARGV[2])
if ARGV[3] == 'set' or current == nil or value > current then redis.call('SET', KEYS[2], value) end
return 1
"""


# KEYS: lease, hash. ARGV: token, field, value.
_HSET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return 1
"""


# KEYS: lease, hash. ARGV: token, field.
_HDEL = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('HDEL', KEYS[2], ARGV[2])
return 1
"""


class FencedOut(RuntimeError):
    """This worker no longer owns the shard; its write was refused."""


class Fence:
    """The leases one worker holds, and the fenced writes made under them."""

    def __init__(self, connection: Redis, owner: str, ttl_ms: int, outage_s: float = 300.0) -> None:
        self.connection = connection
        self.owner = owner
        self.ttl_ms = ttl_ms
        self.outage_s = outage_s
        self.tokens: dict[int, str] = {}
        self._acquire = connection.register_script(_ACQUIRE)
        self._renew = connection.register_script(_RENEW)
        self._release = connection.register_script(_RELEASE)
        self._put_result = connection.register_script(_PUT_RESULT)
        self._put_journaled = connection.register_script(_PUT_JOURNALED)
        self._trim_journal = connection.register_script(_TRIM_JOURNAL)
        self._set_counter = connection.register_script(_SET_COUNTER)
        self._hset = connection.register_script(_HSET)
        self._hdel = connection.register_script(_HDEL)

    def acquire(self, shards: list[int]) -> list[int]:
        """Try to take each free shard; return the ones newly taken."""
        taken = []
        for shard in shards:
            if shard in self.tokens:
                continue
            token = self._acquire(keys=[keys.lease_key(shard), keys.epoch_key(shard)], args=[self.owner, self.ttl_ms])
            if token:
                self.tokens[shard] = token.decode() if isinstance(token, bytes) else token
                taken.append(shard)
        return taken

    def renew(self) -> list[int]:
        """Extend every lease; return (and forget) the shards that were lost."""
        lost = [
            shard
            for shard, token in list(self.tokens.items())
            if not self._renew(keys=[keys.lease_key(shard)], args=[token, self.ttl_ms])
        ]
        for shard in lost:
            del self.tokens[shard]
        return lost

    def release(self) -> None:
        for shard, token in list(self.tokens.items()):
            self._release(keys=[keys.lease_key(shard)], args=[token])
        self.tokens.clear()

    def forget(self, shards: list[int]) -> None:
        """Shards found lost elsewhere (the claim saw another token): take them again only through `acquire`."""
        for shard in shards:
            self.tokens.pop(shard, None)

    def _write(self, script, script_keys: list[str], args: list, what: str):  # noqa: ANN001, ANN202
        return retrying(self.connection, self.outage_s, lambda: script(keys=script_keys, args=args), what)

    def owns(self, shard: int) -> bool:
        return shard in self.tokens

    def _token(self, shard: int) -> str:
        # An unknown shard gets a token no lease can hold, so the write is refused, not unfenced.
        return self.tokens.get(shard, "-")

    def put_result(self, shard: int, request_id: str, payload: str, ttl_s: int, status: str) -> bool:
        """Store a result first-writer-wins. False if one was already stored; FencedOut if not owner."""
        outcome = self._write(
            self._put_result,
            [keys.lease_key(shard), keys.result_key(request_id), keys.request_key(request_id)],
            [self._token(shard), payload, ttl_s, keys.DONE_CHANNEL, request_id, status],
            f"the result of {request_id}",
        )
        if outcome == -1:
            raise FencedOut(f"lost the lease on shard {shard}; result of {request_id} not written")
        return outcome == 1

    def put_result_journaled(self, shard: int, request_id: str, payload: str, ttl_s: int, status: str,
                             journal_key: str, entry: str, seq_key: str, seq_id: int | None, base_key: str,
                             optim_step: bool = False) -> int:
        """put_result that also appends `entry` to the model's journal (and moves its last seq up to `seq_id`).
        The journal's new length, trimmed entries included; 0 if a result was already stored (nothing appended);
        FencedOut if not owner."""
        outcome = self._write(
            self._put_journaled,
            [keys.lease_key(shard), keys.result_key(request_id), keys.request_key(request_id), journal_key, seq_key,
             base_key],
            [self._token(shard), payload, ttl_s, keys.DONE_CHANNEL, request_id, status, entry,
             "" if seq_id is None else seq_id, "1" if optim_step else "0"],
            f"the result of {request_id}",
        )
        if outcome == -1:
            raise FencedOut(f"lost the lease on shard {shard}; result of {request_id} not written")
        return int(outcome)

    def trim_journal(self, shard: int, journal_key: str, base_key: str, upto: int, record: str) -> bool:
        """Record a checkpoint that covers the journal's `upto` entries and drop them. False if the journal grew
        meanwhile (nothing changes); FencedOut if not owner."""
        outcome = self._write(self._trim_journal, [keys.lease_key(shard), journal_key, base_key],
                              [self._token(shard), upto, record], journal_key)
        if outcome == -1:
            raise FencedOut(f"lost the lease on shard {shard}; {journal_key} not trimmed")
        return outcome == 1

    def set_counter(self, shard: int, key: str, value: int, *, only_up: bool = True) -> None:
        outcome = self._write(self._set_counter, [keys.lease_key(shard), key],
                              [self._token(shard), value, "max" if only_up else "set"], key)
        if outcome == -1:
            raise FencedOut(f"lost the lease on shard {shard}; {key} not written")

    def hset(self, shard: int, key: str, field: str, value: str) -> None:
        if self._write(self._hset, [keys.lease_key(shard), key], [self._token(shard), field, value], key) == -1:
            raise FencedOut(f"lost the lease on shard {shard}; {key} not written")

    def hdel(self, shard: int, key: str, field: str) -> None:
        if self._write(self._hdel, [keys.lease_key(shard), key], [self._token(shard), field], key) == -1:
            raise FencedOut(f"lost the lease on shard {shard}; {key} not written")
