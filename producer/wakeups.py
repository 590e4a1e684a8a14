"""Which local waiters to wake when a result is announced, and when the listener retries: what the two result
waiters share, without I/O: `producer.result_waiter.ResultWaiter` (threads, for the library) and
`producer.api.long_poll.AsyncResultWaiter` (asyncio, for the API). Each listens on `keys.DONE_CHANNEL` and wakes the
local waiters of an announced id; after a reconnect it wakes them all (what landed meanwhile was not announced to
it), and each waiter reads its result after registering, so a result published in between is not missed."""

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar


class Settable(Protocol):
    def set(self) -> None: ...


E = TypeVar("E", bound=Settable)


class Waiters(Generic[E]):
    """The events of the local waiters, by request id. The lock is for the threaded waiter, whose listener runs
    in its own thread; the asyncio one never holds it across an await."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, list[E]] = defaultdict(list)

    @contextmanager
    def registered(self, request_id: str, event: E) -> Iterator[E]:
        """`event` is set whenever `request_id` is announced (or all are woken) while the block runs."""
        with self._lock:
            self._events[request_id].append(event)
        try:
            yield event
        finally:
            with self._lock:
                self._events[request_id].remove(event)
                if not self._events[request_id]:
                    del self._events[request_id]

    def wake(self, request_id: str) -> None:
        with self._lock:
            for event in self._events.get(request_id, ()):
                event.set()

    def wake_all(self) -> None:
        with self._lock:
            for events in self._events.values():
                for event in events:
                    event.set()


class Backoff:
    """The listener's reconnect delays: 0.25 s, doubling up to 5 s, from the first failure until it connects."""

    FIRST_S = 0.25
    MAX_S = 5.0

    def __init__(self) -> None:
        self.delay = 0.0

    @property
    def failing(self) -> bool:
        """Whether the last attempt failed (the first failure is the one worth logging)."""
        return self.delay > 0

    def failed(self) -> float:
        """The delay before the next attempt."""
        self.delay = min(max(2 * self.delay, self.FIRST_S), self.MAX_S)
        return self.delay

    def connected(self) -> None:
        self.delay = 0.0
