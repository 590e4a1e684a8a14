"""A model's training journal in Redis: the state-changing ops whose results were stored, in the order they ran.

Any worker can rebuild a model from it (worker/restore.py). Entries are appended only by the fenced write that
stores the op's result (Fence.put_result_journaled), so an acknowledged op is always in the journal and an op
whose result was never stored never is. Each entry is the request's own JSON (schemas' model_dump_json), with
whatever the worker chose to make it replay the same way (a create_model's LoRA seed).
"""

import json
import secrets

from redis import Redis

from schemas import (
    CreateModelRequest,
    ErrorResponse,
    ForwardBackwardRequest,
    LoadStateRequest,
    OptimStepRequest,
    Request,
    Result,
    WeightSyncOutput,
    WeightSyncRequest,
    parse_request,
)
from tinkerq import keys

# The ops that change a model's state (forward and save_state only read it).
JOURNALED = (CreateModelRequest, LoadStateRequest, ForwardBackwardRequest, OptimStepRequest, WeightSyncRequest)


class CorruptJournal(ValueError):
    """An entry that is not a request (written by something other than a worker)."""


def changes_state(request: Request, result: Result) -> bool:
    """Whether the op's result goes into the journal: a state-changing op that succeeded (a sync replayed as a
    no-op changed nothing)."""
    if not isinstance(request, JOURNALED) or isinstance(result, ErrorResponse):
        return False
    return not (isinstance(result, WeightSyncOutput) and not result.applied)


def reproducible(request: Request) -> Request:
    """The request as it will run and be journaled: a LoRA without a seed gets one, so a replay initialises the
    same adapter."""
    if isinstance(request, CreateModelRequest) and request.lora is not None and request.lora.seed is None:
        return request.model_copy(update={"lora": request.lora.model_copy(update={"seed": secrets.randbits(31)})})
    return request


class Journal:
    def __init__(self, connection: Redis) -> None:
        self.connection = connection

    @staticmethod
    def key(model_id: str) -> str:
        return keys.journal_key(model_id)

    @staticmethod
    def entry(request: Request) -> str:
        return request.model_dump_json()

    def length(self, model_id: str) -> int:
        return int(self.connection.llen(self.key(model_id)))

    def entries(self, model_id: str, start: int = 0) -> list[Request]:
        """The journaled requests from position `start` on, in order."""
        raw = self.connection.lrange(self.key(model_id), start, -1)
        out = []
        for i, item in enumerate(raw, start):
            try:
                out.append(parse_request(json.loads(item)))
            except ValueError as exc:
                raise CorruptJournal(f"entry {i} of {self.key(model_id)} is not a request: {exc}") from exc
        return out

