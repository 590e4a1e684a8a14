"""What every route handler needs, built once per API process and kept on `app.state`."""

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from producer.api.errors import ApiError
from producer.api.metrics import Metrics
from producer.api.settings import ApiSettings
from producer.api.state import ApiState
from producer.api.submitter import GroupSubmitter
from producer.api.waiter import AsyncResultWaiter
from producer.enqueue import Producer, Ticket
from schemas import Request as QueueRequest
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
        status = await self.state.session_status(session_id)
        if status is None:
            raise ApiError(404, f"unknown session {session_id!r}", "unknown_session")
        if status == "finished":
            raise ApiError(410, f"session {session_id!r} is finished", "session_finished")

    async def known_model(self, model_id: str) -> dict:
        """The model's info as its worker recorded it at create/load; ApiError 404 if there is none."""
        info = await self.state.model_info(model_id)
        if info is None:
            raise ApiError(404, f"unknown model {model_id!r} (create it first)", "unknown_model")
        return info

    def served_base(self, name: str) -> str:
        if name not in self.catalog:
            raise ApiError(404, f"base model {name!r} is not served here; this deployment serves "
                           f"{', '.join(self.catalog.names)} (see get_server_capabilities)", "unknown_base_model")
        return name


def get_deps(request: Request) -> Deps:
    return request.app.state.deps


async def authorize(request: Request) -> None:
    allowed = get_deps(request).settings.keys()
    if allowed and request.headers.get("x-api-key") not in allowed:
        raise ApiError(401, "missing or unknown X-API-Key", "unauthorized")


Authorized = [Depends(authorize)]


DepsParam = Annotated[Deps, Depends(get_deps)]
