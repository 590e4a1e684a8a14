"""A training op in its turn (the sequencer calls `execute` in seq_id order): create, forward(_backward),
optim_step, weight sync, save and load. It runs on the runtime, its result is stored with its journal entry where
it changes the model, and what it changed is published for everyone else: the applied version, a persisted
snapshot's path, the checkpoint listings, the bases a standby warms."""

import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from redis import Redis

from schemas import (
    CheckpointRecord,
    CreateCustomLossRequest,
    CreateModelOutput,
    DeleteCheckpointOutput,
    DeleteCheckpointRequest,
    LoadStateOutput,
    LoadStateRequest,
    OptimStepRequest,
    Request,
    Result,
    SaveStateOutput,
    WeightSyncOutput,
    WeightSyncRequest,
)
from tinkerq import keys
from tinkerq.config import QueueConfig
from worker.durability.checkpointer import Checkpointer
from worker.durability.journal import Journal, changes_state, reproducible
from worker.durability.restore import Restorer
from worker.runtime import DomainError, Runtime
from worker.serving.results import ResultStore, classify, encoded, packed_results
from worker.shards.fencing import Fence

log = logging.getLogger(__name__)


class TrainingOps:
    """Runs training ops against the runtime and owns their durability: the journal, the restorer (a model this
    worker does not hold is rebuilt before its op runs) and the checkpointer."""

    def __init__(self, connection: Redis, runtime: Runtime, fence: Fence, config: QueueConfig,
                 results: ResultStore) -> None:
        self.runtime = runtime
        self.fence = fence
        self.config = config
        self.results = results
        self.journal = Journal(connection)
        self.restorer = Restorer(connection, runtime, self.journal)
        self.checkpointer = Checkpointer(runtime, fence, self.journal, config.durable_every, config.durable_async)
        # Around an op that changes the model's weights in the engine: the sampling lane first serves the samples
        # of it handed over before (worker/serving/sampling_lane.py); nothing to wait for without lanes.
        self.quiesced: Callable[[str], AbstractContextManager[None]] = lambda model_id: nullcontext()

    def execute(self, shard: int, rid: str, request: Request) -> None:
        """Run one op whose turn came, and store its one result."""
        if isinstance(request, (WeightSyncRequest, LoadStateRequest)):
            with self.quiesced(request.model_id):
                self._execute(shard, rid, request)
        else:
            self._execute(shard, rid, request)

    def _execute(self, shard: int, rid: str, request: Request) -> None:
        request = reproducible(request)
        if self.config.durable and not isinstance(request, (DeleteCheckpointRequest, CreateCustomLossRequest)):
            lost = self.restorer.ensure(request.model_id)
            if lost is not None:
                self.results.store_result(shard, rid, lost)
                return
        try:
            result = self.runtime.execute(request)
        except DomainError as exc:
            result = self.results.state_lost(request.model_id, exc.response())
        except Exception as exc:
            self.restorer.diverged(request.model_id)  # it may have stopped halfway through changing the model
            # This op may be a parked one run inside another job: answer it here, then let RQ see it.
            self.results.fail(shard, rid, classify(type(exc), exc))
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
            self.results.store_result(shard, rid, result, packed_results(request))

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
