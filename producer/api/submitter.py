"""Group commit for an API process: submissions that arrive while one transaction is in flight go
together in the next. Many concurrent samplers then cost one Redis transaction (and the worker one
batch) per turn instead of one each, and nothing waits for a timer: an idle server submits at once."""

import asyncio

from producer.enqueue import Producer, Ticket
from schemas import Request


class GroupSubmitter:
    def __init__(self, producer: Producer, max_batch: int = 256) -> None:
        self.producer = producer
        self.max_batch = max_batch
        self._pending: list[tuple[Request, str | None, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None

    async def submit(self, request: Request, request_id: str | None = None) -> Ticket:
        """The request's Ticket; raises Rejected exactly as Producer.submit would."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, request_id, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            try:
                outcomes = await asyncio.to_thread(self.producer.submit_each, [r for r, _, _ in batch],
                                                   [rid for _, rid, _ in batch])
            except Exception as exc:  # noqa: BLE001 - Redis trouble: every caller of this turn hears it
                outcomes = [exc] * len(batch)
            for (_, _, future), outcome in zip(batch, outcomes, strict=True):
                if future.done():  # the client went away
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
