"""The only functions a worker runs (see ALLOWED_FUNCTIONS). Each is a thin entry into the dispatcher.

Producers enqueue these by dotted name with one JSON argument: the request payload.
"""

from typing import Any

from rq import get_current_job

from worker import context

ALLOWED_FUNCTIONS = frozenset({"worker.jobs.sample", "worker.jobs.weight_sync", "worker.jobs.training_op"})


def _run(*args: Any, **kwargs: Any) -> dict:
    # The worker has already judged the job and parsed its payload (worker/admission.py); the arguments are that
    # payload, and the dispatcher takes the parsed request from the job's verdict.
    return context.dispatcher().handle(get_current_job())


def sample(*args: Any, **kwargs: Any) -> dict:
    return _run(*args, **kwargs)


def weight_sync(*args: Any, **kwargs: Any) -> dict:
    return _run(*args, **kwargs)


def training_op(*args: Any, **kwargs: Any) -> dict:
    return _run(*args, **kwargs)
