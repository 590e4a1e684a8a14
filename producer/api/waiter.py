"""Long-polling without a Redis loop per poller: one pub/sub listener task per API process."""

import asyncio
import contextlib
import logging
from collections import defaultdict

from redis.asyncio import Redis

from tinkerq import keys

log = logging.getLogger(__name__)


class AsyncResultWaiter:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._events: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _listen(self) -> None:
        backoff = 0.0
        while True:
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(keys.DONE_CHANNEL)
                    backoff = 0.0
                    self._wake_all()  # whatever landed while we were (re)connecting
                    async for message in pubsub.listen():
                        if message["type"] == "message":
                            for event in self._events.get(message["data"].decode(), ()):
                                event.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect on any connection trouble
                if not backoff:
                    log.warning("result listener lost Redis (%s); reconnecting", exc)
                backoff = min(max(2 * backoff, 0.25), 5.0)
                await asyncio.sleep(backoff)

    def _wake_all(self) -> None:
        for events in self._events.values():
            for event in events:
                event.set()

    async def wait(self, request_id: str, timeout: float) -> bytes | None:
        """The stored result JSON, or None if it has not landed within `timeout` seconds."""
        event = asyncio.Event()
        self._events[request_id].add(event)
        try:
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
        finally:
            self._events[request_id].discard(event)
            if not self._events[request_id]:
                del self._events[request_id]
