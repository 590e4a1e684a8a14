"""Periodic durable checkpoints: they bound a takeover's replay and the journal's size.

Every `every` optim_steps of a model (TINKERQ_DURABLE_EVERY; 0: never), once the step's result and journal entry
are stored, its owner captures the model's whole state (adapter, AdamW state, LoRA config, pending gradients, each
live snapshot's weights, the versions it synced and the archives of the persisted ones) and writes it to the
checkpoint root that every worker reads (the trainer writes it under a temp name and renames it), then records it as
the journal's base and drops the entries it covers, in one fenced script (Fence.trim_journal). A restore loads it
and replays what follows (worker/durability/restore.py). A checkpoint that fails to write changes nothing: the journal
keeps its entries and the next step tries again.

Asynchronous (TINKERQ_DURABLE_ASYNC, the default, where the trainer can copy its state aside): the step copies the
tensors to host memory (Runtime.capture) and returns; a side thread writes the file and only then trims the journal,
so until the file is complete and recorded the journal still holds every entry it covers and any result already
published stays recoverable. A worker killed mid-write leaves the old checkpoint and the whole journal (the new
file at most half written under a temp name, or complete but unrecorded); one killed after the trim, the new
checkpoint and the trimmed journal. One write is in flight at a time: a checkpoint due meanwhile waits for it.
"""

import logging
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from worker.durability.journal import Journal
from worker.runtime import DurableCheckpoint, PendingCheckpoint, Runtime
from worker.shards.fencing import Fence, FencedOut

log = logging.getLogger(__name__)


@dataclass
class _Write:
    """The checkpoint being written on the side thread."""

    thread: threading.Thread
    model_id: str
    steps: int  # the optim_steps since the previous checkpoint that it covers


class Checkpointer:
    def __init__(self, runtime: Runtime, fence: Fence, journal: Journal, every: int, background: bool = True) -> None:
        self.runtime = runtime
        self.fence = fence
        self.journal = journal
        self.every = every
        self.background = background
        self._writing: _Write | None = None

    def stepped(self, shard: int, model_id: str, length: int) -> None:
        """An optim_step of the model was just journaled as entry `length` - 1 (0: it was not)."""
        if not self.every or not length:
            return
        steps = self.journal.steps_since_checkpoint(model_id)
        writing = self._writing
        if writing is not None and writing.thread.is_alive() and writing.model_id == model_id:
            steps -= writing.steps  # covered by the checkpoint being written: not due again because of them
        if steps >= self.every:
            self.checkpoint(shard, model_id, length, background=self.background)

    def writing(self) -> bool:
        return self._writing is not None and self._writing.thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the write in flight, if any (at most `timeout_s`); False if it is still running."""
        writing = self._writing
        if writing is not None:
            writing.thread.join(timeout_s)
            if writing.thread.is_alive():
                return False
        return True

    def checkpoint(self, shard: int, model_id: str, length: int, background: bool = False) -> DurableCheckpoint | None:
        """Make the model durable as of journal entry `length` - 1 (this worker's copy must reflect exactly those
        entries); the checkpoint recorded, or None when none was (logged) or, `background`, while it is written."""
        self.wait()  # one at a time: one copy in host memory, and each trim knows the steps it covers
        previous = self.journal.checkpoint(model_id)
        if previous is not None and self.journal.length(model_id) == length and not self.journal.listed(model_id):
            return previous  # durable as it is already
        steps = self.journal.steps_since_checkpoint(model_id)
        try:
            pending = self.runtime.capture(model_id)
        except Exception:  # a failed copy must not fail the step, whose result is stored
            log.exception("model %s: durable checkpoint failed; its journal keeps every entry", model_id)
            return None
        if pending is None:
            return None
        # a name of its own: a paused former owner writing the same position must not replace (nor, refused,
        # delete) the file its successor recorded
        name = f"j{length}-{secrets.token_hex(4)}"
        args = (shard, model_id, length, steps, pending, name, previous)
        if not (background and pending.off_thread):
            return self._write(*args)
        thread = threading.Thread(target=self._write, args=args, name="tinkerq-checkpoint", daemon=True)
        self._writing = _Write(thread, model_id, steps)
        thread.start()
        return None

    def _write(self, shard: int, model_id: str, length: int, steps: int, pending: PendingCheckpoint, name: str,
               previous: DurableCheckpoint | None) -> DurableCheckpoint | None:
        """Write the captured state, then record it and trim the journal (never before the file is whole)."""
        try:
            made = pending.write(name)
        except Exception:  # a disk full or a bad path: the journal keeps every entry
            log.exception("model %s: durable checkpoint failed; its journal keeps every entry", model_id)
            return None
        if made is None:
            return None
        try:
            recorded = self.fence.trim_journal(shard, self.journal.key(model_id), self.journal.base_key(model_id),
                                               length, made.model_dump_json(), steps)
        except FencedOut:
            recorded = False
        except Exception:  # on the side thread, Redis gone for good: recorded or not, unknown
            log.exception("model %s: checkpoint at entry %d may not be recorded; its file %s is kept", model_id,
                          length, made.path)
            return None  # a file too many costs disk; deleting one that was recorded loses the model
        if not recorded:  # a later checkpoint was recorded first, or the shard moved: this file describes nothing
            log.warning("model %s: checkpoint at entry %d not recorded; dropping it", model_id, length)
            _remove(made.path)
            return None
        if previous is not None and previous.path != made.path:
            _remove(previous.path)  # recorded no more: nothing restores from it
        log.info("model %s: durable checkpoint at journal entry %d recorded", model_id, length - 1)
        return made


def _remove(path: str) -> None:
    try:
        Path(path).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
