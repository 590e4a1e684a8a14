"""Hearing that the server is stopping while requests are still open.

uvicorn, on SIGTERM or SIGINT, stops accepting connections and then waits for the open requests to finish before it
runs the app's lifespan shutdown. A pending `retrieve_future` holds its poll for TINKERQ_LONG_POLL_S (longer against
a frozen Redis), so the app has to hear of the stop from the signal itself, not from its shutdown."""

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def on_stop_signal(callback: Callable[[], None]) -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT call `callback` in the running event loop, then the handler that was
    there (uvicorn's, which starts its graceful shutdown). Signal handlers live in the main thread only: elsewhere
    (TestClient runs the app in a thread of its own) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def handler(signum: int, frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(callback)
        _chain(previous[signum], signum, frame)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, before in previous.items():
            if signal.getsignal(sig) is handler:  # the server may have put its own back already
                signal.signal(sig, before)


def _chain(before: object, signum: int, frame: FrameType | None) -> None:
    if callable(before):
        before(signum, frame)
    elif before != signal.SIG_IGN:  # the default action (or unknown): deliver it as if we had not been there
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
