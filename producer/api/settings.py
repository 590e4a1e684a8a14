"""API server settings (TINKERQ_* environment variables)."""

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    """The Tinker-compatible HTTP API (`tinkerq api`): auth, request size, long polls, sessions, and how it stops."""

    model_config = SettingsConfigDict(env_prefix="TINKERQ_", frozen=True)

    api_keys: str = Field("", description=(
        "Comma-separated keys accepted in X-API-Key (401 otherwise); empty turns auth off, which the API says "
        "loudly at start-up."))
    max_body_bytes: int = Field(64 << 20, ge=1024, description="Largest request body the API reads; past it, 413.")
    long_poll_s: float = Field(30.0, gt=0, le=40, description=(
        "How long retrieve_future holds a poll before answering try_again; below the SDK's own 45 s wait."))
    api_stop_grace_s: float = Field(5.0, gt=0, le=60, description=(
        "After SIGTERM/SIGINT, how long `tinkerq api` lets open requests finish before it cancels them and stops "
        "(status 0)."))
    session_ttl_s: int = Field(7 * 86400, ge=60, description=(
        "How long what the API remembers between calls (sessions, samplers, runs, custom losses) stays in Redis."))
    fwdbwd_max_chunk_len: int = Field(1024, ge=1, description=(
        "Sent in client/config: the SDK splits a forward_backward into chunks of this many datums."))

    def keys(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())
