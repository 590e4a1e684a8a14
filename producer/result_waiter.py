"""Read results, and block until they land without a Redis loop per waiter.

One pub/sub connection per process listens on a single channel on which workers publish the id of
every request whose result they stored. Any number of local waiters on any ids share it; each
waiter re-reads the result key only when its id is announced (or, as a safety net against a dropped
pub/sub connection, every `recheck_s`).

The waiter talks to Redis on its own client, a copy of the caller's with socket timeouts: the caller's may have
none, and a frozen Redis (SIGSTOPped, or across a network partition) would then hold `wait` and `close` forever.
"""

import logging
import threading
import time

from redis import ConnectionPool, Redis, RedisError

from producer.wakeups import Backoff, Waiters
from schemas import Result, parse_result
from tinkerq import keys

log = logging.getLogger(__name__)


def get_result(connection: Redis, request_id: str) -> Result | None:
    raw = connection.get(keys.result_key(request_id))
    return None if raw is None else parse_result(raw)


def bounded_client(connection: Redis, timeout_s: float, name: str) -> Redis:
    """A client to the same server as `connection` whose every read and connect gives up after `timeout_s`."""
    pool = connection.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
              "client_name": name}
    return Redis(connection_pool=ConnectionPool(connection_class=pool.connection_class, **kwargs))


class ResultWaiter:
    def __init__(self, connection: Redis, recheck_s: float = 5.0, socket_timeout_s: float = 5.0) -> None:
        self.connection = bounded_client(connection, socket_timeout_s, "tinkerq-result-waiter")
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
        """The result, or None if it has not landed within `timeout` seconds or the waiter was closed meanwhile.
        Redis errors are retried until the deadline; if the last read failed, its error is raised (an unreachable
        Redis is not "no result yet")."""
        self._ensure_listening()
        with self._waiters.registered(request_id, threading.Event()) as event:
            deadline = time.monotonic() + timeout
            while True:
                error: RedisError | None = None
                try:  # read after registering, so a result published in between is not missed
                    result = get_result(self.connection, request_id)
                except RedisError as exc:
                    result, error = None, exc
                remaining = deadline - time.monotonic()
                if result is not None or self._closed:
                    return result
                if remaining <= 0:
                    if error is not None:
                        raise error
                    return None
                event.wait(min(remaining, self.recheck_s))
                event.clear()

    def close(self, grace_s: float = 3.0) -> None:
        """Returns within `grace_s` (plus one socket timeout for a wait mid-read) whatever Redis does: waiters
        are woken and return, and the listener, if stuck in a read, is left behind (a daemon thread)."""
        self._closed = True
        self._waiters.wake_all()
        if self._thread is not None:
            self._thread.join(timeout=grace_s)
        self.connection.connection_pool.disconnect()
