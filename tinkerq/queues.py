"""Reads of the shard queues that producers and workers both make."""

from collections.abc import Sequence

from redis import Redis


def lengths(connection: Redis, queue_keys: Sequence[str]) -> list[int]:
    """How many jobs each queue holds, in one round trip."""
    with connection.pipeline(transaction=False) as pipe:
        for key in queue_keys:
            pipe.llen(key)
        return pipe.execute()
