"""Read results, and block until they land without a Redis loop per waiter.

One pub/sub connection per process listens on a single channel on which workers publish the id of
every request whose result they stored. Any number of local waiters on any ids share it; each
waiter re-reads the result key only when its id is announced (or, as a safety net against a dropped
pub/sub connection, every `recheck_s`).
"""

import logging
import threading
import time

from redis import Redis

from producer.waiting import Backoff, Waiters
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
        self._waiters: Waiters[threading.Event] = Waiters()
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
        backoff = Backoff()
        while not self._closed:
            pubsub = self.connection.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(keys.DONE_CHANNEL)
                if backoff.failing:
                    log.warning("result waiter reconnected")
                backoff.connected()
                self._ready.set()
                self._waiters.wake_all()  # anything that landed while we were (re)connecting
                while not self._closed:
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._waiters.wake(message["data"].decode())
            except Exception as exc:  # noqa: BLE001 - reconnect on any connection trouble
                if self._closed:
                    return
                if not backoff.failing:
                    log.warning("result waiter lost its pub/sub connection (%s); reconnecting", exc)
                time.sleep(backoff.failed())
            finally:
                pubsub.close()

    def wait(self, request_id: str, timeout: float) -> Result | None:
        """The result, or None if it has not landed within `timeout` seconds."""
        self._ensure_listening()
        with self._waiters.registered(request_id, threading.Event()) as event:
            deadline = time.monotonic() + timeout
            while True:
                # Read after registering, so a result published in between is not missed.
                result = get_result(self.connection, request_id)
                remaining = deadline - time.monotonic()
                if result is not None or remaining <= 0:
                    return result
                event.wait(min(remaining, self.recheck_s))
                event.clear()

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=3)
