"""What the API remembers between calls, in Redis (API servers are stateless and interchangeable).

sessions        tq:session:<id>            hash, TTL
sampling        tq:sampler:<id>            hash: model_id, version, base_model, model_path
named syncs     tq:model:{M}:named         hash: sampler-weights name -> version
how to answer   tq:api:<request id>        JSON note: which Tinker response a stored result becomes
"""

import json
import time
import uuid

from redis.asyncio import Redis

from tinkerq import keys

SAMPLER_PREFIX = f"{keys.PREFIX}:sampler:"
SESSION_PREFIX = f"{keys.PREFIX}:session:"
NOTE_PREFIX = f"{keys.PREFIX}:api:"


class ApiState:
    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        # A sampling session never changes once made, so every sample need not read it from Redis.
        self._samplers: dict[str, dict[str, str]] = {}

    async def create_session(self) -> str:
        session_id = uuid.uuid4().hex
        await self.redis.hset(SESSION_PREFIX + session_id, mapping={"created": time.time(), "status": "active"})
        await self.redis.expire(SESSION_PREFIX + session_id, self.ttl_s)
        return session_id

    async def session_status(self, session_id: str) -> str | None:
        status = await self.redis.hget(SESSION_PREFIX + session_id, "status")
        return status.decode() if status else None

    async def touch_session(self, session_id: str) -> None:
        await self.redis.hset(SESSION_PREFIX + session_id, "heartbeat", time.time())
        await self.redis.expire(SESSION_PREFIX + session_id, self.ttl_s)

    async def finish_session(self, session_id: str, reason: str) -> None:
        await self.redis.hset(SESSION_PREFIX + session_id, mapping={"status": "finished", "reason": reason})

    async def put_sampler(self, sampler_id: str, model_id: str, version: int, base_model: str,
                          model_path: str | None, bare: bool = False) -> None:
        """`bare`: the session samples the base model itself, not a trained model's snapshot."""
        fields = {"model_id": model_id, "version": version, "base_model": base_model, "model_path": model_path or "",
                  "bare": int(bare)}
        await self.redis.hset(SAMPLER_PREFIX + sampler_id, mapping=fields)
        await self.redis.expire(SAMPLER_PREFIX + sampler_id, self.ttl_s)

    async def sampler(self, sampler_id: str) -> dict[str, str] | None:
        if sampler_id in self._samplers:
            return self._samplers[sampler_id]
        raw = await self.redis.hgetall(SAMPLER_PREFIX + sampler_id)
        if not raw:
            return None
        if len(self._samplers) >= 10000:
            self._samplers.clear()
        self._samplers[sampler_id] = {k.decode(): v.decode() for k, v in raw.items()}
        return self._samplers[sampler_id]

    async def name_snapshot(self, model_id: str, name: str, version: int) -> None:
        await self.redis.hset(keys.model_key(model_id, "named"), name, version)

    async def named_version(self, model_id: str, name: str) -> int | None:
        version = await self.redis.hget(keys.model_key(model_id, "named"), name)
        return int(version) if version is not None else None

    async def model_info(self, model_id: str) -> dict | None:
        raw = await self.redis.hget(keys.model_key(model_id, "info"), "json")
        return json.loads(raw) if raw else None

    async def request_exists(self, request_id: str) -> bool:
        return bool(await self.redis.exists(keys.request_key(request_id)))

    async def note(self, request_id: str, note: dict) -> None:
        await self.redis.set(NOTE_PREFIX + request_id, json.dumps(note), ex=self.ttl_s)

    async def get_note(self, request_id: str) -> dict | None:
        raw = await self.redis.get(NOTE_PREFIX + request_id)
        return json.loads(raw) if raw else None
