"""The worker process: load the runtime once, own shards through leases, consume them in order."""

import logging
import os
import secrets
import signal
import socket
import threading
import time
from types import TracebackType

from redis import Redis
from rq import Queue
from rq.exceptions import StopRequested
from rq.job import Job

from schemas import ErrorResponse, Limits
from tinkerq import keys, queues
from tinkerq.config import QueueConfig
from tinkerq.jobs import JobSerializer
from tinkerq.keys import shard_of_queue
from worker.consumer.claim import Claimer
from worker.consumer.recovery import recover
from worker.consumer.rq_worker import LostJob, ShardQueue, ShardWorker
from worker.runtime import Runtime
from worker.serving.dispatcher import Dispatcher
from worker.shards.fencing import Fence, FencedOut, FencedRedis
from worker.shards.membership import Membership, fair_share
from worker.shards.outage import REDIS_DOWN, wait_for_redis
from worker.shards.preload import Preloader
from worker.shutdown import StopWatchdog

log = logging.getLogger(__name__)
STANDBY_SLACK_MS = 5  # a standby wakes this long after the lease it waits for is due to lapse


def worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def connect(url: str, config: QueueConfig, name: str) -> Redis:
    """A worker's Redis client: every call bounded (connect and read), so a frozen Redis is an outage the worker
    rides out instead of a hang; its connections named after the worker (CLIENT LIST, MONITOR)."""
    return Redis.from_url(url, **config.redis_timeouts(), client_name=name)


class WorkerProcess:
    """One worker process: it loads the runtime once and outlives many RQ worker loops. It owns the shard leases
    (its `fence`, renewed by the lease keeper thread), the claimer, the dispatcher (and through it the runtime and
    the models it holds) and the current `ShardWorker`, a new incarnation each time the leases change or Redis
    comes back. Invariants: it consumes a shard only under that shard's lease, and only after recovering what the
    shard's last owner left in flight; a Redis outage is waited out (up to `redis_outage_s`), never a crash; a stop
    ends the job in hand, records a checkpoint being written and releases the leases within `stop_grace_s` (the
    watchdog ends the process otherwise)."""

    def __init__(
        self,
        connection: Redis,
        runtime: Runtime,
        config: QueueConfig | None = None,
        shards: list[int] | None = None,
        limits: Limits | None = None,
        name: str | None = None,
        balanced: bool = False,
    ) -> None:
        self.connection = connection
        self.config = config or QueueConfig()
        keys.check_num_shards(connection, self.config.num_shards)
        self.wanted = sorted(set(shards)) if shards is not None else list(range(self.config.num_shards))
        if any(not 0 <= s < self.config.num_shards for s in self.wanted):
            raise ValueError(f"shards must lie in [0, {self.config.num_shards}); got {self.wanted}")
        self.name = name or worker_name()
        self.fence = Fence(connection, self.name, self.config.lease_ttl_ms, self.config.redis_outage_s)
        # `--shards auto`: hold at most a fair share of the wanted shards (membership.py); else every one it can
        self.membership = Membership(connection, self.name, self.config.lease_ttl_ms) if balanced else None
        self.share = len(self.wanted)
        self.claimer = Claimer(connection, self.fence)
        self.dispatcher = Dispatcher(connection, runtime, self.fence, self.config, limits, self.name)
        self.preloader = Preloader(connection, runtime, self.config.preload_bases, self.wanted)
        self.rq_worker: ShardWorker | None = None
        self._stopping = self.dispatcher.sampling.stopping
        self.draining = threading.Event()  # `tinkerq drain` named this worker (_keep_once)
        # The lease keeper runs until the leases are about to be released: a draining worker keeps its shards
        # while it finishes the job in hand and checkpoints its models, however long that takes.
        self._keeper_stop = threading.Event()
        self.watchdog = StopWatchdog(self.config.stop_grace_s, self._leaving)
        self._incarnation = 0

    def _queue(self, shard: int) -> ShardQueue:
        return ShardQueue(keys.queue_name(shard), connection=self.connection, serializer=JobSerializer)

    def _beat(self) -> None:
        if self.membership is not None:
            self.share = fair_share(len(self.wanted), self.membership.beat(), self.name)

    def take_free_shards(self) -> list[int]:
        """Take free wanted shards, up to this worker's share, and recover what their last owner left."""
        self._beat()
        taken: list[int] = []
        for shard in self.wanted:
            if len(self.fence.tokens) >= self.share:
                break
            taken += self.fence.acquire([shard])
        for shard in taken:
            queue = self._queue(shard)
            self.connection.sadd(queue.redis_queues_keys, queue.key)  # listed in the dashboard while empty
            self._recover(shard)
        if taken:
            log.info("worker %s now owns shards %s", self.name, sorted(self.fence.tokens))
        return taken

    def run(self, burst: bool = False, logging_level: str = "INFO") -> None:
        # The worker installs SIGINT/SIGTERM handlers (its own, and RQ's loop its own); an embedding process (or a
        # child it forks later) must get its own back, or SIGTERM stops being able to end it.
        if threading.current_thread() is not threading.main_thread():
            self._run(burst, logging_level)  # only the main thread gets signals: the embedder stops it
            return
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for sig in saved:
                signal.signal(sig, self._on_signal)
            self._run(burst, logging_level)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        """SIGTERM/SIGINT outside RQ's loop (standby, taking shards, waiting out an outage)."""
        self._signal(signum)
        raise StopRequested()

    def _signal(self, signum: int) -> None:
        log.warning("worker %s: got signal %d; stopping (at most %g s)", self.name, signum, self.config.stop_grace_s)
        self.watchdog.arm()
        self._stopping.set()

    def _leaving(self) -> str:
        """What a worker that stops now leaves to the next owner (no Redis call: it may be frozen)."""
        worker = self.rq_worker
        running = worker.running[0].id if worker is not None and worker.running is not None else None
        return f"worker {self.name}, shards {sorted(self.fence.tokens)}, job in hand {running}"

    def _run(self, burst: bool, logging_level: str) -> None:
        self._stopping.clear()
        self._keeper_stop.clear()
        keeper = threading.Thread(target=self._keep_leases, name="tinkerq-lease-keeper", daemon=True)
        keeper.start()
        lane = self.dispatcher.lane
        if lane is not None:
            lane.start()
        outage: Exception | None = None
        try:
            while not self._stopping.is_set():
                try:
                    if outage is not None and not self._resume_after(outage):
                        break
                    outage = None
                    if not self._serve_once(burst, logging_level):
                        break
                except REDIS_DOWN as exc:  # anywhere: taking shards, recovering, RQ's loop, the job in hand
                    outage = exc
                except StopRequested:  # a signal while the loop was outside RQ's work()
                    break
        finally:
            self._stopping.set()
            if lane is not None:  # it serves what it was handed, as RQ's loop finishes its job in hand
                lane.stop(self.config.stop_grace_s if self._signalled() or not burst else None)
            try:
                if self.draining.is_set():
                    self._make_durable()
                self._await_checkpoint()
            finally:
                self._keeper_stop.set()
                keeper.join(timeout=5)
            try:
                self.fence.release()
                if self.membership is not None:
                    self.membership.leave()
                if self.draining.is_set():
                    self.connection.delete(keys.drain_key(self.name))  # tells `tinkerq drain` it is done
            except REDIS_DOWN as exc:  # the leases lapse on their own after their TTL
                log.warning("worker %s could not release its leases (%s)", self.name, exc)

    def _await_checkpoint(self) -> None:
        """A checkpoint still being written is recorded before the leases go (its trim is fenced), for at most the
        stop's grace: one cut off leaves the journal whole, as a kill would."""
        checkpointer = self.dispatcher.training.checkpointer
        if checkpointer.writing() and not checkpointer.wait(self.config.stop_grace_s):
            log.warning("worker %s: a durable checkpoint still being written after %g s is left unrecorded",
                        self.name, self.config.stop_grace_s)

    def _make_durable(self) -> None:
        """A drain: checkpoint every model held here, so the next owner loads each instead of replaying it."""
        shards = sorted(self.fence.tokens)
        written = self.dispatcher.make_durable(shards)
        log.warning("worker %s drained: %d model(s) checkpointed; releasing shards %s", self.name, written, shards)

    def _serve_once(self, burst: bool, logging_level: str) -> bool:
        """Take free shards and consume them until the leases change (True: go on), or a stop (False)."""
        # Which leases still hold, asked before a new incarnation touches their queues: one ended by a single lost
        # shard (a refused write) may hold others that lapsed too, e.g. while the process was paused, and RQ's first
        # turn cleans the registries of every queue it is given.
        lost = self.fence.renew()
        if lost:
            log.warning("worker %s: its leases on shards %s are no longer its own", self.name, lost)
        self._release_surplus()
        self.take_free_shards()
        if not self.fence.tokens:  # standby: every wanted shard has a live owner
            if burst:
                return False
            self.preloader.warm()  # so that taking a shard over later starts no engine
            if not self.take_free_shards():  # an owner may have died while the engines started
                self._standby_wait()
            return True
        self.rq_worker = self._new_rq_worker()
        self.rq_worker.work(burst=burst, logging_level=logging_level, dequeue_strategy="round_robin")
        if self.rq_worker.outage is not None:
            raise self.rq_worker.outage
        if burst and self.dispatcher.lane is not None and not self._signalled():
            self.dispatcher.lane.wait_idle()  # a sample it failed to serve is back in its queue, to be served alone
            return self._queued() and self.rq_worker.stop_reason is None
        # a signal, or RQ gave up (its own log says why)
        return not burst and self.rq_worker.stop_reason is not None and not self._signalled()

    def _queued(self) -> bool:
        return any(queues.lengths(self.connection, [keys.queue_key(shard) for shard in sorted(self.fence.tokens)]))

    def _standby_wait(self) -> None:
        """Sleep until the first wanted lease may lapse (a dead owner's stops being renewed), at most a tick: a
        standby takes a shard within milliseconds of its lease lapsing rather than up to a tick later."""
        with self.connection.pipeline(transaction=False) as pipe:
            for shard in self.wanted:
                pipe.pttl(keys.lease_key(shard))
            left_ms = [ttl for ttl in pipe.execute() if ttl is not None and ttl >= 0]
        # a lease with no TTL (-1) or gone (-2, free but not ours to take: over our share) waits a tick
        wait_s = (min(left_ms) + STANDBY_SLACK_MS) / 1000 if left_ms else self.config.tick_s
        time.sleep(min(max(wait_s, STANDBY_SLACK_MS / 1000), self.config.tick_s))

    def _release_surplus(self) -> None:
        """Between jobs, give back the shards over this worker's share (a worker joined), each model on them
        checkpointed first so that its next owner loads it instead of replaying its journal."""
        surplus = sorted(self.fence.tokens)[self.share:]
        if surplus:
            written = self.dispatcher.make_durable(surplus)
            self.fence.release(surplus)
            log.warning("worker %s: over its share of %d shards; released %s (%d model(s) checkpointed)",
                        self.name, self.share, surplus, written)

    def _signalled(self) -> bool:
        return self.watchdog.armed

    def _resume_after(self, outage: Exception) -> bool:
        """Wait for Redis (RedisGone past `redis_outage_s`), then put back what was in flight on the shards still
        owned: the job in hand was interrupted, and a claim or a requeue may have been cut off anywhere.
        False: asked to stop meanwhile."""
        log.warning("worker %s: Redis is away (%s); waiting up to %g s for it", self.name, outage,
                    self.config.redis_outage_s)
        if not wait_for_redis(self.connection, self.config.redis_outage_s,
                              lambda: self._stopping.is_set() or self._signalled()):
            return False
        lost = self.fence.renew()
        if lost:
            log.warning("worker %s: its leases on shards %s lapsed while Redis was away", self.name, lost)
        for shard in sorted(self.fence.tokens):
            self._recover(shard)
        log.warning("worker %s: Redis is back; resuming", self.name)
        return True

    def _recover(self, shard: int) -> None:
        try:
            recover(self.connection, self._queue(shard), self.fence, self.dispatcher.results.store_result)
        except FencedOut:  # paused past the lease while recovering: the shard and its recovery are someone else's
            log.warning("worker %s lost shard %d while recovering it", self.name, shard)
            self.fence.forget([shard])

    def _new_rq_worker(self) -> ShardWorker:
        self._incarnation += 1
        worker = ShardWorker(
            [self._queue(shard) for shard in sorted(self.fence.tokens)],
            claimer=self.claimer,
            connection=FencedRedis(self.fence),
            name=f"{self.name}-{self._incarnation}",
            tick_s=self.config.tick_s,
            on_tick=self._tick,
            on_unloadable=self._on_unloadable,
            admit=self.dispatcher.admission.admit,
            context=self.dispatcher,
            on_signal=self._signal,
            log_job_description=False,
        )
        worker.push_exc_handler(self._on_job_exception)
        return worker

    def _tick(self) -> None:
        for shard in self.dispatcher.sequencer.sweep(list(self.fence.tokens)):
            if self.rq_worker is not None:
                self.rq_worker.lost_shard(shard)
            else:
                self.fence.forget([shard])

    def _on_job_exception(self, job: Job, exc_type: type[BaseException], exc_value: BaseException,
                          traceback: TracebackType | None) -> bool:
        self.dispatcher.internal_error(job, exc_type, exc_value)
        return True  # let RQ go on to mark it FAILED

    def _on_unloadable(self, job_id: str, queue: Queue, exc: Exception) -> None:
        try:
            self.claimer.done(queue.key, job_id, count=0)
        except FencedOut:
            if self.rq_worker is not None:
                self.rq_worker.lost_shard(shard_of_queue(queue.name))
            return
        if isinstance(exc, LostJob):
            error = ErrorResponse(error=str(exc), status=500, code="job_lost")
        else:
            error = ErrorResponse(error=f"the job could not be loaded: {exc}", status=400, code="invalid_job")
        self.dispatcher.results.fail(shard_of_queue(queue.name), job_id, error)

    def _keep_leases(self) -> None:
        period = self.config.lease_ttl_ms / 3000
        while not self._keeper_stop.wait(period) and not (self._stopping.is_set() and not self.draining.is_set()):
            try:
                self._keep_once()
            except REDIS_DOWN as exc:  # the main loop waits for Redis; keep trying until the lease runs out
                log.warning("lease renewal failed: Redis is away (%s)", exc)
            except Exception:  # keep trying until the lease runs out
                log.exception("lease renewal failed")

    def _keep_once(self) -> None:
        lost = self.fence.renew()
        self._beat()
        worker = self.rq_worker
        if not self.draining.is_set() and self.connection.exists(keys.drain_key(self.name)):
            log.warning("worker %s: asked to drain; finishing the job in hand", self.name)
            self.draining.set()
            self.stop()  # the loop returns after the job in hand; a running batch admits no more samples
            return
        if lost:
            log.error("worker %s lost shards %s; it stops consuming them", self.name, lost)
            if worker is not None:
                worker.stop("lost leases")
        elif worker is not None and len(self.fence.tokens) > self.share:
            worker.stop("over its share of the shards")
        elif worker is not None and len(self.fence.tokens) < self.share and self._free_wanted_shard_exists():
            worker.stop("free shards to take")
        if worker is not None:
            worker.keep_running_job_alive()

    def _free_wanted_shard_exists(self) -> bool:
        missing = [s for s in self.wanted if s not in self.fence.tokens]
        if not missing:
            return False
        return self.connection.exists(*[keys.lease_key(s) for s in missing]) < len(missing)

    def stop(self) -> None:
        self._stopping.set()
        if self.rq_worker is not None:
            self.rq_worker.stop("asked to stop")
