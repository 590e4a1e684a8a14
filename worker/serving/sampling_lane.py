"""The sampling lane: the engine side of a worker, on a thread of its own, serving samples while the RQ loop (the
training lane) runs training ops.

A sample depends only on the weights version it is pinned to (design contract 3): once the engine holds that
version, nothing queued ahead of it (another model's forward_backward, its own model's next optim_step) has to run
first. So the lane serves
- the samples the RQ loop pops: it hands them over (`hand_off`) and goes on to the next job at once;
- and, while the RQ loop runs a training op, the queued samples pinned to weights the engine holds, taken out of
  the queue ahead of their turn (`Batcher.take` with `ready`): past any other model's jobs and their own model's
  training ops, never past a sync, create or load of their model.
Each taken sample moves atomically into its shard's batched list, as the samples of a serial run do, so a crash
loses none (recovery requeues them) and each result is stored fenced, first writer wins.

What stays ordered: a change to a model's weights in the engine (a sync, which may evict the snapshot a queued
sample is pinned to; a load) is applied after the samples handed over before it (`quiesced`), and no run
overlaps it (the runtime's engine gate). A sample the lane failed to serve goes back to its queue's head and is
served by the RQ loop alone, which answers it with an error if it fails again.
"""

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rq.job import Job
from rq.timeouts import TimerDeathPenalty
from rq.utils import now, utcformat

from schemas import ErrorResponse, SampleRequest
from tinkerq import keys
from tinkerq.config import QueueConfig
from worker.runtime import Runtime
from worker.serving.batching import Taken
from worker.serving.sampling import Sampling
from worker.shards.fencing import Fence, FencedOut
from worker.shards.outage import REDIS_DOWN

log = logging.getLogger(__name__)


class LaneRunTimeout(Exception):
    """A lane run outlasted the job timeout: its unserved samples go back to the queue, each to be served alone by the
    RQ loop (which answers one that times out again with a 504)."""


class SamplingLane:
    """Owns the lane's thread, its inbox (the samples handed over by the RQ loop, per shard, each already in its
    shard's batched list) and the models held back while the training lane changes their weights in the engine."""

    def __init__(self, sampling: Sampling, runtime: Runtime, fence: Fence, config: QueueConfig,
                 worker_name: str) -> None:
        self.sampling = sampling
        self.runtime = runtime
        self.fence = fence
        self.config = config
        self.worker_name = worker_name
        self.training = threading.Event()  # the RQ loop runs a training op: look ahead meanwhile (beside_training)
        self._inbox: dict[int, list[Taken]] = {}
        self._held_back: Counter[str] = Counter()
        self._alone: set[str] = set()  # failed in a lane run: served by the RQ loop, one at a time
        self._cond = threading.Condition()
        self._busy = False  # in an engine run (guarded by _cond)
        self._stop = threading.Event()  # closing: serve what was handed over, take nothing more, then end
        self._thread: threading.Thread | None = None
        self._next_shard = 0

    # -- the RQ loop's side ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="tinkerq-sampling-lane", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float | None) -> None:
        """Take nothing more from the queues, serve what the RQ loop handed over (as it finishes its job in hand),
        then end. At most `timeout_s`: a lane still serving then is left to the watchdog, and what it holds to the
        shard's recovery."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the sampling lane did not stop within %g s", timeout_s)

    def wait_idle(self) -> None:
        """Until everything handed over is served (a burst worker's end: nothing may be left behind)."""
        with self._cond:
            while (self._busy or any(self._inbox.values())) and self._thread is not None and self._thread.is_alive():
                self._cond.wait(0.05)

    def hand_off(self, job: Job, shard: int, rid: str, request: SampleRequest) -> bool:
        """Take over a sample the RQ loop claimed, with the queued samples that may share its engine run (as the
        RQ loop's own run takes them: every job before them has run); False: the loop serves it itself (the lane
        is stopped, or the sample failed in a lane run before)."""
        if rid in self._alone:
            self._alone.discard(rid)
            return False
        if not self._alive():
            return False
        taken = Taken(rid, request, job, utcformat(now()))
        queue_key = keys.queue_key(shard)
        if not self.sampling.batcher.take_claimed(queue_key, shard, taken):
            return False
        with_it = self._ready_here(shard, self.sampling.batcher.take(queue_key, shard,
                                                                     self.config.max_batch_requests - 1,
                                                                     exclude=self._alone))
        with self._cond:
            self._inbox.setdefault(shard, []).extend([taken, *with_it])
            self._cond.notify_all()
        return True

    def _ready_here(self, shard: int, taken: list[Taken]) -> list[Taken]:
        """Those whose model is ready here (rebuilt from its journal now, on the training lane, if need be); the
        others answered with what was lost, and finished."""
        lost: list[tuple[str, ErrorResponse]] = []
        ready = {rid for rid, _ in self.sampling.ready_here([(t.request_id, t.request) for t in taken],
                                                            lambda rid, error: lost.append((rid, error)))}
        if lost:
            self.sampling.results.store_results(shard, lost)
            self.sampling.batcher.mark_finished(shard, [t for t in taken if t.request_id not in ready],
                                                self.worker_name)
        return [t for t in taken if t.request_id in ready]

    @contextmanager
    def beside_training(self) -> Iterator[None]:
        """While the RQ loop runs a training op, the lane looks ahead in the queues (woken now: it may be waiting
        a whole tick for work)."""
        with self._cond:
            self.training.set()
            self._cond.notify_all()
        try:
            yield
        finally:
            self.training.clear()

    @contextmanager
    def quiesced(self, model_id: str) -> Iterator[None]:
        """The training lane is about to change the model's weights in the engine: the samples of it handed over
        before are served first (an engine run holds the gate the change waits for; those still in the inbox are
        waited for here), and none of it is taken ahead of its turn until the change is made."""
        with self._cond:
            self._held_back[model_id] += 1
            while self._holds(model_id) and self._alive():
                self._cond.wait(0.05)
        try:
            yield
        finally:
            with self._cond:
                self._held_back[model_id] -= 1
                if not self._held_back[model_id]:
                    del self._held_back[model_id]

    def _holds(self, model_id: str) -> bool:
        return any(item.request.model_id == model_id for items in self._inbox.values() for item in items)

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    # -- the lane's thread -----------------------------------------------------------------------------------

    def ready(self, model_id: str, version: int) -> bool:
        """Whether the engine holds the model's weights `version` now (called with the engine gate held)."""
        return (model_id not in self._held_back and self.runtime.trainer.has_model(model_id)
                and version in self.runtime.engine.live_versions(model_id))

    def _loop(self) -> None:
        try:
            while True:
                if self._serve_next():
                    continue
                with self._cond:
                    if self._stop.is_set() and not any(self._inbox.values()):
                        return
                    if not any(self._inbox.values()):
                        self._cond.wait(self.config.lane_poll_s if self.training.is_set() else self.config.tick_s)
        finally:
            self._put_back()

    def _serve_next(self) -> bool:
        """One engine run: the oldest shard's handed-over samples, else (while the training lane is busy) the first
        owned shard with samples ready to serve. False: nothing to serve."""
        shard, taken = None, []
        try:
            with self.runtime.gate.hold():  # taking from the inbox under the gate: see `quiesced`
                shard, taken = self._handed_any()
                if not taken and self.training.is_set() and not self._stop.is_set():
                    shard, taken = self._look_ahead()
                if not taken:
                    return False
                with TimerDeathPenalty(self.config.job_timeout_s, LaneRunTimeout):  # as RQ bounds a job in hand
                    self.sampling.serve_taken(shard, taken, self.worker_name, self._handed, self.ready,
                                              self._stop.is_set, self._alone)
        except FencedOut:
            log.warning("sampling lane: shard %s is no longer this worker's; its samples are the new owner's", shard)
            self._drop(shard)
        except REDIS_DOWN as exc:
            # The inbox is kept and served once Redis answers: its samples are in their batched lists, which only
            # the RQ loop's recovery would requeue, and it runs none when its own connection saw no outage (a reset
            # of the lane's alone). Served twice after a recovery, a sample still keeps its first result.
            log.warning("sampling lane: Redis went away (%s); it serves what it holds once Redis is back", exc)
            self._stop.wait(self.config.tick_s)
        except Exception:
            log.exception("sampling lane: an engine run failed; its samples go back to the queue, served alone")
            self._alone.update(item.request_id for item in taken)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        return True

    def _handed_any(self) -> tuple[int | None, list[Taken]]:
        with self._cond:
            self._busy = True
            for shard, items in self._inbox.items():
                if items:
                    self._inbox[shard] = []
                    self._cond.notify_all()
                    return shard, items
        return None, []

    def _handed(self, shard: int, limit: int, accept: Callable[[SampleRequest], bool]) -> list[Taken]:
        """Handed-over samples of `shard` that a running batch admits (the others wait for the next run)."""
        with self._cond:
            items = self._inbox.get(shard, [])
            admitted = [item for item in items if accept(item.request)][:limit]
            if admitted:
                chosen = {item.request_id for item in admitted}
                self._inbox[shard] = [item for item in items if item.request_id not in chosen]
                self._cond.notify_all()
            return admitted

    def _look_ahead(self) -> tuple[int | None, list[Taken]]:
        owned = sorted(self.fence.tokens)
        for i in range(len(owned)):
            shard = owned[(self._next_shard + i) % len(owned)]
            taken = self.sampling.batcher.take(keys.queue_key(shard), shard, self.config.max_batch_requests,
                                               ready=self.ready, exclude=self._alone)
            if taken:
                self._next_shard = (self._next_shard + i + 1) % len(owned)
                return shard, taken
        return None, []

    def _drop(self, shard: int) -> None:
        """Forget the handed-over samples of a shard no longer this worker's, without touching Redis: they stay in
        its batched list, where the new owner's recovery finds them."""
        with self._cond:
            self._inbox.pop(shard, None)
            self._cond.notify_all()

    def _put_back(self) -> None:
        """At the lane's end: what was handed over and not started goes back to its queue's head, in order."""
        with self._cond:
            inbox, self._inbox = self._inbox, {}
            self._cond.notify_all()
        for shard, items in inbox.items():
            try:
                self.sampling.batcher.release(keys.queue_key(shard), shard, items)
            except (FencedOut, *REDIS_DOWN) as exc:  # the shard's recovery puts them back
                log.warning("sampling lane: could not requeue %d samples of shard %d (%s)", len(items), shard, exc)
