"""Read results, and block until they land without a Redis loop per waiter.

One pub/sub connection per process listens on a single channel on which workers publish the id of
every request whose result they stored. Any number of local waiters on any ids share it; each
waiter re-reads the result key only when its id is announced (or, as a safety net against a dropped
pub/sub connection, every `recheck_s`).
"""

import logging
import threading
import time
from collections import defaultdict

from redis import Redis

from schemas import Result, parse_result
from tinkerq import keys

log = logging.getLogger(__name__)


def get_result(connection: Redis, request_id: str) -> Result | None:
    raw = connection.get(keys.result_key(request_id))
    return None if raw is None else parse_result(raw)


class ResultWaiter:
    def __init__(self, connection: Redis, recheck_s: float = 5.0) -> None:
        self.connection = connection
        self.recheck_s = recheck_s
        self._lock = threading.Lock()
        self._events: dict[str, list[threading.Event]] = defaultdict(list)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._closed = False

    def _ensure_listening(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._listen, name="tinkerq-result-waiter", daemon=True)
                self._thread.start()
        self._ready.wait(timeout=5)

    def _listen(self) -> None:
        backoff = 0.0
        while not self._closed:
            pubsub = self.connection.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(keys.DONE_CHANNEL)
                if backoff:
                    log.warning("result waiter reconnected")
                backoff = 0.0
                self._ready.set()
                self._wake_all()  # anything that landed while we were (re)connecting
                while not self._closed:
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._wake(message["data"].decode())
            except Exception as exc:  # noqa: BLE001 - reconnect on any connection trouble
                if self._closed:
                    return
                if not backoff:
                    log.warning("result waiter lost its pub/sub connection (%s); reconnecting", exc)
                backoff = min(max(2 * backoff, 0.25), 5.0)
                time.sleep(backoff)
            finally:
                pubsub.close()

    def _wake(self, request_id: str) -> None:
        with self._lock:
            for event in self._events.get(request_id, ()):
                event.set()

    def _wake_all(self) -> None:
        with self._lock:
            for events in self._events.values():
                for event in events:
                    event.set()

    def wait(self, request_id: str, timeout: float) -> Result | None:
        """The result, or None if it has not landed within `timeout` seconds."""
        self._ensure_listening()
        event = threading.Event()
        with self._lock:
            self._events[request_id].append(event)
        try:
            deadline = time.monotonic() + timeout
            while True:
                # Read after registering, so a result published in between is not missed.
                result = get_result(self.connection, request_id)
                remaining = deadline - time.monotonic()
                if result is not None or remaining <= 0:
                    return result
                event.wait(min(remaining, self.recheck_s))
                event.clear()
        finally:
            with self._lock:
                self._events[request_id].remove(event)
                if not self._events[request_id]:
                    del self._events[request_id]

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=3)
