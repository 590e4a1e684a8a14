"""Gather the samples that may share one engine run with the sample being run.

RQ pops one job at a time. Samples of a model between two of its barriers all see the same
weights, so the worker looks ahead in its shard queue and takes, together with the job at hand,
every queued sample whose model has no non-sample job (sync, training op) ahead of it. While the
engine runs, samples that arrive join it (continuous batching) as long as no non-sample job of any
model is queued ahead of them and the worker's other shard queues are empty, so a sync, a training op or
another shard's job waits at most for the running batch to drain.
With the lanes (worker/serving/sampling_lane.py) the sampling lane's runs take, besides, the queued samples pinned
to weights the engine holds, past the training ops of their model (`LaneRun`, `Batcher.take` with `ready`).
The taken jobs move atomically from the queue to the shard's batched list (so a crash loses none:
recovery puts them back at the front); each result is stored as it is ready, and the jobs served in one
engine step are marked finished in RQ together, at the next step; on an exception the unfinished ones go
back to the head of the queue and are retried one by one.
Looked-ahead jobs are judged like popped ones (worker/consumer/admission.py); one that is refused, or whose hash cannot
even be loaded, is left in the queue to be answered on its own turn, and fails no one else.
"""

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from redis import Redis
from rq.job import Job, JobStatus
from rq.registry import FinishedJobRegistry
from rq.results import Result as RQResult
from rq.utils import now, utcformat

from schemas import Result, SampleRequest
from tinkerq import keys, queues
from tinkerq.jobs import JobSerializer
from worker.consumer.admission import Admission, Admitted, job_id
from worker.consumer.batched import BatchedList
from worker.consumer.claim import intermediate_key
from worker.consumer.rq_worker import AllowlistJob
from worker.shards.fencing import Fence

log = logging.getLogger(__name__)


# Whether the engine holds a model's weights version now (a sample pinned to it depends on nothing still queued).
Ready = Callable[[str, int], bool]
# The jobs a sample pinned to weights the engine holds may pass: they change the trainer, never the engine's
# snapshots. A sync may evict the snapshot, a create or load replace the model: a sample queued behind one waits.
PASSABLE = frozenset({b"forward", b"forward_backward", b"optim_step", b"save_state", b"create_custom_loss",
                      b"delete_checkpoint"})


@dataclass(frozen=True)
class Taken:
    request_id: str
    request: SampleRequest
    job: Job
    started: str  # when the run took it (RQ's started_at)


class Batcher:
    def __init__(self, connection: Redis, fence: Fence, rq_result_ttl_s: int, admission: Admission) -> None:
        self.connection = connection
        self.fence = fence
        self.rq_result_ttl_s = rq_result_ttl_s
        self.admission = admission
        self._batched: dict[int, BatchedList] = {}

    def batched(self, shard: int) -> BatchedList:
        if shard not in self._batched:
            self._batched[shard] = BatchedList(shard, self.connection, self.fence)
        return self._batched[shard]

    def take(self, queue_key: str, shard: int, limit: int, accept: Callable[[SampleRequest], bool] | None = None,
             before_any_barrier: bool = False, ready: Ready | None = None,
             exclude: Collection[str] = ()) -> list[Taken]:
        """Take up to `limit` queued samples that may be served now (and that `accept` takes), in queue order:
        those with no job of their model queued ahead of them; with `before_any_barrier`, only those ahead of every
        queued non-sample job; with `ready` (the sampling lane's look-ahead), those pinned to weights that `ready`
        says the engine holds, even past their model's training ops (never past a sync, create or load).
        None of `exclude`."""
        if limit <= 0:
            return []
        candidates = [rid for rid in self._servable_ids(queue_key, limit, before_any_barrier, ready)
                      if rid not in exclude]
        loaded = {c.request_id: c for c in self._load(shard, candidates) if accept is None or accept(c.request)}
        return [loaded[rid] for rid in self.batched(shard).take_from(queue_key, list(loaded))]

    def take_claimed(self, queue_key: str, shard: int, taken: Taken) -> bool:
        """Move a job the RQ loop claimed (worker/consumer/claim.py) into the batched list, in one fenced step: the
        sampling lane serves it from there, and recovery finds it there after a crash. False if it was not claimed."""
        return bool(self.batched(shard).take_from(intermediate_key(queue_key), [taken.request_id]))

    def _servable_ids(self, queue_key: str, limit: int, before_any_barrier: bool, ready: Ready | None) -> list[str]:
        # an entry that is no request id is left for the pop to drop
        ids = [rid for rid in map(job_id, self.connection.lrange(queue_key, 0, 2 * limit - 1)) if rid is not None]
        if not ids:
            return []
        with self.connection.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hmget(keys.request_key(rid), "kind", "model", "version")
            records = pipe.execute(raise_on_error=False)  # a key of another type is an error for that id alone
        blocked: dict[bytes, bool] = {}  # model -> whether a job it may not pass is queued ahead (else: passable ones)
        picked: list[str] = []
        for rid, record in zip(ids, records):
            kind, model, version = (None, None, None) if isinstance(record, Exception) else record
            if kind is None:
                continue  # no record (malformed or foreign job): it gets its own error when popped
            if kind != b"sample":
                if before_any_barrier:
                    break
                blocked[model] = blocked.get(model, False) or kind not in PASSABLE
            elif (model not in blocked if ready is None  # the RQ loop's own run: every job before it has run
                  # the lane's: the RQ loop may be running a job of this model right now (claimed, out of the queue)
                  else not blocked.get(model) and version is not None and ready(model.decode(), int(version))):
                picked.append(rid)
                if len(picked) == limit:
                    break
        return picked

    def _load(self, shard: int, ids: list[str]) -> list[Taken]:
        """The admitted samples among `ids`, loaded one hash at a time: a corrupt one is skipped, not fatal."""
        with self.connection.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hgetall(AllowlistJob.key_for(rid))
            hashes = pipe.execute(raise_on_error=False)
        queue_name = keys.queue_name(shard)
        started = utcformat(now())
        loaded = []
        for rid, raw in zip(ids, hashes):
            if not raw or isinstance(raw, Exception):
                continue  # gone or not a hash: answered when popped
            job = AllowlistJob(rid, connection=self.connection, serializer=JobSerializer)
            try:
                job.restore(raw)  # what Job.fetch_many does for each hash (RQ-internal; rq is pinned)
            except Exception:  # noqa: BLE001 - any malformed job is left for its own turn
                log.debug("lookahead skips %s: its job hash does not load; it will fail on its own", rid)
                continue
            verdict = self.admission.admit(job, queue_name)
            if isinstance(verdict, Admitted) and isinstance(verdict.request, SampleRequest):
                job.verdict = verdict
                loaded.append(Taken(rid, verdict.request, job, started))
        return loaded

    def mark_finished(self, shard: int, taken: list[Taken], worker_name: str | None) -> None:
        """Mark served jobs FINISHED in RQ (for the dashboard) and drop them from the batched list. What RQ's own
        success path writes, less its rewrite of every field of the job's hash (unchanged since it was taken but for
        these): the status and times, the result, the finished registry, and the hash's expiry."""
        if not taken:
            return
        ended = utcformat(now())
        ttl = self.rq_result_ttl_s
        with self.fence.pipeline(shard) as pipe:  # a former owner woken from a pause marks nothing
            for item in taken:
                job = item.job
                pipe.hset(job.key, mapping={"status": JobStatus.FINISHED.value, "started_at": item.started,
                                            "ended_at": ended})
                pipe.expire(job.key, ttl)
                RQResult.create(job, RQResult.Type.SUCCESSFUL, ttl=ttl, pipeline=pipe, worker_name=worker_name or "",
                                return_value={"request_id": item.request_id, "type": "sample", "batched": True})
                FinishedJobRegistry(job.origin, connection=self.connection).add(job, ttl, pipe)
                self.batched(shard).remove(item.request_id, pipe)
            pipe.execute()

    def release(self, queue_key: str, shard: int, taken: list[Taken]) -> None:
        """Put taken jobs back at the head of the queue, in their order (after a failed batch). Fenced: a worker
        that lost the shard puts nothing back (the new owner's recovery has them)."""
        if not taken:
            return
        with self.fence.pipeline(shard) as pipe:
            self.batched(shard).put_back(queue_key, [item.request_id for item in taken], pipe)
            pipe.execute()


class EngineRun:
    """The samples one engine run serves: the job at hand, those taken with it, and those admitted while it
    runs: only while the worker's other queues (`other_queue_keys`) are empty, and for `admit_s` at most, so
    that a stream of samples on one shard holds up no other job for long."""

    def __init__(self, batcher: Batcher, queue_key: str, shard: int, max_requests: int, admit_s: float,
                 other_queue_keys: list[str], store: Callable[[list[tuple[str, Result]]], object],
                 worker_name: str | None = None, stopping: Callable[[], bool] = lambda: False) -> None:
        self.batcher, self.queue_key, self.shard, self.worker_name = batcher, queue_key, shard, worker_name
        self.store = store  # stores results, many in one round trip
        self.stopping = stopping  # a worker asked to stop admits no more: the batch drains and it returns
        self.other_queue_keys = other_queue_keys
        self.max_requests = max_requests
        self.admit_until = time.monotonic() + admit_s
        self.requests: dict[str, SampleRequest] = {}  # request id -> request, of every request taken in
        self.unfinished: dict[str, Taken] = {}
        self.served: set[str] = set()
        self._to_store: list[tuple[str, Result]] = []  # served, the result not yet stored
        self._to_mark: list[Taken] = []  # served, not yet marked FINISHED in RQ

    def start(self, request_id: str, request: SampleRequest) -> list[tuple[str, SampleRequest]]:
        self.requests[request_id] = request
        return [(request_id, request)] + self._take(self.batcher.take(self.queue_key, self.shard,
                                                                       self.max_requests - 1))

    def admit(self, accept: Callable[[SampleRequest], bool]) -> list[tuple[str, SampleRequest]]:
        self.flush()
        room = self.max_requests - len(self.unfinished) - 1
        if room <= 0 or time.monotonic() > self.admit_until or self.stopping():
            return []
        mine, *others = queues.lengths(self.batcher.connection, [self.queue_key, *self.other_queue_keys])
        if not mine or any(others):
            return []
        return self._take(self.batcher.take(self.queue_key, self.shard, room, accept, before_any_barrier=True))

    def record_served(self, request_id: str, result: Result) -> None:
        """The request is served: its result is stored, and its RQ job marked finished, at the next flush (the job
        at hand is RQ's own to finish)."""
        self.served.add(request_id)
        self._to_store.append((request_id, result))
        taken = self.unfinished.pop(request_id, None)
        if taken is not None:
            self._to_mark.append(taken)

    def flush(self) -> None:
        """Store the results served since the last flush, then mark their jobs FINISHED in RQ: the engine calls admit
        once per step, so the samples one step finished cost two round trips here, not two each (256 samples of one
        length all end in the same step). A crash before the flush leaves them in flight; recovery requeues them,
        and those whose result was stored find it there."""
        to_store, to_mark = self._to_store, self._to_mark
        self._to_store, self._to_mark = [], []
        if to_store:
            self.store(to_store)
        self.batcher.mark_finished(self.shard, to_mark, self.worker_name)

    def release(self) -> None:
        """After a failure: put back what was taken and not served."""
        self.batcher.release(self.queue_key, self.shard, list(self.unfinished.values()))

    def _take(self, taken: list[Taken]) -> list[tuple[str, SampleRequest]]:
        for item in taken:
            self.unfinished[item.request_id] = item
            self.requests[item.request_id] = item.request
        return [(item.request_id, item.request) for item in taken]


# The samples the RQ loop handed the sampling lane for a shard, up to a count, that a predicate accepts (the others
# stay with the lane for a later run).
Handed = Callable[[int, int, Callable[[SampleRequest], bool]], list[Taken]]


class LaneRun(EngineRun):
    """An engine run of the sampling lane (worker/serving/sampling_lane.py): every request in it was taken, none is
    RQ's job at hand. It admits, between steps and for `admit_s` at most, what the RQ loop handed the lane for
    this shard (`handed`) and the queued samples whose weights the engine holds (`ready`), whatever else is
    queued: the training lane runs the rest at the same time."""

    def __init__(self, batcher: Batcher, queue_key: str, shard: int, max_requests: int, admit_s: float,
                 store: Callable[[list[tuple[str, Result]]], object], worker_name: str | None,
                 stopping: Callable[[], bool], handed: Handed, ready: Ready, alone: Collection[str]) -> None:
        super().__init__(batcher, queue_key, shard, max_requests, admit_s, [], store, worker_name, stopping)
        self.handed, self.ready = handed, ready
        self.alone = alone  # samples a lane run failed: the RQ loop serves each on its own

    def start_taken(self, taken: list[Taken]) -> list[tuple[str, SampleRequest]]:
        return self._take(taken) + self._take(self.batcher.take(self.queue_key, self.shard,
                                                                self.max_requests - len(taken), ready=self.ready,
                                                                exclude=self.alone))

    def admit(self, accept: Callable[[SampleRequest], bool]) -> list[tuple[str, SampleRequest]]:
        self.flush()
        room = self.max_requests - len(self.unfinished)
        if room <= 0 or time.monotonic() > self.admit_until or self.stopping():
            return []
        handed = self._take(self.handed(self.shard, room, accept))
        return handed + self._take(self.batcher.take(self.queue_key, self.shard, room - len(handed), accept,
                                                     ready=self.ready, exclude=self.alone))
