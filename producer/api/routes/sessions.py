"""Client sessions: created, kept alive by heartbeats, finished."""

from fastapi import APIRouter

from producer.api import bodies
from producer.api.deps import Authorized, DepsParam

router = APIRouter(prefix="/api/v1", dependencies=Authorized)


@router.post("/create_session")
async def create_session(deps: DepsParam, body: bodies.CreateSession | None = None) -> dict:
    body = body or bodies.CreateSession()
    session_id = await deps.state.sessions.create(body.user_metadata, body.display_name)
    return {"session_id": session_id, "type": "create_session"}


@router.post("/session_heartbeat")
async def session_heartbeat(body: bodies.SessionRef, deps: DepsParam) -> dict:
    await deps.live_session(body.session_id)
    await deps.state.sessions.touch(body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: bodies.SessionId, body: bodies.FinishSession, deps: DepsParam) -> dict:
    await deps.live_session(session_id)
    await deps.state.sessions.finish(session_id, str((body.reason or {}).get("type", "")))
    return {}
