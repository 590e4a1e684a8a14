"""Everything is a future: `retrieve_future` long-polls until its result lands, then renders it."""

from fastapi import APIRouter
from fastapi.responses import Response

from producer.api import bodies
from producer.api.deps import Authorized, DepsParam
from producer.api.http_errors import ApiError
from producer.api.render import render
from schemas import ErrorResponse, parse_result

router = APIRouter(prefix="/api/v1", dependencies=Authorized)


@router.post("/retrieve_future", response_model=None)
async def retrieve_future(body: bodies.RetrieveFuture, deps: DepsParam) -> Response | dict:
    raw = await deps.waiter.wait(body.request_id, deps.settings.long_poll_s)
    if raw is None:
        # A stopping server answers at once without Redis (which may be frozen); the SDK polls again elsewhere.
        if not deps.waiter.released and not await deps.state.request_exists(body.request_id):
            raise ApiError(404, f"unknown request id {body.request_id!r}", "unknown_request")
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
    result = parse_result(raw)
    deps.metrics.results.labels(result.type, result.code if isinstance(result, ErrorResponse) else "ok").inc()
    # Only syncs and saves need what the API noted at submit (paths, sampling session ids).
    note = await deps.state.notes.get(body.request_id) if result.type in ("weight_sync", "save_state") else {}
    return render(result, note or {})
