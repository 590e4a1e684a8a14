"""What crosses the actor boundary when a call fails: a DomainError as plain data (Ray re-raises exceptions
as its own wrappers, which must not turn a user's mistake into an infrastructure fault), and a replica's
"I am not the incarnation you synced" answer."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from worker.runtime.base import DomainError

T = TypeVar("T")


@dataclass(frozen=True)
class Failed:
    status: int
    code: str
    message: str
    retryable: bool

    def error(self) -> DomainError:
        return DomainError(self.status, self.code, self.message, self.retryable)


def guarded(call: Callable[[], T]) -> T | Failed:
    """The call's value, or its DomainError as a Failed."""
    try:
        return call()
    except DomainError as exc:
        return Failed(exc.status, exc.code, str(exc), exc.retryable)


def unwrap(value: T | Failed) -> T:
    """The value, or the DomainError it carries, raised here."""
    if isinstance(value, Failed):
        raise value.error()
    return value


class Stale(Exception):
    """A replica asked to act on state it does not hold: it was restarted since it was last synced."""
