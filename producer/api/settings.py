"""API server settings (TINKERQ_* environment variables)."""

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TINKERQ_", frozen=True)

    # Comma-separated keys accepted in X-API-Key; empty turns auth off (said loudly at start-up).
    api_keys: str = ""
    max_body_bytes: int = Field(64 << 20, ge=1024)
    # retrieve_future holds a poll this long before answering try_again (the SDK waits 45 s).
    long_poll_s: float = Field(30.0, gt=0, le=40)
    # After SIGTERM/SIGINT, how long `tinkerq api` lets open requests finish before it cancels them and stops.
    api_stop_grace_s: float = Field(5.0, gt=0, le=60)
    session_ttl_s: int = Field(7 * 86400, ge=60)
    # Sent in client/config: the SDK splits a forward_backward into chunks of this many datums.
    fwdbwd_max_chunk_len: int = Field(1024, ge=1)

    def keys(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())
