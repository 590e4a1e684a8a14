"""Redis key layout and routing. Every key of a model carries the model id in braces."""

from hashlib import blake2b

PREFIX = "tq"
DONE_CHANNEL = f"{PREFIX}:done"
NUM_SHARDS_KEY = f"{PREFIX}:config:num_shards"


def shard_of(model_id: str, num_shards: int) -> int:
    """Stable across processes and languages (never Python's salted hash())."""
    digest = blake2b(model_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_shards


def queue_name(shard: int) -> str:
    return f"tinkerq.shard.{shard:03d}"


def shard_of_queue(name: str) -> int:
    """The shard of a shard queue's name; ValueError for any other name (an origin read from Redis may be one)."""
    prefix, _, number = name.rpartition(".")
    if prefix != "tinkerq.shard" or not number.isdigit() or queue_name(int(number)) != name:
        raise ValueError(f"{name!r} is not a shard queue name")
    return int(number)


def request_key(request_id: str) -> str:
    return f"{PREFIX}:req:{request_id}"


def result_key(request_id: str) -> str:
    return f"{PREFIX}:res:{request_id}"


def model_key(model_id: str, field: str) -> str:
    """Per-model keys: wver (last version enqueued), applied, seq (last executed), held, snapshots."""
    return f"{PREFIX}:model:{{{model_id}}}:{field}"


def seq_key(model_id: str, seq_id: int) -> str:
    return f"{PREFIX}:model:{{{model_id}}}:seqid:{seq_id}"


def lease_key(shard: int) -> str:
    return f"{PREFIX}:shard:{shard}:lease"


def epoch_key(shard: int) -> str:
    return f"{PREFIX}:shard:{shard}:epoch"


def bell_key(shard: int) -> str:
    """A shard's doorbell: producers push to it (kept to one entry) with every enqueue, the owner blocks on it."""
    return f"{PREFIX}:shard:{shard}:bell"


def held_deadlines_key(shard: int) -> str:
    return f"{PREFIX}:shard:{shard}:held"


def inflight_key(shard: int) -> str:
    """Sample jobs a worker took out of the queue to serve in one batch (recovery requeues them)."""
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
