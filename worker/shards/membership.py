"""Who is balancing the shards (`tinkerq worker --shards auto`), and each one's fair share of them.

Every balanced worker beats in one sorted set (member: its name, score: the Redis server's clock in ms, so hosts'
clocks do not matter) as often as it renews its leases; one whose last beat is older than the lease TTL is gone,
as its leases are. With N live workers each holds at most its share of the K shards (`fair_share`): a worker
that joins finds the others over their share, they release the surplus between jobs (checkpointing its models
first), and it takes them; a worker that dies or leaves raises the others' shares, and its shards, free once its
leases lapse, are taken by them. Membership is advice for how many shards to hold, never ownership: leases and fencing
still decide who may write a shard.
"""

from redis import Redis

from tinkerq import keys


def fair_share(num_shards: int, members: list[str], name: str) -> int:
    """K // N shards each, and one more for the first K % N workers by name: the shares add up to K, so every
    shard has a worker with room for it and no worker waits for a shard while another holds more than its own."""
    rank = members.index(name) if name in members else len(members)
    count = max(1, len(members))
    return num_shards // count + (1 if rank < num_shards % count else 0)


class Membership:
    key = keys.WORKERS_KEY

    def __init__(self, connection: Redis, name: str, ttl_ms: int) -> None:
        self.connection = connection
        self.name = name
        self.ttl_ms = ttl_ms

    def beat(self) -> list[str]:
        """Say this worker is here; return every live worker's name, sorted (this one's included)."""
        seconds, micros = self.connection.time()
        now = seconds * 1000 + micros // 1000
        pipe = self.connection.pipeline(transaction=True)
        pipe.zadd(self.key, {self.name: now})
        pipe.zremrangebyscore(self.key, "-inf", now - self.ttl_ms)  # the gone ones
        pipe.zrange(self.key, 0, -1)
        return sorted(m.decode() if isinstance(m, bytes) else m for m in pipe.execute()[-1])

    def leave(self) -> None:
        self.connection.zrem(self.key, self.name)
