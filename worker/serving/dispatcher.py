"""Turn one dequeued job into exactly one stored result (or a parked training op)."""

import json
import logging
import os
import threading
import time
from typing import Any

from redis import Redis
from rq.job import Job

from schemas import (
    CheckpointRecord,
    CreateCustomLossRequest,
    CreateModelOutput,
    DeleteCheckpointOutput,
    DeleteCheckpointRequest,
    ErrorResponse,
    Limits,
    LoadStateOutput,
    OptimStepRequest,
    Request,
    Result,
    SampleOutput,
    SampleRequest,
    SaveStateOutput,
    WeightSyncOutput,
)
from schemas.arrays import LISTS
from tinkerq import keys
from tinkerq.config import LimitsConfig, QueueConfig
from worker.consumer.admission import Admission, Refused
from worker.durability.checkpointer import Checkpointer
from worker.durability.journal import Journal, changes_state, reproducible
from worker.durability.restore import Restorer
from worker.runtime import DomainError, Runtime
from worker.serving import batching
from worker.serving.sequencing import Sequencer
from worker.serving.stability import StabilityRecords
from worker.shards.fencing import Fence, FencedOut

log = logging.getLogger(__name__)


def encoded(result: Result, packed: bool) -> str:
    """A result's JSON: its arrays packed (schemas/arrays.py) where the producer reads that form, else as number
    lists, which every producer reads."""
    return result.model_dump_json(context=None if packed else LISTS)


def packed_results(request: Request) -> bool:
    """Whether the request's producer reads results' arrays packed (ForwardRequest.packed_results)."""
    return getattr(request, "packed_results", False)


def summary(request_id: str, result: Result) -> dict[str, Any]:
    """What RQ keeps as the job's return value: small, for the dashboard only."""
    out: dict[str, Any] = {"request_id": request_id, "type": result.type}
    if isinstance(result, ErrorResponse):
        out["code"] = result.code
    return out


class Dispatcher:
    """Turns an admitted job into exactly one stored result. It owns the admission rules, the batcher (the samples
    taken with a job), the sequencer (a model's training ops run in seq_id order, an early one parked), durability
    (journal, restorer, checkpointer) and the stability records; it serves against the worker process's runtime.
    Invariants: every write is fenced by the shard's lease and the first result stored wins (`store_result`), so a
    request gets one result however often it runs; a state-changing op's result is stored together with its journal
    entry when durable; a job whose result is already stored is skipped."""

    def __init__(self, connection: Redis, runtime: Runtime, fence: Fence, config: QueueConfig,
                 limits: Limits | None = None) -> None:
        self.connection = connection
        self.runtime = runtime
        self.fence = fence
        self.config = config
        self.admission = Admission(config, limits or LimitsConfig())
        self.batcher = batching.Batcher(connection, fence, config.rq_result_ttl_s, self.admission)
        self.stability = StabilityRecords(connection, fence, config.stability_ttl_s)
        self.stopping = threading.Event()  # set when the worker is asked to stop: running batches admit no more
        self.journal = Journal(connection)
        self.restorer = Restorer(connection, runtime, self.journal)
        self.checkpointer = Checkpointer(runtime, fence, self.journal, config.durable_every, config.durable_async)
        self.sequencer = Sequencer(connection, fence, config.seq_gap_timeout_s, self._execute, self.store_result,
                                   self.admission)

    def store_result(self, shard: int, request_id: str, result: Result, packed: bool = False) -> bool:
        """Store the request's one result (fenced, first writer wins); `packed`: see encoded()."""
        return self.store_results(shard, [(request_id, result)], packed)[0]

    def store_results(self, shard: int, results: list[tuple[str, Result]], packed: bool = False) -> list[bool]:
        """Store many requests' results in one round trip (the samples one engine step served), each as
        `store_result`."""
        stored = self.fence.put_results(shard, [(rid, encoded(result, packed), _status(result))
                                                for rid, result in results], self.config.result_ttl_s)
        for (rid, _), fresh in zip(results, stored):
            if not fresh:
                log.info("result of %s was already stored; keeping the first", rid)
        return stored

    def fail(self, shard: int, request_id: str, error: ErrorResponse) -> None:
        """Best-effort error result for infrastructure failures (never raises)."""
        try:
            self.store_result(shard, request_id, error)
        except Exception:  # called from failure paths that must not fail again
            log.exception("could not store the error result of %s", request_id)

    def handle(self, job: Job) -> dict[str, Any]:
        """Serve a job the worker admitted, or answer the refusal of its payload (worker/consumer/admission.py)."""
        verdict = job.verdict
        if verdict is None:
            raise RuntimeError(f"job {job.id} reached the dispatcher without the worker's verdict")
        rid, shard = verdict.request_id, verdict.shard
        if self.connection.exists(keys.result_key(rid)):
            return {"request_id": rid, "skipped": "result already stored"}
        if isinstance(verdict, Refused):
            self.store_result(shard, rid, verdict.error)
            return summary(rid, verdict.error)
        request = verdict.request
        if isinstance(request, SampleRequest):
            return self._sample(job, shard, rid, request)
        return {"request_id": rid, "seq": self.sequencer.submit(shard, rid, request)}

    def _execute(self, shard: int, rid: str, request: Request) -> None:
        request = reproducible(request)
        if self.config.durable and not isinstance(request, (DeleteCheckpointRequest, CreateCustomLossRequest)):
            lost = self.restorer.ensure(request.model_id)
            if lost is not None:
                self.store_result(shard, rid, lost)
                return
        try:
            result = self.runtime.execute(request)
        except DomainError as exc:
            result = self._state_lost(request.model_id, exc.response())
        except Exception as exc:
            self.restorer.diverged(request.model_id)  # it may have stopped halfway through changing the model
            # This op may be a parked one run inside another job: answer it here, then let RQ see it.
            self.fail(shard, rid, classify(type(exc), exc))
            raise
        if isinstance(result, WeightSyncOutput):
            self._publish_sync(shard, result)
        elif isinstance(result, (CreateModelOutput, LoadStateOutput)):
            info = {"base_model": result.base_model, "lora_rank": result.lora_rank}
            self.fence.hset(shard, keys.info_key(result.model_id), "json", json.dumps(info))
            if result.base_model is not None:  # what a standby warms (worker/shards/preload.py)
                self.fence.hset(shard, keys.shard_bases_key(shard), result.base_model, result.model_id)
        self._register_checkpoint(shard, request, result)
        if self.config.durable and changes_state(request, result):
            self._store_journaled(shard, rid, request, result)
        else:
            self.store_result(shard, rid, result, packed_results(request))

    def _store_journaled(self, shard: int, rid: str, request: Request, result: Result) -> None:
        """Store the result of a state-changing op together with its journal entry (worker/durability/journal.py)."""
        model_id = request.model_id
        try:
            length = self.fence.put_result_journaled(
                shard, rid, encoded(result, packed_results(request)), self.config.result_ttl_s, "done",
                self.journal.key(model_id),
                self.journal.entry(request), keys.last_seq_key(model_id), request.seq_id,
                self.journal.base_key(model_id), optim_step=isinstance(request, OptimStepRequest))
        except BaseException:
            self.restorer.diverged(model_id)  # ran here, but not journaled
            raise
        if not length:
            log.info("result of %s was already stored; keeping the first", rid)
        self.restorer.journaled(model_id, length)
        if isinstance(request, OptimStepRequest) and self.restorer.reflects(model_id, length):
            self.checkpointer.stepped(shard, model_id, length)

    def make_durable(self, shards: list[int]) -> int:
        """Checkpoint every model this worker holds up to date on `shards` (a drain: the next owner loads them
        instead of replaying); how many were written."""
        written = 0
        for model_id, length in self.restorer.current() if self.config.durable else []:
            shard = keys.shard_of(model_id, self.config.num_shards)
            if shard not in shards:
                continue
            self.fence.renew()  # the lease keeper has stopped: many checkpoints may outlast a lease otherwise
            if self.checkpointer.checkpoint(shard, model_id, length):
                written += 1
        return written

    def _register_checkpoint(self, shard: int, request: Request, result: Result) -> None:
        """Saved and deleted checkpoints, for the REST API's listings (fenced, like every authoritative write)."""
        registry = keys.checkpoints_key(request.model_id)
        if isinstance(result, DeleteCheckpointOutput):
            self.fence.hdel(shard, registry, result.checkpoint_id)
            return
        if isinstance(result, SaveStateOutput):
            checkpoint, path = f"weights/{request.name}", result.path
        elif isinstance(result, WeightSyncOutput) and result.path is not None and result.applied:
            checkpoint, path = f"sampler_weights/{request.name}", result.path
        else:
            return
        size = os.path.getsize(path) if os.path.exists(path) else None
        record = CheckpointRecord(time=time.time(), size_bytes=size)
        self.fence.hset(shard, registry, checkpoint, record.model_dump_json())

    def _publish_sync(self, shard: int, result: WeightSyncOutput) -> None:
        """Record the applied version, and register a persisted snapshot's path (both fenced)."""
        self.fence.set_counter(shard, keys.applied_key(result.model_id), result.version)
        if result.path is not None:
            self.fence.hset(shard, keys.snapshots_key(result.model_id), str(result.version), result.path)

    def _sample(self, job: Job, shard: int, rid: str, request: SampleRequest) -> dict[str, Any]:
        # list() copies in one step: the lease keeper thread may take or lose a shard meanwhile
        others = [keys.queue_key(owned) for owned in list(self.fence.tokens) if owned != shard]
        run = batching.EngineRun(self.batcher, keys.queue_key(shard), shard, self.config.max_batch_requests,
                                 self.config.batch_admit_s, others, lambda results: self.store_results(shard, results),
                                 job.worker_name, self.stopping.is_set)

        def done(each_rid: str, result: Result) -> None:
            each = run.requests[each_rid]
            if isinstance(result, SampleOutput):
                self.stability.record(shard, each, result)  # now: before its result can be stored
            run.record_served(each_rid, self._state_lost(each.model_id, result))

        def restored(items: list[tuple[str, SampleRequest]]) -> list[tuple[str, SampleRequest]]:
            """The items whose model is ready here (rebuilt from its journal if need be); the others answered."""
            ready, checked = [], {}  # one check per model, not per sample: a batch may hold hundreds
            for each_rid, each in items:
                if each.base_model is None and self.config.durable and each.model_id not in checked:
                    checked[each.model_id] = self.restorer.ensure(each.model_id)
                lost = checked.get(each.model_id) if each.base_model is None else None
                if lost is None:
                    ready.append((each_rid, each))
                else:
                    done(each_rid, lost)
            return ready

        def admit(accept):  # noqa: ANN001, ANN202 - samples of a model not held here wait to be served first,
            # and so do those of a snapshot to read back from its archive (never while a batch runs)
            held, reload = self.runtime.trainer.has_model, self.runtime.needs_reload
            return run.admit(lambda each: (each.base_model is not None or held(each.model_id) and not reload(each))
                             and accept(each))

        try:
            self.runtime.sample_stream(restored(run.start(rid, request)), done, admit)
        except Exception:
            run.release()  # each will be retried on its own
            if rid not in run.served:
                raise
            # this job's own sample was served: the failure belongs to samples it took in, now back in the queue
            log.exception("the engine failed after %s was served; the samples it had taken in are requeued", rid)
        except BaseException:
            run.release()
            raise
        finally:
            run.flush()
        return {"request_id": rid, "type": "sample", "batch": len(run.requests)}

    def _state_lost(self, model_id: str, result: Result) -> Result:
        """`unknown_model` for a model that Redis knows was created: its state lived in the memory of a worker
        that is gone (it died, or its shard moved), and saying "create it first" would mislead."""
        if not (isinstance(result, ErrorResponse) and result.code == "unknown_model"):
            return result
        if not self.connection.exists(keys.info_key(model_id)):
            return result
        return ErrorResponse(status=500, code="model_state_lost", error=(
            f"model {model_id!r} was created on a worker that is gone, and its training state and weight "
            "snapshots lived in that worker's memory; restore it with load_state from a saved state, or create "
            "a new model"))

    def internal_error(self, job: Job, exc_type: type, exc: BaseException) -> None:
        """RQ exception handler: the job raised or timed out (or was refused as forged); its request still gets
        one result."""
        if isinstance(exc, FencedOut):
            return  # the new owner will run it again
        verdict = getattr(job, "verdict", None)
        if isinstance(verdict, Refused) and verdict.forged:
            self.fail(verdict.shard, verdict.request_id, verdict.error)
        elif verdict is not None:
            self.fail(verdict.shard, verdict.request_id, classify(exc_type, exc))
        else:  # a job RQ's own maintenance handled (an abandoned one): trust its hash only as far as it checks out
            try:
                shard = keys.shard_of_queue(job.origin)
            except ValueError:
                log.error("job %s has origin %r, which is no shard queue: its error result is not stored",
                          job.id, job.origin)
                return
            self.fail(shard, job.id, classify(exc_type, exc))


def _status(result: Result) -> str:
    return "error" if isinstance(result, ErrorResponse) else "done"


def classify(exc_type: type, exc: BaseException) -> ErrorResponse:
    """The ErrorResponse for an exception that escaped a job."""
    name = exc_type.__name__
    if name == "JobTimeoutException":
        return ErrorResponse(error=f"the job exceeded its time limit: {exc}", status=504, code="timeout",
                             retryable=True)
    if name in ("DeserializationError", "ForbiddenJob"):
        return ErrorResponse(error=f"the job could not be run: {exc}", status=400, code="invalid_job")
    return ErrorResponse(error=f"{name}: {exc}", status=500, code="internal_error", retryable=True)
