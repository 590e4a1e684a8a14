"""What a worker holds in memory: a trainer and a sampling engine, glued by `Runtime` (versioned.py: the snapshot
and version rules every request is served under)."""

from worker.runtime.base import DomainError, DurableCheckpoint, Engine, PendingCheckpoint, Trainer
from worker.runtime.versioned import Runtime

__all__ = ["DomainError", "DurableCheckpoint", "Engine", "PendingCheckpoint", "Runtime", "Trainer"]
