"""A request's one result: its JSON as its producer reads it, stored fenced with the first writer winning, and the
ErrorResponse for whatever escaped a job."""

import logging
from typing import Any

from redis import Redis

from schemas import ErrorResponse, Request, Result
from schemas.arrays import LISTS
from tinkerq import keys
from worker.shards.fencing import Fence

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


def status_of(result: Result) -> str:
    """The status a result is stored under: what a waiter reads before it decodes the result."""
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


class ResultStore:
    """Stores each request's one result under its shard's lease (worker/shards/fencing.py): a request answered
    twice, by a retry or by a new owner, keeps its first result."""

    def __init__(self, connection: Redis, fence: Fence, result_ttl_s: int) -> None:
        self.connection = connection
        self.fence = fence
        self.result_ttl_s = result_ttl_s

    def store_result(self, shard: int, request_id: str, result: Result, packed: bool = False) -> bool:
        """Store the request's one result (fenced, first writer wins); `packed`: see encoded()."""
        return self.store_results(shard, [(request_id, result)], packed)[0]

    def store_results(self, shard: int, results: list[tuple[str, Result]], packed: bool = False) -> list[bool]:
        """Store many requests' results in one round trip (the samples one engine step served), each as
        `store_result`."""
        stored = self.fence.put_results(shard, [(rid, encoded(result, packed), status_of(result))
                                                for rid, result in results], self.result_ttl_s)
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

    def state_lost(self, model_id: str, result: Result) -> Result:
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
