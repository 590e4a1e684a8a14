"""The job contract, written once: the function name a request of each kind is enqueued under, and how a job's
data is written (JobSerializer).

Producers enqueue by these names and the worker runs only jobs that carry one of them. A name is a label, not
an import path: the worker never imports it, it hands every admitted job to its dispatcher
(`worker.consumer.rq_worker.AllowlistJob`). The names are the dotted paths the job functions once had, kept as they are
so jobs already queued in Redis under them still run after an upgrade.
"""

import json
from typing import Any

from pydantic_core import from_json
from rq.job import Job

SAMPLE = "worker.jobs.sample"
WEIGHT_SYNC = "worker.jobs.weight_sync"
TRAINING_OP = "worker.jobs.training_op"

JOB_OF_KIND: dict[str, str] = {
    "sample": SAMPLE,
    "weight_sync": WEIGHT_SYNC,
    "create_model": TRAINING_OP,
    "forward": TRAINING_OP,
    "forward_backward": TRAINING_OP,
    "optim_step": TRAINING_OP,
    "save_state": TRAINING_OP,
    "load_state": TRAINING_OP,
    "create_custom_loss": TRAINING_OP,
    "delete_checkpoint": TRAINING_OP,
}

# The only function names a worker runs.
JOB_NAMES: frozenset[str] = frozenset(JOB_OF_KIND.values())


class EncodedPayload:
    """A request payload the producer has already encoded as JSON (the canonical form its digest is taken of):
    JobSerializer writes it into the job's data as it is, instead of encoding the payload a second time."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"EncodedPayload(<{len(self.data)} bytes>)"


class JobSerializer:
    """RQ's JSON serializer (`rq.serializers.JSONSerializer`: the data is JSON, which it, rq-dashboard and every
    earlier worker read), except that a job whose one argument is an EncodedPayload has those bytes spliced in,
    and that it reads JSON faster."""

    @staticmethod
    def dumps(obj: Any, *args: Any, **kwargs: Any) -> bytes:
        if (isinstance(obj, tuple) and len(obj) == 4 and isinstance(obj[2], (tuple, list)) and len(obj[2]) == 1
                and isinstance(obj[2][0], EncodedPayload) and not args and not kwargs):
            func_name, instance, (payload,), job_kwargs = obj
            return b"".join([b"[", json.dumps(func_name).encode(), b", ", json.dumps(instance).encode(), b", [",
                             payload.data, b"], ", json.dumps(job_kwargs).encode(), b"]"])
        return json.dumps(obj, *args, **kwargs).encode()

    @staticmethod
    def loads(data: bytes, *args: Any, **kwargs: Any) -> Any:
        """What json.loads gives, read by pydantic's Rust parser (faster than json's own on a large payload). It
        parses every float, integer and duplicate key alike; what it refuses (a lone surrogate escape, nesting past
        its limit, malformed JSON) json reads, or refuses, as before."""
        if isinstance(data, bytes) and not args and not kwargs:
            try:
                return from_json(data)
            except ValueError:
                pass
        return json.loads(data.decode(), *args, **kwargs)


class QueuedJob(Job):
    """RQ's Job, its data stored as it is, not zlib-compressed: a large payload is mostly packed arrays' base64
    (schemas/arrays.py), which zlib shrinks little, at a CPU cost paid on every enqueue. RQ's readers (Job.restore,
    rq-dashboard) take data that does not inflate as it is, and a JSON array never inflates; data compressed by
    earlier producers is still read (RQ inflates it) and written back plain."""

    def to_dict(self, include_meta: bool = True, include_result: bool = True) -> dict:
        data = self.data  # encoded here if it was not yet
        self._data = b""  # RQ's to_dict compresses `data` at zlib's default level: it gets nothing to compress
        try:
            obj = super().to_dict(include_meta=include_meta, include_result=include_result)
        finally:
            self._data = data
        obj["data"] = data
        return obj
