"""Rebuild a model this worker does not hold (or holds stale) from its journal, on first use.

A worker that takes over a shard meets models whose state lived in the dead owner's memory. Their journal
(worker/durability/journal.py) holds every op whose result was stored since the model's last durable checkpoint
(worker/durability/checkpointer.py), so loading that checkpoint (or starting from create_model when there is none) and
replaying the entries gives the same adapter, optimizer, pending gradients and weight versions: ops on the CPU in
float32 are deterministic, and create_model's LoRA seed is journaled. This worker tracks how much of each journal its
own copy reflects, so a copy that fell behind (the shard went elsewhere and came back) replays the tail, and one that
ran an op whose result it could not store (so the journal lacks it) is rebuilt from scratch.
"""

import logging
import time

from redis import Redis

from schemas import ErrorResponse
from tinkerq import keys
from worker.durability.journal import CorruptJournal, Journal
from worker.runtime import DomainError, Runtime

log = logging.getLogger(__name__)


def state_lost(model_id: str, what: str) -> ErrorResponse:
    return ErrorResponse(status=500, code="model_state_lost", error=(
        f"model {model_id!r} was created on a worker that is gone, and {what}; restore it with load_state from "
        "a saved state, or create a new model"))


class Restorer:
    def __init__(self, connection: Redis, runtime: Runtime, journal: Journal) -> None:
        self.connection = connection
        self.runtime = runtime
        self.journal = journal
        self.position: dict[str, int] = {}  # model -> journal entries this worker's copy reflects

    def ensure(self, model_id: str) -> ErrorResponse | None:
        """Bring the model up to its journal. None when it is ready (or was never created: the runtime answers
        unknown_model); model_state_lost naming what is missing when it cannot be rebuilt."""
        held = self.runtime.trainer.has_model(model_id)
        length = self.journal.length(model_id)
        mine = self.position.get(model_id)
        if held and mine == length:
            return None
        if not held and not self.connection.exists(keys.info_key(model_id)):
            return None
        if length == 0:
            if held and mine is None:
                return None  # made here before it had a journal: keep it
            return state_lost(model_id, f"its training journal ({self.journal.key(model_id)}) is gone from Redis")
        started = time.monotonic()
        try:
            self._replay(model_id, mine if held and mine is not None and mine < length else None)
        except (CorruptJournal, DomainError) as exc:
            self.runtime.forget(model_id)
            self.position.pop(model_id, None)
            log.error("model %s cannot be rebuilt: %s", model_id, exc)
            return state_lost(model_id, f"rebuilding it from its journal failed: {exc}")
        except BaseException:
            self.runtime.forget(model_id)  # half rebuilt: never serve it
            self.position.pop(model_id, None)
            raise
        log.info("model %s: rebuilt to journal entry %d in %.2f s", model_id, length - 1, time.monotonic() - started)
        return None

    def _replay(self, model_id: str, mine: int | None) -> None:
        """Replay from entry `mine` on (this worker's copy reflects those before it), or rebuild from scratch (None,
        or when `mine` lies in the part a checkpoint replaced)."""
        view = self.journal.read(model_id)
        if mine is None or mine < view.offset:
            self.runtime.forget(model_id)
            if view.checkpoint is not None:
                log.warning("model %s: loading its checkpoint %s (journal entries 0..%d)", model_id,
                            view.checkpoint.path, view.offset - 1)
                self.runtime.restore(model_id, view.checkpoint)
            mine = view.offset
        entries = view.entries[mine - view.offset:]
        raw = self.connection.hgetall(keys.snapshots_key(model_id))
        snapshots = {int(version): path.decode() for version, path in raw.items()}
        if entries:
            log.warning("model %s: replaying journal entries %d..%d", model_id, mine, mine + len(entries) - 1)
        for entry in entries:
            self.runtime.replay(entry, snapshots)
        self.position[model_id] = view.length

    def reflects(self, model_id: str, length: int) -> bool:
        """Whether this worker's copy of the model is exactly the journal's first `length` entries."""
        return bool(length) and self.position.get(model_id) == length and self.runtime.trainer.has_model(model_id)

    def current(self) -> list[tuple[str, int]]:
        """The models held here that are up to date with what this worker journaled, and their journal lengths."""
        return [(model_id, length) for model_id, length in self.position.items() if self.reflects(model_id, length)]

    def journaled(self, model_id: str, length: int) -> None:
        """The op this worker just ran is journal entry `length` - 1 (0: it was not journaled after all)."""
        if length and self.position.get(model_id, length - 1) == length - 1:
            self.position[model_id] = length
        else:  # someone else's entries came in between, or ours is missing: rebuild on next use
            self.position.pop(model_id, None)
            self.runtime.forget(model_id)

    def diverged(self, model_id: str) -> None:
        """An op changed this worker's copy but is not in the journal (it failed midway, or its write was
        refused): drop the copy, the journal rebuilds it."""
        self.position.pop(model_id, None)
        self.runtime.forget(model_id)
