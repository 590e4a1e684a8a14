"""Periodic durable checkpoints: they bound a takeover's replay and the journal's size.

Every `every` optim_steps of a model (TINKERQ_DURABLE_EVERY; 0: never), once the step's result and journal entry
are stored, its owner writes the model's whole state (adapter, AdamW state, LoRA config, pending gradients, each
live snapshot's weights, the versions it synced and the archives of the persisted ones) to the checkpoint root
that every worker reads (the trainer writes it under a temp name and renames it), then records it as the journal's
base and drops the entries it covers, in one fenced script (Fence.trim_journal). A restore loads it and replays
what follows (worker/restore.py). A checkpoint that fails to write changes nothing: the journal keeps its entries
and the next step tries again.
"""

import logging
from pathlib import Path

from worker.fencing import Fence, FencedOut
from worker.journal import Journal
from worker.runtime import DurableCheckpoint, Runtime

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, runtime: Runtime, fence: Fence, journal: Journal, every: int) -> None:
        self.runtime = runtime
        self.fence = fence
        self.journal = journal
        self.every = every

    def stepped(self, shard: int, model_id: str, length: int) -> None:
        """An optim_step of the model was just journaled as entry `length` - 1 (0: it was not)."""
        if self.every and length and self.journal.steps_since_checkpoint(model_id) >= self.every:
            self.checkpoint(shard, model_id, length)

    def checkpoint(self, shard: int, model_id: str, length: int) -> DurableCheckpoint | None:
        """Make the model durable as of journal entry `length` - 1 (this worker's copy must reflect exactly those
        entries); the checkpoint recorded, or None when none was (logged)."""
        previous = self.journal.checkpoint(model_id)
        if previous is not None and self.journal.length(model_id) == length and not self.journal.listed(model_id):
            return previous  # durable as it is already
        try:
            made = self.runtime.checkpoint(model_id, f"j{length}")
        except Exception:  # noqa: BLE001 - a disk full or a bad path must not fail the step, whose result is stored
            log.exception("model %s: durable checkpoint failed; its journal keeps every entry", model_id)
            return None
        if made is None:
            return None
        try:
            recorded = self.fence.trim_journal(shard, self.journal.key(model_id), self.journal.base_key(model_id),
                                               length, made.model_dump_json())
        except FencedOut:
            recorded = False
        if not recorded:  # the journal moved on (or the shard did): this file describes no recorded state
            log.warning("model %s: checkpoint at entry %d not recorded; dropping it", model_id, length)
            _remove(made.path)
            return None
        if previous is not None and previous.path != made.path:
            _remove(previous.path)  # recorded no more: nothing restores from it
        return made


def _remove(path: str) -> None:
    try:
        Path(path).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
