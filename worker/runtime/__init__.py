"""What a worker holds in memory: a trainer and a sampling engine, glued by `Runtime`."""

from worker.runtime.base import DomainError, DurableCheckpoint, Engine, PendingCheckpoint, Trainer
from worker.runtime.runtime import Runtime

__all__ = ["DomainError", "DurableCheckpoint", "Engine", "PendingCheckpoint", "Runtime", "Trainer"]
