"""Redis key layout and routing: every key tinkerq writes is named here. Every key of a model carries the model
id in braces. The structures behind them are owned by small classes that name their operations (the API's
records: producer/api/state.py; the batched list: worker/consumer/batched.py; held training ops:
worker/serving/held.py)."""

from hashlib import blake2b
from typing import TYPE_CHECKING

from rq import Queue

if TYPE_CHECKING:
    from redis import Redis

PREFIX = "tq"
DONE_CHANNEL = f"{PREFIX}:done"
NUM_SHARDS_KEY = f"{PREFIX}:config:num_shards"


def shard_of(model_id: str, num_shards: int) -> int:
    """Stable across processes and languages (never Python's salted hash())."""
    digest = blake2b(model_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_shards


def queue_name(shard: int) -> str:
    return f"tinkerq.shard.{shard:03d}"


def queue_key(shard: int) -> str:
    """The Redis list of a shard queue, under RQ's own prefix."""
    return Queue.redis_queue_namespace_prefix + queue_name(shard)


def shard_of_queue(name: str) -> int:
    """The shard of a shard queue's name; ValueError for any other name (an origin read from Redis may be one)."""
    prefix, _, number = name.rpartition(".")
    if prefix != "tinkerq.shard" or not number.isdigit() or queue_name(int(number)) != name:
        raise ValueError(f"{name!r} is not a shard queue name")
    return int(number)


def check_num_shards(connection: "Redis", num_shards: int) -> None:
    """K must agree across every producer and worker of a deployment, or models would move shards."""
    connection.set(NUM_SHARDS_KEY, num_shards, nx=True)
    recorded = int(connection.get(NUM_SHARDS_KEY))
    if recorded != num_shards:
        raise RuntimeError(
            f"this Redis was set up with {recorded} shards but TINKERQ_NUM_SHARDS={num_shards}; "
            "K is fixed per deployment (delete the key tq:config:num_shards only on an empty deployment)"
        )


def request_key(request_id: str) -> str:
    return f"{PREFIX}:req:{request_id}"


def result_key(request_id: str) -> str:
    return f"{PREFIX}:res:{request_id}"


def model_key(model_id: str, field: str) -> str:
    """A per-model key; each field has its own function below."""
    return f"{PREFIX}:model:{{{model_id}}}:{field}"


def wver_key(model_id: str) -> str:
    """The last weights version enqueued (a sync's INCR at submit)."""
    return model_key(model_id, "wver")


def applied_key(model_id: str) -> str:
    """The last weights version the worker applied."""
    return model_key(model_id, "applied")


def snapshots_key(model_id: str) -> str:
    """Persisted snapshots: version -> path."""
    return model_key(model_id, "snapshots")


def last_seq_key(model_id: str) -> str:
    """The last seq_id that ran."""
    return model_key(model_id, "seq")


def refused_seqs_key(model_id: str) -> str:
    """seq_ids the API refused at submit (set)."""
    return model_key(model_id, "refused")


def held_key(model_id: str) -> str:
    """Training ops held for their turn: request id scored by seq_id (sorted set)."""
    return model_key(model_id, "held")


def held_payload_key(model_id: str) -> str:
    """The held ops' requests: request id -> JSON (hash)."""
    return model_key(model_id, "held_payload")


def info_key(model_id: str) -> str:
    """What the worker recorded at create/load (hash, field "json")."""
    return model_key(model_id, "info")


def journal_key(model_id: str) -> str:
    """The model's training journal: every state-changing op whose result was stored, as request JSON, in the
    order it ran (list; worker/durability/journal.py). Appended in the same fenced write as the op's result."""
    return model_key(model_id, "journal")


def journal_base_key(model_id: str) -> str:
    """Where the model's journal starts (hash): "offset", the entries trimmed from its head (a durable checkpoint
    holds their effect); "json", that checkpoint's record; "steps", the optim_steps journaled since it
    (worker/durability/checkpointer.py). Written only by fenced scripts, with the journal."""
    return model_key(model_id, "journal_base")


def checkpoints_key(model_id: str) -> str:
    """Registered checkpoints: checkpoint id -> CheckpointRecord JSON (hash)."""
    return model_key(model_id, "checkpoints")


def named_key(model_id: str) -> str:
    """Named sampler snapshots: name -> version (hash)."""
    return model_key(model_id, "named")


def seq_key(model_id: str, seq_id: int) -> str:
    return f"{PREFIX}:model:{{{model_id}}}:seqid:{seq_id}"


def lease_key(shard: int) -> str:
    return f"{PREFIX}:shard:{shard}:lease"


def epoch_key(shard: int) -> str:
    return f"{PREFIX}:shard:{shard}:epoch"


def shard_bases_key(shard: int) -> str:
    """The base models of the models created or loaded on a shard: base -> the last such model (hash, fenced). A
    standby warms them (TINKERQ_PRELOAD_BASES=auto), so taking the shard over starts no engine."""
    return f"{PREFIX}:shard:{shard}:bases"


WORKERS_KEY = f"{PREFIX}:workers"  # balanced workers (`--shards auto`) by their last heartbeat, in ms


def drain_key(worker: str) -> str:
    """Set by `tinkerq drain WORKER`: the worker of that name finishes what it holds, checkpoints its models,
    releases its shards and exits."""
    return f"{PREFIX}:worker:{worker}:drain"


def bell_key(shard: int) -> str:
    """A shard's doorbell: producers push to it (kept to one entry) with every enqueue, the owner blocks on it."""
    return f"{PREFIX}:shard:{shard}:bell"


def held_deadlines_key(shard: int) -> str:
    return f"{PREFIX}:shard:{shard}:held"


def batched_key(shard: int) -> str:
    """Sample jobs a worker took out of the queue to serve in one batch (recovery requeues them). The key keeps
    its `inflight` suffix so that lists a running deployment holds are still found."""
    return f"{PREFIX}:shard:{shard}:inflight"


def stability_key(sequence_id: str) -> tuple[str, str]:
    """Where a recorded sequence lives: one hash per sample request ("<sampler>:<seq_id>", the field "prompt"
    holds its prompt), a field per sample index."""
    group, _, index = sequence_id.rpartition(":")
    return f"{PREFIX}:stab:{group}", index


def custom_loss_key(session_id: str, loss_id: str) -> str:
    return f"{PREFIX}:closs:{session_id}:{loss_id}"


# -- what the API remembers between calls (its processes are stateless) --------------------------------

def session_key(session_id: str) -> str:
    return f"{PREFIX}:session:{session_id}"


def session_index_key(session_id: str, kind: str) -> str:
    """The training runs ("runs") or sampling sessions ("samplers") a session made."""
    return f"{PREFIX}:session:{session_id}:{kind}"


SESSIONS_KEY = f"{PREFIX}:sessions"  # every session, by creation time
RUNS_KEY = f"{PREFIX}:runs"  # every training run (model), by creation time


def run_key(model_id: str) -> str:
    """What the API keeps of a training run: its session, base, LoRA config, user metadata, last request."""
    return model_key(model_id, "run")


def sampler_key(sampler_id: str) -> str:
    return f"{PREFIX}:sampler:{sampler_id}"


def note_key(request_id: str) -> str:
    """Which Tinker response a stored result becomes (a sync's path or sampling session id)."""
    return f"{PREFIX}:api:{request_id}"
