"""Shard leases with a fencing epoch, and the writes they guard.

A worker owns a shard while it holds `tq:shard:{k}:lease = "<worker>:<epoch>"`. Every authoritative
write (a result, an applied version, a sequence position) runs as one Lua script that first checks
the lease still holds our token, so a stalled former owner can never overwrite its successor's work.
Those writes ride out a Redis outage (each is idempotent: NX, max, or the same value again), so a job whose work
is done when Redis goes away stores its result once Redis is back instead of being run a second time.
"""


from typing import Any

from redis import Redis
from redis.client import Pipeline

from tinkerq import keys
from worker.shards.outage import retrying

# The one lease check every fenced script starts with (prepended by `Fence.script`): KEYS[1] is the shard's lease,
# ARGV[1] the writer's token. A writer whose lease lapsed or was taken over (a higher epoch) gets -1 and has
# written nothing, so no fenced script may return -1 for anything else. A script's own keys and arguments start
# at KEYS[2] and ARGV[2].
LEASE_CHECK = "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end\n"

# A held lease is left alone (no epoch spent on it): a standby polling for free shards writes nothing. One held under
# this worker's own name is its own from an acquire whose reply was lost (Redis went away just after it ran): it is
# adopted, not left to lapse (a worker's name is its own: no other process writes a token with it).
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local held = redis.pcall('GET', KEYS[1])  -- a key of another type (written by anyone) is held by no one we know
  if type(held) == 'string' and string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return held
  end
  return false
end
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

# The request record's status, where the record is a hash: the producer writes one, but anyone can write that key,
# and an HSET on another type would end the script after the result's SET (stored, never published) with an error.
# (_PUT_RESULTS makes the same check inline, per result.)
_MARK_RECORD = "if redis.call('TYPE', KEYS[3]).ok == 'hash' then redis.call('HSET', KEYS[3], 'status', ARGV[6]) end\n"

# Many results in one step (the samples an engine step finished): per result 1 if stored, 0 if one was stored already.
# KEYS: (lease), then per result its key and its request record. ARGV: (token), ttl, channel, then per result its
# json, request id and status.
_PUT_RESULTS = """
local stored = {}
for i = 2, #KEYS, 2 do
  local a = 4 + 3 * (i - 2) / 2
  if redis.call('SET', KEYS[i], ARGV[a], 'NX', 'EX', ARGV[2]) then
    if redis.call('TYPE', KEYS[i + 1]).ok == 'hash' then redis.call('HSET', KEYS[i + 1], 'status', ARGV[a + 2]) end
    redis.call('PUBLISH', ARGV[3], ARGV[a + 1])
    table.insert(stored, 1)
  else
    table.insert(stored, 0)
  end
end
return stored
"""

# A result (as _PUT_RESULTS) plus the model's journal entry for a state-changing op (worker/durability/journal.py), in
# one step: a result is published only once the op is recoverable. The model's last seq moves too (max), so an owner
# dying right after this write leaves the sequencer's position right. An optim_step counts towards the next durable
# checkpoint. Returns the journal's length counted from its first entry ever (trimmed ones too), 0 if a result was
# stored already. KEYS: (lease), result, request record, journal, last seq, journal base. ARGV: (token), result json,
# ttl, channel, request id, status, then the entry, then the seq_id ('' for none), then '1' for an optim_step.
_PUT_JOURNALED = """
if not redis.call('SET', KEYS[2], ARGV[2], 'NX', 'EX', ARGV[3]) then return 0 end
""" + _MARK_RECORD + """
local length = redis.call('RPUSH', KEYS[4], ARGV[7])
if ARGV[8] ~= '' then
  local current = tonumber(redis.call('GET', KEYS[5]))
  if current == nil or tonumber(ARGV[8]) > current then redis.call('SET', KEYS[5], ARGV[8]) end
end
if ARGV[9] == '1' then redis.call('HINCRBY', KEYS[6], 'steps', 1) end
redis.call('PUBLISH', ARGV[4], ARGV[5])
return length + tonumber(redis.call('HGET', KEYS[6], 'offset') or '0')
"""

# A durable checkpoint covers the journal's first `upto` entries: record it and drop those, keeping the ones journaled
# while it was written (worker/durability/checkpointer.py), and take the optim_steps it covers off the count towards the
# next. Refused (0) unless entry `upto` - 1 is still listed: an older checkpoint never replaces a newer one, and no
# entry the checkpoint lacks is dropped. Every command that can fail runs before the first write: Redis does not undo
# a script's writes when a later command fails, and a caller told the script failed deletes the file whose record it
# may have written (HINCRBY by "-0", for a checkpoint covering no optim_step, fails). KEYS: (lease), journal, journal
# base. ARGV: (token), upto, the checkpoint's record, the optim_steps it covers.
_TRIM_JOURNAL = """
local offset = tonumber(redis.call('HGET', KEYS[3], 'offset') or '0')
local upto = tonumber(ARGV[2])
if upto <= offset or upto > offset + redis.call('LLEN', KEYS[2]) then return 0 end
local steps = tonumber(redis.call('HGET', KEYS[3], 'steps') or '0') - tonumber(ARGV[4])
redis.call('LTRIM', KEYS[2], upto - offset, -1)
redis.call('HSET', KEYS[3], 'offset', upto, 'json', ARGV[3], 'steps', math.max(steps, 0))
return 1
"""

# KEYS: (lease), counter. ARGV: (token), value, mode ("max" keeps the larger value, "set" overwrites).
_SET_COUNTER = """
local current = tonumber(redis.call('GET', KEYS[2]))
local value = tonumber(ARGV[2])
if ARGV[3] == 'set' or current == nil or value > current then redis.call('SET', KEYS[2], value) end
return 1
"""


# KEYS: (lease), hash. ARGV: (token), field, value.
_HSET = """
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return 1
"""


# KEYS: (lease), hash. ARGV: (token), field.
_HDEL = """
redis.call('HDEL', KEYS[2], ARGV[2])
return 1
"""


# A batch of commands run as one fenced step (Fence.pipeline). ARGV after the token: per command, its length, then
# its words. pcall: like MULTI/EXEC, a failing command is an error in its slot, not the end of the batch.
_EXEC = """
local replies = {}
local i = 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  table.insert(replies, redis.pcall(unpack(ARGV, i + 1, i + n)))
  i = i + n + 1
end
return replies
"""


class FencedOut(RuntimeError):
    """This worker no longer owns the shard; its write was refused."""


class FencedScript:
    """A Lua script that runs only while the caller holds the shard's lease (LEASE_CHECK)."""

    def __init__(self, fence: "Fence", body: str) -> None:
        self.fence = fence
        self.script = fence.connection.register_script(LEASE_CHECK + body)

    def __call__(self, shard: int, script_keys: list[str], args: list, what: str, *, retry: bool = True) -> Any:
        """The script's reply; FencedOut if the lease on `shard` is not ours. `retry`: wait out a Redis outage and
        run it again (only for scripts that are idempotent)."""
        fence = self.fence

        def call() -> Any:  # the script's reply, as redis-py decodes it
            return self.script(keys=[keys.lease_key(shard), *script_keys], args=[fence.token(shard), *args])

        reply = retrying(fence.connection, fence.outage_s, call, what) if retry else call()
        if reply == -1:
            raise FencedOut(f"lost the lease on shard {shard}; {what} not written")
        return reply


class FencedPipeline(Pipeline):
    """A pipeline whose commands run as one Lua script (_EXEC) behind the shard's lease check: all of them or, for a
    writer that lost the lease, none (FencedOut). Also the way RQ's own bookkeeping of a job is fenced: whatever
    RQ queues in it runs only under the lease."""

    def __init__(self, fence: "Fence", shard: int) -> None:
        connection = fence.connection
        super().__init__(connection.connection_pool, connection.response_callbacks, True, None)
        self.fence, self.shard = fence, shard

    def _execute_transaction(self, connection, commands, raise_on_error):  # noqa: ANN001, ANN202 - redis-py's
        words: list = []
        for args, options in commands:
            options.pop("keys", None)
            words += [len(args), *args]
        connection.send_command("EVAL", LEASE_CHECK + _EXEC, 1, keys.lease_key(self.shard),
                                self.fence.token(self.shard), *words)
        response = self.parse_response(connection, "_")
        if response == -1:
            raise FencedOut(f"lost the lease on shard {self.shard}; a batch of {len(commands)} writes not made")
        if raise_on_error:
            self.raise_first_error(commands, response)
        data = []
        for reply, (args, options) in zip(response, commands):
            callback = self.response_callbacks.get(args[0])
            data.append(callback(reply, **options) if callback is not None and not isinstance(reply, Exception)
                        else reply)
        return data

    _execute_pipeline = _execute_transaction


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
        self._put_results = self.script(_PUT_RESULTS)
        self._put_journaled = self.script(_PUT_JOURNALED)
        self._trim_journal = self.script(_TRIM_JOURNAL)
        self._set_counter = self.script(_SET_COUNTER)
        self._hset = self.script(_HSET)
        self._hdel = self.script(_HDEL)

    def script(self, body: str) -> FencedScript:
        """A fenced script: `body` runs after LEASE_CHECK (its keys from KEYS[2], its arguments from ARGV[2])."""
        return FencedScript(self, body)

    def pipeline(self, shard: int) -> FencedPipeline:
        """Queue writes for the shard; `execute()` makes them all under its lease, or none (FencedOut)."""
        return FencedPipeline(self, shard)

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
            self.tokens.pop(shard, None)
        return lost

    def release(self, shards: list[int] | None = None) -> None:
        """Give up these leases (every one by default), so another worker can take them at once."""
        for shard in list(self.tokens) if shards is None else shards:
            token = self.tokens.pop(shard, None)
            if token is not None:
                self._release(keys=[keys.lease_key(shard)], args=[token])

    def forget(self, shards: list[int]) -> None:
        """Shards found lost elsewhere (a fenced write was refused): take them again only through `acquire`."""
        for shard in shards:
            self.tokens.pop(shard, None)

    def owns(self, shard: int) -> bool:
        return shard in self.tokens

    def token(self, shard: int) -> str:
        # An unknown shard gets a token no lease can hold, so the write is refused, not unfenced.
        return self.tokens.get(shard, "-")

    def put_result(self, shard: int, request_id: str, payload: str, ttl_s: int, status: str) -> bool:
        """Store a result first-writer-wins. False if one was already stored; FencedOut if not owner."""
        return self.put_results(shard, [(request_id, payload, status)], ttl_s)[0]

    def put_results(self, shard: int, results: list[tuple[str, str, str]], ttl_s: int) -> list[bool]:
        """Store many results (request id, json, status), each first-writer-wins, in one round trip; per result
        whether it was stored (False: one was stored already). FencedOut if not owner."""
        if not results:
            return []
        script_keys = [key for rid, _, _ in results for key in (keys.result_key(rid), keys.request_key(rid))]
        args = [ttl_s, keys.DONE_CHANNEL,
                *(word for rid, payload, status in results for word in (payload, rid, status))]
        what = f"the result of {results[0][0]}" if len(results) == 1 else f"{len(results)} results"
        return [stored == 1 for stored in self._put_results(shard, script_keys, args, what)]

    def put_result_journaled(self, shard: int, request_id: str, payload: str, ttl_s: int, status: str,
                             journal_key: str, entry: str, seq_key: str, seq_id: int | None, base_key: str,
                             optim_step: bool = False) -> int:
        """put_result that also appends `entry` to the model's journal (and moves its last seq up to `seq_id`).
        The journal's new length, trimmed entries included; 0 if a result was already stored (nothing appended);
        FencedOut if not owner."""
        outcome = self._put_journaled(
            shard, [keys.result_key(request_id), keys.request_key(request_id), journal_key, seq_key, base_key],
            [payload, ttl_s, keys.DONE_CHANNEL, request_id, status, entry, "" if seq_id is None else seq_id,
             "1" if optim_step else "0"],
            f"the result of {request_id}")
        return int(outcome)

    def trim_journal(self, shard: int, journal_key: str, base_key: str, upto: int, record: str, steps: int) -> bool:
        """Record a checkpoint that covers the journal's first `upto` entries (counted from its first ever) and
        drop them, keeping those journaled since (the checkpoint was written while training went on); `steps`, the
        optim_steps among them since the previous checkpoint, leave the count towards the next. False if a
        checkpoint at or past `upto` is recorded already, or the journal has fewer entries (nothing changes);
        FencedOut if not owner."""
        return self._trim_journal(shard, [journal_key, base_key], [upto, record, steps], journal_key) == 1

    def set_counter(self, shard: int, key: str, value: int, *, only_up: bool = True) -> None:
        self._set_counter(shard, [key], [value, "max" if only_up else "set"], key)

    def hset(self, shard: int, key: str, field: str, value: str) -> None:
        self._hset(shard, [key], [field, value], key)

    def hdel(self, shard: int, key: str, field: str) -> None:
        self._hdel(shard, [key], [field], key)


# The commands RQ's bookkeeping of a job writes with (worker/consumer/rq_worker.py): fenced while a job is in hand.
_WRITES = frozenset({"SET", "DEL", "UNLINK", "EXPIRE", "PEXPIRE", "PERSIST", "HSET", "HMSET", "HDEL", "HINCRBY",
                     "HINCRBYFLOAT", "LPUSH", "RPUSH", "LREM", "SADD", "SREM", "ZADD", "ZREM", "XADD", "XTRIM",
                     "INCR", "INCRBY"})


class FencedRedis(Redis):
    """The RQ worker's client: while `shard` is set (a job of that shard is in hand), every write it or the job
    makes, in a pipeline or not, runs behind the shard's lease (FencedPipeline), so RQ's own records of a job (its
    hash, execution, registries) are never written by a worker that lost the shard. Reads and the worker's writes
    between jobs go straight through."""

    def __init__(self, fence: Fence) -> None:
        super().__init__(connection_pool=fence.connection.connection_pool)
        self.fence = fence
        self.shard: int | None = None

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        shard = self.shard
        return FencedPipeline(self.fence, shard) if shard is not None else super().pipeline(transaction, shard_hint)

    def execute_command(self, *args, **options):  # noqa: ANN002, ANN003, ANN201 - redis-py's
        shard = self.shard
        name = args[0].upper() if isinstance(args[0], str) else args[0]
        if shard is None or name not in _WRITES:
            return super().execute_command(*args, **options)
        with FencedPipeline(self.fence, shard) as pipe:
            pipe.execute_command(*args, **options)
            return pipe.execute()[0]
