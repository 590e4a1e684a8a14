"""The process-wide dispatcher that job functions reach. RQ has no preload hook, so the worker
loads its runtime once, installs a dispatcher here, and only then starts consuming."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.dispatcher import Dispatcher

_dispatcher: "Dispatcher | None" = None


def install(dispatcher: "Dispatcher") -> None:
    global _dispatcher
    _dispatcher = dispatcher


def dispatcher() -> "Dispatcher":
    if _dispatcher is None:
        raise RuntimeError("no dispatcher installed: job functions run only inside `tinkerq worker`")
    return _dispatcher
