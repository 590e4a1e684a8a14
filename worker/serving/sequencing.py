"""Run each model's training ops in seq_id order, holding ops that arrive early.

The Tinker client posts the first chunk of a large forward_backward last, so op n+1 may be
dequeued before op n. An early op is parked in Redis (payload and a deadline) and finishes as a
no-op RQ job; when its predecessor has run, the worker runs it. One that waits past its deadline
gets an ErrorResponse, and the model's sequence moves past it so later ops are not wedged.
"""

import logging
import time
from collections.abc import Callable

from redis import Redis

from schemas import ErrorResponse, Request
from tinkerq import keys
from worker.consumer.admission import Admission, Refused
from worker.serving.held import HeldOps
from worker.shards.fencing import Fence, FencedOut

log = logging.getLogger(__name__)

Execute = Callable[[int, str, Request], None]
StoreResult = Callable[[int, str, ErrorResponse], None]


def _creates_model(request: Request) -> bool:
    # Tinker's create-via-load sends load_weights without a seq_id: it is the model's seq 0.
    return request.kind == "create_model" or (request.kind == "load_state" and request.seq_id is None)


class Sequencer:
    def __init__(self, connection: Redis, fence: Fence, gap_timeout_s: float, execute: Execute,
                 store_result: StoreResult, admission: Admission) -> None:
        self.connection = connection
        self.fence = fence
        self.gap_timeout_s = gap_timeout_s
        self.execute = execute
        self.store_result = store_result
        self.held = HeldOps(connection, fence, admission)

    def last_seq(self, model_id: str) -> int:
        """The last seq_id that took its turn: run here, or refused by the API at submit (it never reached the
        queue, but the client counted it, so later ops must not wait for it)."""
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.get(keys.last_seq_key(model_id))
            pipe.smembers(keys.refused_seqs_key(model_id))
            last, refused = pipe.execute()
        last = int(last or 0)
        skipped = {int(s) for s in refused}
        while last + 1 in skipped:
            last += 1
        return last

    def submit(self, shard: int, rid: str, request: Request) -> str:
        """Run the op now, or hold it. Returns what happened: "ran", "held" or "rejected"."""
        model_id, seq_id = request.model_id, request.seq_id
        if _creates_model(request):
            self.execute(shard, rid, request)
            self.fence.set_counter(shard, keys.last_seq_key(model_id), seq_id or 0, only_up=False)
            self.drain(shard, model_id)
            return "ran"
        if seq_id is None:
            self.execute(shard, rid, request)
            return "ran"
        last = self.last_seq(model_id)
        if seq_id <= last:
            self.store_result(shard, rid, _stale(model_id, seq_id, last))
            return "rejected"
        if seq_id > last + 1:
            self.held.hold(shard, rid, request, time.time() + self.gap_timeout_s)
            return "held"
        self._run_in_order(shard, rid, request)
        self.drain(shard, model_id)
        return "ran"

    def _run_in_order(self, shard: int, rid: str, request: Request) -> None:
        try:
            self.execute(shard, rid, request)
        finally:  # an op that failed still took its turn: later ops must not wait for it
            self.fence.set_counter(shard, keys.last_seq_key(request.model_id), request.seq_id)

    def drain(self, shard: int, model_id: str) -> None:
        """Run parked ops of the model while the next one in sequence is there."""
        while True:
            head = self.held.first(shard, model_id)
            if head is None:
                return
            rid, seq_id = head
            last = self.last_seq(model_id)
            if seq_id > last + 1:
                return
            verdict = self.held.take(shard, rid, model_id)
            if verdict is None:
                continue
            if isinstance(verdict, Refused):  # not the op it was parked as: someone wrote it there
                self.store_result(shard, rid, verdict.error)
                continue
            request = verdict.request
            if request.seq_id <= last:
                self.store_result(shard, rid, _stale(model_id, request.seq_id, last))
                continue
            try:
                self._run_in_order(shard, rid, request)
            except Exception as exc:
                if type(exc).__name__ == "JobTimeoutException" or isinstance(exc, FencedOut):
                    raise  # the job in hand ran out of time, or the shard is no longer ours: stop here
                log.exception("parked op %s failed; its error result is stored", rid)

    def sweep(self, shards: list[int]) -> list[int]:
        """On each shard, run parked ops whose gap a refusal at submit closed, answer those whose gap did not fill in
        time, and let their models move on; the shards found to be someone else's now (a fenced write refused)."""
        lost = []
        for shard, members in self.held.deadlines(shards).items():
            try:
                self._sweep(shard, self.held.named(shard, members))
            except FencedOut:  # woken after a takeover: the parked ops are the new owner's
                lost.append(shard)
        return lost

    def _sweep(self, shard: int, held: list[tuple[str, str, float]]) -> None:
        for model_id in dict.fromkeys(model_id for _, model_id, _ in held):
            self.drain(shard, model_id)
        now = time.time()
        for rid, model_id, _ in (each for each in held if each[2] <= now):  # an op drained just now is taken: None
            verdict = self.held.take(shard, rid, model_id)
            self.held.forget_deadline(shard, rid, model_id)
            if verdict is None:
                continue
            if isinstance(verdict, Refused):
                self.store_result(shard, rid, verdict.error)
                continue
            seq_id, expected = verdict.request.seq_id, self.last_seq(model_id) + 1
            self.store_result(shard, rid, ErrorResponse(
                error=f"seq_id {seq_id} of model {model_id!r} waited {self.gap_timeout_s:g}s "
                f"for seq_id {expected}, which never arrived",
                status=408, code="seq_gap_timeout", retryable=False,
            ))
            self.fence.set_counter(shard, keys.last_seq_key(model_id), seq_id)
            self.drain(shard, model_id)


def _stale(model_id: str, seq_id: int, last: int) -> ErrorResponse:
    return ErrorResponse(
        error=f"seq_id {seq_id} of model {model_id!r} comes after seq_id {last} already ran; "
        "it cannot run out of order",
        status=409, code="stale_seq_id",
    )
