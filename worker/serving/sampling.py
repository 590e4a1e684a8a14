"""A sample job served with the samples batched with it, as one continuous batch on the engine; the samples a step
finished are stored right after that step, in one fenced write."""

import logging
import threading
from collections.abc import Callable, Collection
from typing import Any

from redis import Redis
from rq.job import Job

from schemas import Result, SampleOutput, SampleRequest
from tinkerq import keys
from tinkerq.config import QueueConfig
from worker.consumer.admission import Admission
from worker.durability.restore import Restorer
from worker.runtime import Runtime
from worker.runtime.base import Admit, Keyed
from worker.serving import batching
from worker.serving.results import ResultStore
from worker.serving.stability import StabilityRecords
from worker.shards.fencing import Fence

log = logging.getLogger(__name__)


class Sampling:
    """Serves sample jobs on the runtime's engine. It owns the batcher (the samples taken with a job, and those
    admitted into its running batch) and the stability records, and admits nothing more once `stopping` is set."""

    def __init__(self, connection: Redis, runtime: Runtime, fence: Fence, config: QueueConfig, admission: Admission,
                 results: ResultStore, restorer: Restorer) -> None:
        self.runtime = runtime
        self.fence = fence
        self.config = config
        self.results = results
        self.restorer = restorer
        self.batcher = batching.Batcher(connection, fence, config.rq_result_ttl_s, admission)
        self.stability = StabilityRecords(connection, fence, config.stability_ttl_s)
        self.stopping = threading.Event()  # set when the worker is asked to stop: running batches admit no more

    def serve(self, job: Job, shard: int, rid: str, request: SampleRequest) -> dict[str, Any]:
        """Serve the job's sample and every sample the run takes in; RQ's summary of the job."""
        # list() copies in one step: the lease keeper thread may take or lose a shard meanwhile
        others = [keys.queue_key(owned) for owned in list(self.fence.tokens) if owned != shard]
        run = batching.EngineRun(self.batcher, keys.queue_key(shard), shard, self.config.max_batch_requests,
                                 self.config.batch_admit_s, others,
                                 lambda results: self.results.store_results(shard, results),
                                 job.worker_name, self.stopping.is_set)
        done = self._done(run)
        self._run(run, self.ready_here(run.start(rid, request), done), done, rid)
        return {"request_id": rid, "type": "sample", "batch": len(run.requests)}

    def serve_taken(self, shard: int, taken: list[batching.Taken], worker_name: str, handed: batching.Handed,
                    ready: batching.Ready, stopping: Callable[[], bool], alone: Collection[str]) -> None:
        """The sampling lane's run on one shard: `taken` (already in the shard's batched list; their models ready
        here) and what the run admits (none of `alone`)."""
        run = batching.LaneRun(self.batcher, keys.queue_key(shard), shard, self.config.max_batch_requests,
                               self.config.batch_admit_s, lambda results: self.results.store_results(shard, results),
                               worker_name, lambda: self.stopping.is_set() or stopping(), handed, ready, alone)
        self._run(run, run.start_taken(taken), self._done(run), None)

    def _done(self, run: batching.EngineRun) -> Callable[[str, Result], None]:
        def done(each_rid: str, result: Result) -> None:
            each = run.requests[each_rid]
            if isinstance(result, SampleOutput):
                self.stability.record(run.shard, each, result)  # now: before its result can be stored
            run.record_served(each_rid, self.results.state_lost(each.model_id, result))
        return done

    def _run(self, run: batching.EngineRun, items: Keyed, done: Callable[[str, Result], None],
             own: str | None) -> None:
        """Serve `items` and what the run admits. On a failure the unserved ones go back to the queue's head (each
        is retried on its own), and it is raised unless `own`, the job at hand, was served already."""
        try:
            self.runtime.sample_stream(items, done, self._admit(run))
        except Exception:
            run.release()
            if own is None or own not in run.served:
                raise
            # this job's own sample was served: the failure belongs to samples it took in, now back in the queue
            log.exception("the engine failed after %s was served; the samples it had taken in are requeued", own)
        except BaseException:
            run.release()
            raise
        finally:
            run.flush()

    def ready_here(self, items: Keyed, done: Callable[[str, Result], None]) -> Keyed:
        """The items whose model is ready here (rebuilt from its journal if need be: the training lane's work, never
        the sampling lane's); the others answered."""
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

    def _admit(self, run: batching.EngineRun) -> Admit:
        """The run's admission of late samples, narrowed: samples of a model not held here wait to be served
        first, and so do those of a snapshot to read back from its archive (never while a batch runs)."""
        held, reload = self.runtime.trainer.has_model, self.runtime.needs_reload

        def admit(accept: Callable[[SampleRequest], bool]) -> Keyed:
            return run.admit(lambda each: (each.base_model is not None or held(each.model_id) and not reload(each))
                             and accept(each))
        return admit
