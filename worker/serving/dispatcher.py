"""Turn one dequeued job into exactly one stored result (or a parked training op): samples go to the engine (the
sampling lane, or `sampling` right here), training ops to the sequencer, which runs them in seq_id order
(`training_ops`)."""

import logging
from contextlib import nullcontext
from typing import Any

from redis import Redis
from rq.job import Job

from schemas import Limits, SampleRequest
from tinkerq import keys
from tinkerq.config import LimitsConfig, QueueConfig
from worker.consumer.admission import Admission, Admitted, Refused
from worker.runtime import Runtime
from worker.serving.results import ResultStore, classify, summary
from worker.serving.sampling import Sampling
from worker.serving.sampling_lane import SamplingLane
from worker.serving.sequencing import Sequencer
from worker.serving.training_ops import TrainingOps
from worker.shards.fencing import Fence, FencedOut

log = logging.getLogger(__name__)


class Dispatcher:
    """Turns an admitted job into exactly one stored result. It owns the admission rules, the result store, the
    sampling side (the batcher: the samples taken with a job; the stability records), the training side (durability:
    journal, restorer, checkpointer) and the sequencer between them (a model's training ops run in seq_id order, an
    early one parked); both sides serve against the worker process's runtime.
    Invariants: every write is fenced by the shard's lease and the first result stored wins (`store_result`), so a
    request gets one result however often it runs; a state-changing op's result is stored together with its journal
    entry when durable; a job whose result is already stored is skipped."""

    def __init__(self, connection: Redis, runtime: Runtime, fence: Fence, config: QueueConfig,
                 limits: Limits | None = None, name: str = "") -> None:
        self.connection = connection
        self.runtime = runtime
        self.admission = Admission(config, limits or LimitsConfig())
        self.results = ResultStore(connection, fence, config.result_ttl_s)
        self.training = TrainingOps(connection, runtime, fence, config, self.results)
        self.sampling = Sampling(connection, runtime, fence, config, self.admission, self.results,
                                 self.training.restorer)
        self.sequencer = Sequencer(connection, fence, config.seq_gap_timeout_s, self.training.execute,
                                   self.results.store_result, self.admission)
        # the RQ loop is the training lane; with lanes on, samples are served beside it (serving/sampling_lane.py)
        self.lane = SamplingLane(self.sampling, runtime, fence, config, name) if config.lanes else None
        if self.lane is not None:
            self.training.quiesced = self.lane.quiesced

    def handle(self, job: Job) -> dict[str, Any]:
        """Serve a job the worker admitted, or answer the refusal of its payload (worker/consumer/admission.py)."""
        verdict = job.verdict
        if verdict is None:
            raise RuntimeError(f"job {job.id} reached the dispatcher without the worker's verdict")
        rid, shard = verdict.request_id, verdict.shard
        if self.connection.exists(keys.result_key(rid)):
            return {"request_id": rid, "skipped": "result already stored"}
        if isinstance(verdict, Refused):
            self.results.store_result(shard, rid, verdict.error)
            return summary(rid, verdict.error)
        request = verdict.request
        if isinstance(request, SampleRequest):
            return self.sampling.serve(job, shard, rid, request)
        with self.lane.beside_training() if self.lane is not None else nullcontext():
            return {"request_id": rid, "seq": self.sequencer.submit(shard, rid, request)}

    def take_over(self, job: Job) -> bool:
        """A sample the RQ loop claimed goes to the sampling lane once its model is ready here (rebuilt from its
        journal by this, the training lane, if need be); True if the lane took it."""
        verdict = job.verdict
        if self.lane is None or not isinstance(verdict, Admitted) or not isinstance(verdict.request, SampleRequest):
            return False
        rid, shard, request = verdict.request_id, verdict.shard, verdict.request
        if self.connection.exists(keys.result_key(rid)):
            return False  # answered already: the RQ loop skips it
        if not self.sampling.ready_here([(rid, request)], lambda _, lost: None):
            return False  # the RQ loop answers what was lost
        return self.lane.hand_off(job, shard, rid, request)


    def make_durable(self, shards: list[int]) -> int:
        """Checkpoint every model this worker holds up to date on `shards` (what a drain does); how many were
        written."""
        return self.training.make_durable(shards)

    def internal_error(self, job: Job, exc_type: type, exc: BaseException) -> None:
        """RQ exception handler: the job raised or timed out (or was refused as forged); its request still gets
        one result."""
        if isinstance(exc, FencedOut):
            return  # the new owner will run it again
        verdict = getattr(job, "verdict", None)
        if isinstance(verdict, Refused) and verdict.forged:
            self.results.fail(verdict.shard, verdict.request_id, verdict.error)
        elif verdict is not None:
            self.results.fail(verdict.shard, verdict.request_id, classify(exc_type, exc))
        else:  # a job RQ's own maintenance handled (an abandoned one): trust its hash only as far as it checks out
            try:
                shard = keys.shard_of_queue(job.origin)
            except ValueError:
                log.error("job %s has origin %r, which is no shard queue: its error result is not stored",
                          job.id, job.origin)
                return
            self.results.fail(shard, job.id, classify(exc_type, exc))

