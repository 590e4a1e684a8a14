"""A model's training journal in Redis: the state-changing ops whose results were stored, in the order they ran.

Any worker can rebuild a model from it (worker/durability/restore.py). Entries are appended only by the fenced write
that stores the op's result (Fence.put_result_journaled), so an acknowledged op is always in the journal and an op
whose result was never stored never is. Each entry is the request's own JSON (schemas' model_dump_json), with
whatever the worker chose to make it replay the same way (a create_model's LoRA seed).

A durable checkpoint (worker/durability/checkpointer.py) replaces the entries before it: the journal's base records how
many were trimmed and the checkpoint that holds their effect, so positions count from the model's first entry ever and a
rebuild loads the checkpoint, then replays what follows.
"""

import json
import secrets
from dataclasses import dataclass

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
from worker.runtime import DurableCheckpoint

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


@dataclass(frozen=True)
class JournalView:
    """The journal read in one step: the checkpoint its entries follow (None: they start at create_model)."""

    offset: int  # entries trimmed from the head: the first entry here is entry `offset`
    checkpoint: DurableCheckpoint | None
    entries: list[Request]

    @property
    def length(self) -> int:
        return self.offset + len(self.entries)


class Journal:
    def __init__(self, connection: Redis) -> None:
        self.connection = connection

    @staticmethod
    def key(model_id: str) -> str:
        return keys.journal_key(model_id)

    @staticmethod
    def base_key(model_id: str) -> str:
        return keys.journal_base_key(model_id)

    @staticmethod
    def entry(request: Request) -> str:
        return request.model_dump_json()

    def length(self, model_id: str) -> int:
        """Entries ever journaled (the trimmed ones too), in one round trip."""
        with self.connection.pipeline() as pipe:  # MULTI: the offset and the list as one state
            pipe.hget(self.base_key(model_id), "offset")
            pipe.llen(self.key(model_id))
            offset, listed = pipe.execute()
        return int(offset or 0) + int(listed)

    def listed(self, model_id: str) -> int:
        """Entries kept in Redis (those after the checkpoint)."""
        return int(self.connection.llen(self.key(model_id)))

    def steps_since_checkpoint(self, model_id: str) -> int:
        return int(self.connection.hget(self.base_key(model_id), "steps") or 0)

    def checkpoint(self, model_id: str) -> DurableCheckpoint | None:
        raw = self.connection.hget(self.base_key(model_id), "json")
        return None if raw is None else self._record(model_id, raw)

    def read(self, model_id: str) -> JournalView:
        with self.connection.pipeline() as pipe:
            pipe.hmget(self.base_key(model_id), "offset", "json")
            pipe.lrange(self.key(model_id), 0, -1)
            (offset, record), raw = pipe.execute()
        offset = int(offset or 0)
        checkpoint = None if record is None else self._record(model_id, record)
        if offset and checkpoint is None:
            raise CorruptJournal(f"{self.base_key(model_id)} trimmed {offset} entries but names no checkpoint")
        out = []
        for i, item in enumerate(raw, offset):
            try:
                out.append(parse_request(json.loads(item)))
            except ValueError as exc:
                raise CorruptJournal(f"entry {i} of {self.key(model_id)} is not a request: {exc}") from exc
        return JournalView(offset, checkpoint, out)

    def entries(self, model_id: str) -> list[Request]:
        """The journaled requests kept in Redis, in order."""
        return self.read(model_id).entries

    def _record(self, model_id: str, raw: bytes) -> DurableCheckpoint:
        try:
            return DurableCheckpoint.model_validate_json(raw)
        except ValueError as exc:
            raise CorruptJournal(f"the checkpoint record in {self.base_key(model_id)} is unreadable: {exc}") from exc
