"""What every route handler needs, built once per API process and kept on `app.state`."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from pydantic import ValidationError

from producer.api.http_errors import ApiError
from producer.api.long_poll import AsyncResultWaiter
from producer.api.metrics import Metrics
from producer.api.settings import ApiSettings
from producer.api.state import ApiState
from producer.api.submitter import GroupSubmitter
from producer.enqueue import Producer, Ticket
from producer.errors import Rejected
from schemas import CustomLoss, Request as QueueRequest
from tinkerq.catalog import BaseModelCatalog


@dataclass
class Deps:
    settings: ApiSettings
    producer: Producer
    state: ApiState
    waiter: AsyncResultWaiter
    metrics: Metrics
    submitter: GroupSubmitter
    catalog: BaseModelCatalog

    async def submit(self, request: QueueRequest, request_id: str | None = None) -> Ticket:
        return await self.submitter.submit(request, request_id)

    async def live_session(self, session_id: str) -> None:
        """ApiError unless the session exists and is not finished."""
        status = await self.state.sessions.status(session_id)
        if status is None:
            raise ApiError(404, f"unknown session {session_id!r}", "unknown_session")
        if status == "finished":
            raise ApiError(410, f"session {session_id!r} is finished", "session_finished")

    async def known_model(self, model_id: str) -> dict:
        """The model's info as its worker recorded it at create/load; ApiError 404 if there is none."""
        info = await self.state.runs.info(model_id)
        if info is None:
            raise ApiError(404, f"unknown model {model_id!r} (create it first)", "unknown_model")
        return info

    @asynccontextmanager
    async def in_sequence(self, model_id: str, seq_id: int | None) -> AsyncIterator[None]:
        """Submit a sequenced training op. If it is refused for good (a 4xx the SDK does not retry), its seq_id
        is recorded as taken: the SDK has counted it, and the model's later ops must not wait for it."""
        try:
            yield
        except (ApiError, Rejected, ValidationError) as exc:
            if seq_id is not None and _final(exc):
                await self.state.runs.refuse_seq(model_id, seq_id)
            raise
        await self.state.runs.touch(model_id)  # the run's last_request_time

    async def record_run(self, model_id: str, session_id: str, base_model: str | None, lora: dict | None,
                         user_metadata: dict | None) -> None:
        """A training run the session made: for the REST API's training_runs and sessions."""
        await self.state.runs.record(model_id, session_id, base_model, lora, user_metadata)
        await self.state.sessions.add(session_id, "runs", model_id)

    async def custom_loss(self, model_id: str, loss_id: str) -> CustomLoss:
        """A custom loss the model's session created (losses are session-scoped, as in Tinker)."""
        loss = await self.state.losses.get(model_id.split(":", 1)[0], loss_id)
        if loss is None:
            raise ApiError(400, f"no custom loss {loss_id!r} in this session; create it with create_custom_loss",
                           "unknown_custom_loss")
        return loss

    def served_base(self, name: str) -> str:
        if name not in self.catalog:
            raise ApiError(404, f"base model {name!r} is not served here; this deployment serves "
                           f"{', '.join(self.catalog.names)} (see get_server_capabilities)", "unknown_base_model")
        return name


def _final(exc: Exception) -> bool:
    """A refusal the SDK will not resend under the same seq_id (it retries 408, 409, 429 and 5xx)."""
    if isinstance(exc, ValidationError):
        return True
    if isinstance(exc, Rejected):
        # a conflicting resend of a seq_id that was taken: the first request holds it
        return not exc.error.retryable and exc.error.code != "idempotency_conflict" and exc.error.status < 500
    return exc.status < 500 and exc.status not in (408, 409, 429)


def get_deps(request: Request) -> Deps:
    return request.app.state.deps


async def authorize(request: Request) -> None:
    allowed = get_deps(request).settings.keys()
    if allowed and request.headers.get("x-api-key") not in allowed:
        raise ApiError(401, "missing or unknown X-API-Key", "unauthorized")


async def json_only(request: Request) -> None:
    """A JSON route with a body of another declared type is a 415 (FastAPI alone would answer 422)."""
    content_type = request.headers.get("content-type", "")
    if request.method in ("POST", "PUT", "PATCH") and content_type and "json" not in content_type:
        raise ApiError(415, f"this route takes an application/json body, not {content_type!r}",
                       "unsupported_media_type")


Authorized = [Depends(authorize), Depends(json_only)]
ProtoAuthorized = [Depends(authorize)]  # routes whose body is protobuf


DepsParam = Annotated[Deps, Depends(get_deps)]
