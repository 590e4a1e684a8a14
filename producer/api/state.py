"""What the API remembers between calls, in Redis (API servers are stateless and interchangeable): one small
class per structure, each owning its keys (tinkerq/keys.py) and naming its operations."""

import json
import time
import uuid
from dataclasses import dataclass

from redis.asyncio import Redis

from schemas import CheckpointRecord, CustomLoss
from tinkerq import keys


@dataclass
class _Store:
    redis: Redis
    ttl_s: int


class Sessions(_Store):
    """tq:session:<id> (hash: status, heartbeat, metadata), its runs and samplers, and the index of all."""

    async def create(self, user_metadata: dict | None = None, display_name: str | None = None) -> str:
        session_id = uuid.uuid4().hex
        now = time.time()
        fields = {"created": now, "status": "active", "user_metadata": json.dumps(user_metadata or {}),
                  "display_name": display_name or ""}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.session_key(session_id), mapping=fields)
            pipe.expire(keys.session_key(session_id), self.ttl_s)
            pipe.zadd(keys.SESSIONS_KEY, {session_id: now})
            await pipe.execute()
        return session_id

    async def status(self, session_id: str) -> str | None:
        status = await self.redis.hget(keys.session_key(session_id), "status")
        return status.decode() if status else None

    async def touch(self, session_id: str) -> None:
        await self.redis.hset(keys.session_key(session_id), "heartbeat", time.time())
        await self.redis.expire(keys.session_key(session_id), self.ttl_s)

    async def finish(self, session_id: str, reason: str) -> None:
        await self.redis.hset(keys.session_key(session_id), mapping={"status": "finished", "reason": reason})

    async def add(self, session_id: str, kind: str, member: str) -> None:
        """Index a training run ("runs") or sampling session ("samplers") under the session that made it."""
        key = keys.session_index_key(session_id, kind)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.sadd(key, member)
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def describe(self, session_id: str) -> dict | None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.session_key(session_id))
            pipe.smembers(keys.session_index_key(session_id, "runs"))
            pipe.smembers(keys.session_index_key(session_id, "samplers"))
            fields, runs, samplers = await pipe.execute()
        if not fields:
            return None
        return {"training_run_ids": sorted(r.decode() for r in runs),
                "sampler_ids": sorted(s.decode() for s in samplers),
                "user_metadata": json.loads(fields.get(b"user_metadata", b"{}")) or None,
                "display_name": fields.get(b"display_name", b"").decode() or None}

    async def page(self, offset: int, limit: int) -> list[str]:
        """Newest first."""
        return [s.decode() for s in await self.redis.zrevrange(keys.SESSIONS_KEY, offset, offset + limit - 1)]


@dataclass
class Samplers(_Store):
    """tq:sampler:<id> (hash: model_id, version, base_model, model_path, bare). A sampling session never changes
    once made, so each API process keeps the ones it has read."""

    def __post_init__(self) -> None:
        self._cache: dict[str, dict[str, str]] = {}

    async def put(self, sampler_id: str, model_id: str, version: int, base_model: str, model_path: str | None,
                  bare: bool = False) -> None:
        """`bare`: the session samples the base model itself, not a trained model's snapshot."""
        fields = {"model_id": model_id, "version": version, "base_model": base_model, "model_path": model_path or "",
                  "bare": int(bare)}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.sampler_key(sampler_id), mapping=fields)
            pipe.expire(keys.sampler_key(sampler_id), self.ttl_s)
            await pipe.execute()

    async def get(self, sampler_id: str) -> dict[str, str] | None:
        if sampler_id in self._cache:
            return self._cache[sampler_id]
        raw = await self.redis.hgetall(keys.sampler_key(sampler_id))
        if not raw:
            return None
        if len(self._cache) >= 10000:
            self._cache.clear()
        self._cache[sampler_id] = {k.decode(): v.decode() for k, v in raw.items()}
        return self._cache[sampler_id]


class Runs(_Store):
    """Training runs (models): what the API records at creation (tq:model:{M}:run), what their worker records
    (info, checkpoints), their named sampler snapshots, and seq_ids refused at submit."""

    async def record(self, model_id: str, session_id: str, base_model: str | None, lora: dict | None,
                     user_metadata: dict | None) -> None:
        now = time.time()
        fields = {"session": session_id, "base_model": base_model or "", "lora": json.dumps(lora),
                  "user_metadata": json.dumps(user_metadata or {}), "created": now, "last": now}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.run_key(model_id), mapping=fields)
            pipe.zadd(keys.RUNS_KEY, {model_id: now})
            await pipe.execute()

    async def touch(self, model_id: str) -> None:
        await self.redis.hset(keys.run_key(model_id), "last", time.time())

    async def get(self, model_id: str) -> dict | None:
        """The run as the API and its worker recorded it; None unless its worker has created it."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.run_key(model_id))
            pipe.hget(keys.info_key(model_id), "json")
            run, info = await pipe.execute()
        if info is None:
            return None
        out = {k.decode(): v.decode() for k, v in run.items()}
        return {**out, **json.loads(info), "lora": json.loads(out.get("lora") or "null"),
                "user_metadata": json.loads(out.get("user_metadata") or "{}")}

    async def info(self, model_id: str) -> dict | None:
        """What the model's worker recorded at create/load (base_model, lora_rank)."""
        raw = await self.redis.hget(keys.info_key(model_id), "json")
        return json.loads(raw) if raw else None

    async def page(self, offset: int, limit: int) -> tuple[list[str], int]:
        """Newest first, and how many there are."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrevrange(keys.RUNS_KEY, offset, offset + limit - 1)
            pipe.zcard(keys.RUNS_KEY)
            ids, total = await pipe.execute()
        return [i.decode() for i in ids], total

    async def checkpoints(self, model_id: str) -> dict[str, CheckpointRecord]:
        """checkpoint id ("weights/<name>", "sampler_weights/<name>") -> its record, as the worker registered it."""
        raw = await self.redis.hgetall(keys.checkpoints_key(model_id))
        return {k.decode(): CheckpointRecord.model_validate_json(v) for k, v in raw.items()}

    async def name_snapshot(self, model_id: str, name: str, version: int) -> None:
        await self.redis.hset(keys.named_key(model_id), name, version)

    async def named_version(self, model_id: str, name: str) -> int | None:
        version = await self.redis.hget(keys.named_key(model_id), name)
        return int(version) if version is not None else None

    async def forget_name(self, model_id: str, name: str) -> None:
        await self.redis.hdel(keys.named_key(model_id), name)

    async def refuse_seq(self, model_id: str, seq_id: int) -> None:
        """A sequenced training op refused at submit: the SDK counted its seq_id, so the worker must not hold
        later ops of the model waiting for it."""
        key = keys.refused_seqs_key(model_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.sadd(key, seq_id)
            pipe.expire(key, self.ttl_s)
            await pipe.execute()


class Notes(_Store):
    """tq:api:<request id>: which Tinker response a stored result becomes."""

    async def put(self, request_id: str, note: dict) -> None:
        await self.redis.set(keys.note_key(request_id), json.dumps(note), ex=self.ttl_s)

    async def get(self, request_id: str) -> dict | None:
        raw = await self.redis.get(keys.note_key(request_id))
        return json.loads(raw) if raw else None


class CustomLosses(_Store):
    """tq:closs:<session>:<loss id>: the losses a session created (Tinker's custom losses are session-scoped)."""

    async def put(self, session_id: str, loss: CustomLoss) -> None:
        await self.redis.set(keys.custom_loss_key(session_id, loss.loss_id), loss.model_dump_json(), ex=self.ttl_s)

    async def get(self, session_id: str, loss_id: str) -> CustomLoss | None:
        raw = await self.redis.get(keys.custom_loss_key(session_id, loss_id))
        return CustomLoss.model_validate_json(raw) if raw else None


class ApiState:
    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self.redis = redis
        self.sessions = Sessions(redis, ttl_s)
        self.samplers = Samplers(redis, ttl_s)
        self.runs = Runs(redis, ttl_s)
        self.notes = Notes(redis, ttl_s)
        self.losses = CustomLosses(redis, ttl_s)

    async def request_exists(self, request_id: str) -> bool:
        return bool(await self.redis.exists(keys.request_key(request_id)))
