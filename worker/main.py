"""The worker process: load the runtime once, own shards through leases, consume them in order."""

import logging
import os
import secrets
import signal
import socket
import threading
import time

from redis import Redis
from rq import Queue

from schemas import ErrorResponse, Limits
from tinkerq import keys
from tinkerq.config import QueueConfig
from tinkerq.keys import shard_of_queue
from worker.dispatcher import Dispatcher
from worker.fencing import Fence
from worker.recovery import recover
from worker.rq_worker import LostJob, ShardQueue, ShardWorker
from worker.runtime import Runtime

log = logging.getLogger(__name__)


class WorkerProcess:
    def __init__(
        self,
        connection: Redis,
        runtime: Runtime,
        config: QueueConfig | None = None,
        shards: list[int] | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.connection = connection
        self.config = config or QueueConfig()
        keys.check_num_shards(connection, self.config.num_shards)
        self.wanted = sorted(set(shards)) if shards is not None else list(range(self.config.num_shards))
        if any(not 0 <= s < self.config.num_shards for s in self.wanted):
            raise ValueError(f"shards must lie in [0, {self.config.num_shards}); got {self.wanted}")
        self.name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        self.fence = Fence(connection, self.name, self.config.lease_ttl_ms)
        self.dispatcher = Dispatcher(connection, runtime, self.fence, self.config, limits)
        self.rq_worker: ShardWorker | None = None
        self._stopping = threading.Event()
        self._incarnation = 0

    def _queue(self, shard: int) -> ShardQueue:
        return ShardQueue(keys.queue_name(shard), connection=self.connection, serializer="json")

    def take_free_shards(self) -> list[int]:
        taken = self.fence.acquire(self.wanted)
        for shard in taken:
            queue = self._queue(shard)
            self.connection.sadd(queue.redis_queues_keys, queue.key)  # listed in the dashboard while empty
            recover(self.connection, queue)
        if taken:
            log.info("worker %s now owns shards %s", self.name, sorted(self.fence.tokens))
        return taken

    def run(self, burst: bool = False, logging_level: str = "INFO") -> None:
        # RQ installs SIGINT/SIGTERM handlers and never removes them; an embedding process (or a
        # child it forks later) must get its own back, or SIGTERM stops being able to end it.
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._run(burst, logging_level)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    def _run(self, burst: bool, logging_level: str) -> None:
        self._stopping.clear()
        keeper = threading.Thread(target=self._keep_leases, name="tinkerq-lease-keeper", daemon=True)
        keeper.start()
        try:
            while not self._stopping.is_set():
                self.take_free_shards()
                if not self.fence.tokens:
                    if burst:
                        return
                    time.sleep(self.config.tick_s)  # standby: every wanted shard has a live owner
                    continue
                self.rq_worker = self._new_rq_worker()
                self.rq_worker.work(burst=burst, logging_level=logging_level, dequeue_strategy="round_robin")
                if burst or self.rq_worker.stop_reason is None:
                    break  # a signal, or RQ gave up (its own log says why)
        finally:
            self._stopping.set()
            keeper.join(timeout=5)
            self.fence.release()

    def _new_rq_worker(self) -> ShardWorker:
        self._incarnation += 1
        worker = ShardWorker(
            [self._queue(shard) for shard in sorted(self.fence.tokens)],
            connection=self.connection,
            name=f"{self.name}-{self._incarnation}",
            tick_s=self.config.tick_s,
            on_tick=self._tick,
            on_unloadable=self._on_unloadable,
            admit=self.dispatcher.admission.admit,
            context=self.dispatcher,
            log_job_description=False,
        )
        worker.push_exc_handler(self._on_job_exception)
        return worker

    def _tick(self) -> None:
        for shard in list(self.fence.tokens):
            self.dispatcher.sequencer.sweep(shard)

    def _on_job_exception(self, job, exc_type, exc_value, traceback) -> bool:
        self.dispatcher.internal_error(job, exc_type, exc_value)
        return True  # let RQ go on to mark it FAILED

    def _on_unloadable(self, job_id: str, queue: Queue, exc: Exception) -> None:
        self.connection.lrem(queue.intermediate_queue_key, 0, job_id)
        if isinstance(exc, LostJob):
            error = ErrorResponse(error=str(exc), status=500, code="job_lost")
        else:
            error = ErrorResponse(error=f"the job could not be loaded: {exc}", status=400, code="invalid_job")
        self.dispatcher.fail(shard_of_queue(queue.name), job_id, error)

    def _keep_leases(self) -> None:
        period = self.config.lease_ttl_ms / 3000
        while not self._stopping.wait(period):
            try:
                self._keep_once()
            except Exception:  # noqa: BLE001 - Redis hiccups: keep trying until the lease runs out
                log.exception("lease renewal failed")

    def _keep_once(self) -> None:
        lost = self.fence.renew()
        worker = self.rq_worker
        if lost:
            log.error("worker %s lost shards %s; it stops consuming them", self.name, lost)
            if worker is not None:
                worker.stop("lost leases")
        elif worker is not None and self._free_wanted_shard_exists():
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
