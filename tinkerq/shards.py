"""What `tinkerq shards` shows and what `tinkerq drain` asks: read from Redis, the only state workers share."""

import time
from dataclasses import asdict, dataclass

from redis import Redis
from rq.intermediate_queue import IntermediateQueue

from tinkerq import keys

DRAIN_TTL_S = 86400  # a drain asked of a worker that never comes back does not linger


@dataclass(frozen=True)
class ShardRow:
    shard: int
    queue: str
    owner: str | None  # the worker's name (`tinkerq drain` takes it), None while no lease is held
    epoch: int  # the fencing epoch: how many times the shard was taken
    queued: int
    in_flight: int  # claimed by the owner and not finished: the job in hand and the samples batched with it
    held: int  # training ops parked until their seq_id's turn
    models: int  # models routed here that a worker created or loaded

    def as_dict(self) -> dict:
        return asdict(self)


def models_by_shard(connection: Redis, num_shards: int) -> dict[int, int]:
    """Models a worker recorded (their info key), counted by shard. SCAN: it never blocks Redis."""
    counts: dict[int, int] = {}
    prefix, suffix = keys.info_key("\0").split("\0")
    for raw in connection.scan_iter(match=f"{prefix}*{suffix}", count=1000):
        name = raw.decode() if isinstance(raw, bytes) else raw
        model_id = name[len(prefix):-len(suffix)]
        shard = keys.shard_of(model_id, num_shards)
        counts[shard] = counts.get(shard, 0) + 1
    return counts


def shard_rows(connection: Redis, num_shards: int) -> list[ShardRow]:
    models = models_by_shard(connection, num_shards)
    with connection.pipeline(transaction=False) as pipe:
        for shard in range(num_shards):
            queue_key = keys.queue_key(shard)
            pipe.get(keys.lease_key(shard))
            pipe.get(keys.epoch_key(shard))
            pipe.llen(queue_key)
            pipe.llen(IntermediateQueue.get_intermediate_queue_key(queue_key))
            pipe.llen(keys.batched_key(shard))
            pipe.zcard(keys.held_deadlines_key(shard))
        replies = pipe.execute()
    rows = []
    for shard in range(num_shards):
        lease, epoch, queued, claimed, batched, held = replies[6 * shard:6 * shard + 6]
        owner = lease.decode().rpartition(":")[0] if lease else None
        rows.append(ShardRow(shard, keys.queue_name(shard), owner, int(epoch or 0), int(queued), int(claimed + batched),
                             int(held), models.get(shard, 0)))
    return rows


def table(rows: list[ShardRow]) -> str:
    header = ("shard", "queue", "owner", "epoch", "queued", "in_flight", "held", "models")
    cells = [header] + [(str(r.shard), r.queue, r.owner or "-", str(r.epoch), str(r.queued), str(r.in_flight),
                         str(r.held), str(r.models)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells)


def owned_by(rows: list[ShardRow], worker: str) -> list[int]:
    return [row.shard for row in rows if row.owner == worker]


def request_drain(connection: Redis, worker: str) -> None:
    """Ask the named worker to drain: its lease keeper sees this within a third of the lease TTL."""
    connection.set(keys.drain_key(worker), str(time.time()), ex=DRAIN_TTL_S)


def drained(connection: Redis, worker: str, num_shards: int) -> bool:
    """The worker deleted its drain request (after releasing its shards) and owns none."""
    return not connection.exists(keys.drain_key(worker)) and not owned_by(shard_rows(connection, num_shards), worker)
