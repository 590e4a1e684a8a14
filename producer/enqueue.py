"""Enqueue requests onto their model's shard queue: validated, idempotent, versioned, bounded."""

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_json
from redis import Redis
from redis.client import Pipeline
from redis.exceptions import NoScriptError, WatchError
from rq import Queue

from producer.errors import Rejected
from producer.result_waiter import ResultWaiter, get_result
from schemas import (
    ID_PATTERN,
    ForwardRequest,
    LimitExceeded,
    Limits,
    Request,
    Result,
    SampleRequest,
    WeightSyncRequest,
    is_request_id,
    new_request_id,
    seq_id_of,
)
from schemas.arrays import LISTS
from tinkerq import keys, queues
from tinkerq.config import LimitsConfig, QueueConfig
from tinkerq.jobs import JOB_OF_KIND, EncodedPayload, JobSerializer, QueuedJob

# KEYS: request record, seq key (or the record again), queue, model version counter.
# ARGV: request id, request record key prefix.
# Returns the id first submitted under this request id / (model, seq_id), its digest and version
# (nil when new), the queue depth and the model's latest enqueued weights version.
_READ_STATE = """
local first = ARGV[1]
if KEYS[2] ~= KEYS[1] then first = redis.call('GET', KEYS[2]) or ARGV[1] end
local record = ARGV[2] .. first
local fields = redis.call('HMGET', record, 'digest', 'version')
return {first, fields[1], fields[2], redis.call('LLEN', KEYS[3]), redis.call('GET', KEYS[4])}
"""


@dataclass(frozen=True)
class Ticket:
    request_id: str
    shard: int
    # The version a weight sync was given, or the snapshot a sample will be served from.
    version: int | None = None
    # True when this submission repeated an earlier one and nothing new was enqueued.
    duplicate: bool = False


@dataclass(frozen=True)
class _Item:
    """A validated submission: its request id, body digest, shard, and the Redis keys it is decided on."""

    request: Request
    rid: str
    body: bytes  # the request's canonical JSON: its digest is taken of it, and the job's payload is it
    digest: str
    shard: int
    record: str  # its request record
    unique_key: str  # what makes it unique: (model, seq_id), else the record
    wver: str  # its model's latest enqueued weights version


@dataclass
class _Batch:
    """What one transaction has decided so far."""

    placed: dict[str, tuple[Ticket, str]] = field(default_factory=dict)  # unique key / request key -> first
    latest: dict[str, int] = field(default_factory=dict)  # model -> weights version after this batch
    added: dict[int, int] = field(default_factory=dict)  # shard -> jobs this batch adds
    fresh: list[tuple[Request, Ticket, _Item]] = field(default_factory=list)


_SCALARS = frozenset({int, float, str, bool, type(None)})
# The form of the digests this producer writes: the hash of the canonical JSON, arrays packed (schemas/arrays.py).
# Earlier producers wrote it of the arrays as number lists ("v2:"), and before that the bare hash of json.dumps(...,
# sort_keys=True) (legacy_digest); a resend is still compared with either, so it is answered as it was.
DIGEST_FORM = "v3:"
LISTS_DIGEST_FORM = "v2:"


def _sorted_keys(value: Any) -> Any:
    if type(value) is dict:
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if type(value) is list and not {*map(type, value)} <= _SCALARS:
        return [_sorted_keys(item) for item in value]
    return value


def canonical(request: BaseModel, lists: bool = False) -> bytes:
    """The request as compact JSON with every object's keys sorted (pydantic's encoder: NaN and Infinity as json
    writes them): equal requests give equal bytes. `lists`: its arrays as number lists, as producers before the
    packed form wrote it (without the packed_results they did not send)."""
    return to_json(_sorted_keys(_json_form(request, lists)), inf_nan_mode="constants")


def _json_form(request: BaseModel, lists: bool) -> dict:
    if not lists:
        return request.model_dump(mode="json")
    return request.model_dump(mode="json", context=LISTS, exclude={"packed_results"})


def digest_of(body: bytes) -> str:
    """The digest this producer writes of a canonical body: 128 bits of sha256, which current x86 and ARM CPUs
    compute in hardware, faster than blake2b (every submit digests its whole body)."""
    return DIGEST_FORM + hashlib.sha256(body).hexdigest()[:32]


def lists_digest(request: BaseModel) -> str:
    """The digest producers wrote before the packed arrays ("v2:")."""
    return LISTS_DIGEST_FORM + hashlib.blake2b(canonical(request, lists=True), digest_size=16).hexdigest()


def legacy_digest(request: BaseModel) -> str:
    """The digest producers wrote before the forms with a prefix."""
    canonical_text = json.dumps(_json_form(request, lists=True), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical_text.encode(), digest_size=16).hexdigest()


def same_body(item_digest: str, request: BaseModel, stored: str) -> bool:
    """Whether a digest stored for an earlier submission is this request's (in any form)."""
    if stored.startswith(DIGEST_FORM):
        return stored == item_digest
    if stored.startswith(LISTS_DIGEST_FORM):
        return stored == lists_digest(request)
    return stored == legacy_digest(request)


class Producer:
    def __init__(self, connection: Redis, config: QueueConfig | None = None, limits: Limits | None = None) -> None:
        self.connection = connection
        self.config = config or QueueConfig()
        self.limits = limits or LimitsConfig()
        keys.check_num_shards(connection, self.config.num_shards)
        self._waiter: ResultWaiter | None = None
        self._read_state = connection.register_script(_READ_STATE)
        self._queues = [
            Queue(keys.queue_name(k), connection=connection, serializer=JobSerializer, job_class=QueuedJob)
            for k in range(self.config.num_shards)
        ]

    def shard_of(self, model_id: str) -> int:
        return keys.shard_of(model_id, self.config.num_shards)

    def submit(self, request: Request, request_id: str | None = None) -> Ticket:
        """Enqueue one request. Raises Rejected (nothing enqueued) on a limit, a full queue or a conflict."""
        return self.submit_many([request], [request_id])[0]

    def submit_many(self, requests: list[Request], request_ids: list[str | None] | None = None) -> list[Ticket]:
        """Enqueue several requests in order, in one transaction: all of them, or (Rejected) none.

        A worker sees them all at once, so the samples among them reach the engine as one batch.
        """
        return self._submit(requests, request_ids, atomic=True)  # type: ignore[return-value]

    def submit_each(self, requests: list[Request],
                    request_ids: list[str | None] | None = None) -> list[Ticket | Rejected]:
        """Enqueue several requests in order, in one transaction, each accepted or refused on its own:
        what an API server does with the submissions of many concurrent clients."""
        return self._submit(requests, request_ids, atomic=False)

    def _submit(self, requests: list[Request], request_ids: list[str | None] | None,
                atomic: bool) -> list[Ticket | Rejected]:
        ids = request_ids or [None] * len(requests)
        items: list[_Item | Rejected] = []
        for request, rid in zip(requests, ids, strict=True):
            try:
                items.append(self._prepare(request, rid))
            except Rejected as exc:
                if atomic:
                    raise
                items.append(exc)
        with self.connection.pipeline() as pipe:
            while True:
                try:
                    return self._submit_batch(pipe, items, atomic)
                except WatchError:
                    continue  # a concurrent submit touched one of our keys: re-read and retry

    def _prepare(self, request: Request, request_id: str | None) -> _Item:
        try:
            self.limits.check(request)
        except LimitExceeded as exc:
            raise Rejected.of(400, "limit_exceeded", str(exc)) from exc
        if isinstance(request, ForwardRequest) and not request.packed_results:
            request = request.model_copy(update={"packed_results": True})  # parse_result reads the packed form
        rid = new_request_id(request.kind[:2]) if request_id is None else request_id
        if not is_request_id(rid):
            raise Rejected.of(400, "invalid_request_id", f"request id {rid!r} must match {ID_PATTERN}")
        body = canonical(request)  # encoded once: for the digest, and as the job's payload
        return _Item(request, rid, body, digest_of(body), self.shard_of(request.model_id), keys.request_key(rid),
                     self._unique_key(request, rid), keys.wver_key(request.model_id))

    @staticmethod
    def _unique_key(request: Request, rid: str) -> str:
        """What makes a submission unique: (model_id, seq_id) for sequenced ops, else the request id."""
        seq_id = seq_id_of(request)
        return keys.seq_key(request.model_id, seq_id) if seq_id is not None else keys.request_key(rid)

    def _read_states(self, items: list[_Item]) -> list[list]:
        """Everything each decision needs, for all items in one round trip (WATCH already covers it). The script
        goes by its sha alone (redis-py's pipeline asks SCRIPT EXISTS first: a round trip more per submit), and is
        loaded again where Redis lost it (a restart, SCRIPT FLUSH)."""
        try:
            return self._run_reads(items)
        except NoScriptError:
            self._read_state.sha = self.connection.script_load(self._read_state.script)
            return self._run_reads(items)

    def _run_reads(self, items: list[_Item]) -> list[list]:
        with self.connection.pipeline(transaction=False) as reads:
            for item in items:
                reads.evalsha(self._read_state.sha, 4, item.record, item.unique_key, self._queues[item.shard].key,
                              item.wver, item.rid, keys.request_key(""))
            return reads.execute()

    def _submit_batch(self, pipe: Pipeline, items: list[_Item | Rejected], atomic: bool) -> list[Ticket | Rejected]:
        live = [item for item in items if isinstance(item, _Item)]
        if not live:
            return list(items)  # all refused already
        pipe.watch(*{key for item in live for key in (item.record, item.unique_key, item.wver)})
        states = iter(self._read_states(live))
        batch = _Batch()
        outcomes: list[Ticket | Rejected] = []
        for item in items:
            if isinstance(item, Rejected):
                outcomes.append(item)
                continue
            try:
                outcomes.append(self._place(item, next(states), batch))
            except Rejected as exc:
                if atomic:
                    pipe.unwatch()
                    raise
                outcomes.append(exc)
        if not batch.fresh:
            pipe.unwatch()
            return outcomes
        pipe.multi()
        for request, ticket, item in batch.fresh:
            self._enqueue(pipe, request, ticket, item)
        for shard in batch.added:  # wake the shard's owner (worker/consumer/claim.py): one entry at most
            pipe.rpush(keys.bell_key(shard), 1)
            pipe.ltrim(keys.bell_key(shard), -1, -1)
        pipe.execute()
        return outcomes

    def _place(self, item: _Item, state: list, batch: _Batch) -> Ticket:
        """Decide one item against what Redis held and what this batch already placed."""
        request, rid = item.request, item.rid
        earlier = batch.placed.get(item.unique_key) or batch.placed.get(item.record)
        if earlier is not None:
            first, first_digest = earlier
            return self._duplicate(item, first.request_id, first_digest, first.version)
        first_rid, first_digest, first_version, depth, wver = state
        first_rid = first_rid.decode() if first_rid else rid
        if first_digest is not None or first_rid != rid:
            return self._duplicate(item, first_rid, first_digest and first_digest.decode(),
                                   int(first_version) if first_version else None)
        if depth + batch.added.get(item.shard, 0) >= self.limits.max_shard_queue_depth:
            raise Rejected.of(
                429, "queue_full",
                f"shard {item.shard} has {depth} queued jobs (limit {self.limits.max_shard_queue_depth}); retry later",
                retryable=True,
            )
        request, version = self._stamp_version(request, batch.latest.setdefault(request.model_id, int(wver or 0)))
        if isinstance(request, WeightSyncRequest):
            batch.latest[request.model_id] = version
        batch.added[item.shard] = batch.added.get(item.shard, 0) + 1
        ticket = Ticket(rid, item.shard, version)
        batch.placed[item.unique_key] = batch.placed[item.record] = (ticket, item.digest)
        batch.fresh.append((request, ticket, item))
        return ticket

    def _enqueue(self, pipe: Pipeline, request: Request, ticket: Ticket, item: _Item) -> None:
        self._record(pipe, request, ticket, item.digest)
        # The payload as encoded for the digest, unless the version stamp changed the request since
        payload = EncodedPayload(item.body) if request is item.request else request.model_dump(mode="json")
        self._queues[ticket.shard].enqueue_call(
            JOB_OF_KIND[request.kind],
            args=(payload,),
            job_id=ticket.request_id,
            pipeline=pipe,
            timeout=self.config.job_timeout_s,
            result_ttl=self.config.rq_result_ttl_s,
            failure_ttl=self.config.rq_failure_ttl_s,
            # Prompts never reach the dashboard's description column.
            description=f"{request.kind} {request.model_id}",
        )

    @staticmethod
    def _duplicate(item: _Item, first_rid: str, first_digest: str | None, first_version: int | None) -> Ticket:
        if first_digest is not None and not same_body(item.digest, item.request, first_digest):
            request = item.request
            seq_id = seq_id_of(request)
            where = f"(model_id={request.model_id}, seq_id={seq_id})" if first_rid != item.rid else \
                f"request id {item.rid}"
            raise Rejected.of(409, "idempotency_conflict", f"{where} was already used with a different body")
        # With no record left (expired) the seq key still stands: answer with the first id.
        return Ticket(first_rid, item.shard, first_version, duplicate=True)

    @staticmethod
    def _stamp_version(request: Request, latest: int) -> tuple[Request, int | None]:
        if isinstance(request, WeightSyncRequest):
            return request.model_copy(update={"version": latest + 1}), latest + 1
        if isinstance(request, SampleRequest):
            if request.weights_version is None:
                return request.model_copy(update={"weights_version": latest}), latest
            return request, request.weights_version
        return request, None

    def _record(self, pipe: Pipeline, request: Request, ticket: Ticket, body_digest: str) -> None:
        rid = ticket.request_id
        record = {
            "kind": request.kind,
            "model": request.model_id,
            "shard": ticket.shard,
            "digest": body_digest,
            "status": "queued",
            "created": time.time(),
        }
        if ticket.version is not None:
            record["version"] = ticket.version
        if isinstance(request, WeightSyncRequest):
            pipe.set(keys.wver_key(request.model_id), ticket.version)
        seq_id = seq_id_of(request)
        if seq_id is not None:
            pipe.set(keys.seq_key(request.model_id, seq_id), rid, ex=self.config.request_ttl_s)
        pipe.hset(keys.request_key(rid), mapping=record)
        pipe.expire(keys.request_key(rid), self.config.request_ttl_s)

    def get(self, request_id: str) -> Result | None:
        return get_result(self.connection, request_id)

    def wait(self, request_id: str, timeout: float) -> Result | None:
        """Block until the request's result lands (None after `timeout` seconds)."""
        if self._waiter is None:
            self._waiter = ResultWaiter(self.connection)
        return self._waiter.wait(request_id, timeout)

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.close()

    def queue_depths(self) -> list[int]:
        return queues.lengths(self.connection, [queue.key for queue in self._queues])

