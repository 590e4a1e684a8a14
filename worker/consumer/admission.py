"""Is a popped job acceptable? Every job read from Redis is untrusted input.

Anyone who can write to Redis can write a job hash or push an id onto a shard queue, bypassing the
producer and its checks. So the worker judges each job it takes, on the RQ dequeue path and in the batch
look-ahead alike, before anything acts on it:

* the id: UTF-8 and matching `schemas.ids.ID_PATTERN` (else there is no request to answer: `job_id` says so);
* the envelope: `origin` is the queue it was popped from, the function is allowlisted, the arguments are one
  payload object, and the hash sets none of the RQ fields tinkerq never writes (callbacks, webhooks,
  dependencies, retries, repeats, rate limits: `rq_worker.AllowlistJob` drops them when it loads a hash and
  lists them in `ignored_fields`);
* the payload: its schema, every bound of `schemas.Limits`, and its model routing to that queue's shard.

A job refused for its envelope is RQ FAILED with `invalid_job`; one refused for its payload is a domain error
(RQ FINISHED, `invalid_request`, `limit_exceeded` or `wrong_shard`). Either way the request gets its
ErrorResponse on the shard of the queue it came from, which this worker owns.
"""

from dataclasses import dataclass

from pydantic import ValidationError
from rq.job import Job

from schemas import ErrorResponse, LimitExceeded, Limits, Request, is_request_id, parse_request
from tinkerq import keys
from tinkerq.config import QueueConfig
from tinkerq.jobs import JOB_NAMES


@dataclass(frozen=True)
class Admitted:
    request_id: str
    shard: int
    request: Request


@dataclass(frozen=True)
class Refused:
    request_id: str
    shard: int
    error: ErrorResponse
    # True: the job itself is malformed or forged (RQ FAILED); False: its payload is refused (a domain error).
    forged: bool


Verdict = Admitted | Refused


def job_id(raw: bytes | str) -> str | None:
    """The request id a queue entry names, or None if it is not one (not UTF-8, or not an id a producer makes)."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        return None
    return text if is_request_id(text) else None


class Admission:
    def __init__(self, config: QueueConfig, limits: Limits) -> None:
        self.config = config
        self.limits = limits

    def admit(self, job: Job, queue_name: str) -> Verdict:
        """Judge a loaded job popped from `queue_name` (one of this worker's shard queues), and pin what RQ will
        act on to the worker's own choices: the job's origin becomes that queue (RQ names its registries after
        the origin), and its timeout and record TTLs the worker's."""
        shard = keys.shard_of_queue(queue_name)
        stated_origin = job.origin
        job.origin = queue_name
        job.timeout = min(job.timeout, self.config.job_timeout_s) if job.timeout and job.timeout > 0 \
            else self.config.job_timeout_s
        job.result_ttl, job.failure_ttl = self.config.rq_result_ttl_s, self.config.rq_failure_ttl_s
        problem = self._envelope(job, stated_origin, queue_name)
        if problem is not None:
            return Refused(job.id, shard, ErrorResponse(error=problem, status=400, code="invalid_job"), forged=True)
        return self.judge_payload(job.id, shard, job.args[0])

    def judge_payload(self, rid: str, shard: int, payload: object) -> Verdict:
        """Judge a request payload read from Redis (a job's argument, a parked training op: worker/serving/held.py) for
        the shard it was found on: its schema, `Limits`, and its model's routing."""
        try:
            return self._payload(rid, shard, payload)
        except Exception as exc:  # noqa: BLE001 - whatever a payload does to the validators, it is refused
            return Refused(rid, shard, ErrorResponse(error=f"invalid request: {type(exc).__name__}: {exc}",
                                                     status=400, code="invalid_request"), forged=False)

    @staticmethod
    def _envelope(job: Job, origin: str, queue_name: str) -> str | None:
        """What is wrong with the job as an RQ job (None if nothing)."""
        if origin != queue_name:
            return f"the job was queued on {queue_name} but its origin says {origin!r}"
        ignored = getattr(job, "ignored_fields", ())
        if ignored:
            return f"the job sets RQ fields that tinkerq jobs never use: {', '.join(ignored)}"
        try:
            func_name, instance, args, kwargs = job.func_name, job.instance, job.args, job.kwargs
        except Exception as exc:  # noqa: BLE001 - RQ's DeserializationError, or anything the data holds
            return f"the job could not be loaded: {type(exc).__name__}: {exc}"
        if func_name not in JOB_NAMES:
            return f"function {func_name!r} is not an allowed tinkerq job function"
        if instance is not None or kwargs or not isinstance(args, (list, tuple)) or len(args) != 1 \
                or not isinstance(args[0], dict):
            return "a job takes exactly one positional argument, the request payload object"
        return None

    def _payload(self, rid: str, shard: int, payload: object) -> Verdict:
        try:
            request = parse_request(payload)
        except ValidationError as exc:
            return Refused(rid, shard, ErrorResponse(error=f"invalid request: {exc}", status=400,
                                                     code="invalid_request"), forged=False)
        try:
            self.limits.check(request)
        except LimitExceeded as exc:
            return Refused(rid, shard, ErrorResponse(error=str(exc), status=400, code="limit_exceeded"), forged=False)
        expected = keys.shard_of(request.model_id, self.config.num_shards)
        if expected != shard:
            return Refused(rid, shard, ErrorResponse(
                error=f"model {request.model_id!r} belongs to shard {expected}, but the job was on shard {shard}",
                status=400, code="wrong_shard"), forged=False)
        return Admitted(rid, shard, request)
