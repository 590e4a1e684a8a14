"""Long-polling without a Redis loop per poller: one pub/sub listener task per API process."""

import asyncio
import contextlib
import logging

from redis.asyncio import Redis

from producer.wakeups import Backoff, Waiters
from tinkerq import keys

log = logging.getLogger(__name__)


class AsyncResultWaiter:
    def __init__(self, redis: Redis, poll_s: float = 1.0) -> None:
        self.redis = redis
        self.poll_s = poll_s
        self._waiters: Waiters[asyncio.Event] = Waiters()
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._released = asyncio.Event()

    async def start(self) -> None:
        self._stopping.clear()
        self._task = asyncio.create_task(self._listen())

    def release(self) -> None:
        """The server is stopping: every pending poll, and every later one, answers None at once whatever Redis
        does, so that the server's wait for open requests ends now rather than after a long poll."""
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    async def stop(self, grace_s: float = 2.0) -> None:
        """Ends the listener within `grace_s` whatever Redis does (frozen, gone, mid-reconnect). The task is
        cancelled, and also told to stop at its next poll, and neither is waited for beyond the grace period:
        a cancellation swallowed inside a client read must not hold SIGTERM up."""
        self.release()
        if self._task is None:
            return
        self._stopping.set()
        self._task.cancel()
        await asyncio.wait({self._task}, timeout=grace_s)
        if not self._task.done():
            log.warning("result listener did not stop within %.0f s; leaving it behind", grace_s)

    async def _listen(self) -> None:
        backoff = Backoff()
        while not self._stopping.is_set():
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(keys.DONE_CHANNEL)
                    backoff.connected()
                    self._waiters.wake_all()  # whatever landed while we were (re)connecting
                    while not self._stopping.is_set():
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.poll_s)
                        if message is not None and message["type"] == "message":
                            self._waiters.wake(message["data"].decode())
            except Exception as exc:  # noqa: BLE001 - reconnect on any connection trouble
                if not backoff.failing:
                    log.warning("result listener lost Redis (%s); reconnecting", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), backoff.failed())

    async def wait(self, request_id: str, timeout: float) -> bytes | None:
        """The stored result JSON, or None if it has not landed within `timeout` seconds or the waiter is released.
        A poll blocked on a frozen Redis when that happens is cancelled, not waited for."""
        polling = asyncio.ensure_future(self._poll(request_id, timeout))
        released = asyncio.ensure_future(self._released.wait())
        try:
            done, _ = await asyncio.wait({polling, released}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            polling.cancel()
            released.cancel()
        return polling.result() if polling in done else None

    async def _poll(self, request_id: str, timeout: float) -> bytes | None:
        with self._waiters.registered(request_id, asyncio.Event()) as event:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                raw = await self.redis.get(keys.result_key(request_id))  # after registering: nothing is missed
                remaining = deadline - loop.time()
                if raw is not None or remaining <= 0:
                    return raw
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), min(remaining, 5.0))
                event.clear()
