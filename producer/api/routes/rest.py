"""The SDK's RestClient surface: training runs, checkpoints, sessions and weights info, from what this system
keeps. What it does not keep (published checkpoints, TTLs, projects, traces, billing, external weights) is a 400
that says so: the SDK raises it at once (it would retry a 5xx)."""

from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

from fastapi import APIRouter, Query

from producer.api.deps import Authorized, DepsParam
from producer.api.http_errors import ApiError
from schemas import CheckpointRecord, DeleteCheckpointRequest
from tinkerq.uris import parse_tinker_uri, tinker_uri

router = APIRouter(prefix="/api/v1", dependencies=Authorized)
CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler"}


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def _checkpoint(model_id: str, checkpoint_id: str, record: CheckpointRecord) -> dict:
    kind, name = checkpoint_id.split("/", 1)
    return {"checkpoint_id": checkpoint_id, "checkpoint_type": CHECKPOINT_TYPES[kind], "time": _time(record.time),
            "tinker_path": tinker_uri(model_id, kind, name), "size_bytes": record.size_bytes, "public": False}


async def _training_run(model_id: str, deps: DepsParam) -> dict:
    run = await deps.state.runs.get(model_id)
    if run is None:
        raise ApiError(404, f"unknown training run {model_id!r}", "unknown_training_run")
    checkpoints = sorted((await deps.state.runs.checkpoints(model_id)).items(), key=lambda item: item[1].time)

    def last(kind: str) -> dict | None:
        mine = [c for c in checkpoints if c[0].startswith(f"{kind}/")]
        return _checkpoint(model_id, *mine[-1]) if mine else None

    return {"training_run_id": model_id, "base_model": run["base_model"], "model_owner": run.get("session", ""),
            "is_lora": run.get("lora_rank") is not None, "lora_rank": run.get("lora_rank"), "corrupted": False,
            "last_request_time": _time(float(run.get("last") or 0)), "last_checkpoint": last("weights"),
            "last_sampler_checkpoint": last("sampler_weights"), "user_metadata": run["user_metadata"] or None}


@router.get("/training_runs")
async def list_training_runs(deps: DepsParam, limit: int = Query(20, ge=1, le=1000),
                             offset: int = Query(0, ge=0)) -> dict:
    ids, total = await deps.state.runs.page(offset, limit)
    runs = []
    for model_id in ids:
        try:
            runs.append(await _training_run(model_id, deps))
        except ApiError:
            continue  # recorded by the API, never created by a worker (its create failed)
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{model_id}")
async def get_training_run(model_id: str, deps: DepsParam) -> dict:
    return await _training_run(model_id, deps)


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(model_id: str, deps: DepsParam) -> dict:
    await _training_run(model_id, deps)
    records = sorted((await deps.state.runs.checkpoints(model_id)).items(), key=lambda item: item[1].time)
    return {"checkpoints": [_checkpoint(model_id, cid, record) for cid, record in records]}


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(model_id: str, kind: str, name: str, deps: DepsParam) -> dict:
    """The file goes in queue order, after whatever the model has queued; no new sampling session can be made
    from it from now on (sessions made already keep their snapshot while the engine holds it). The SDK names
    a checkpoint "<kind>/<name>", as in its tinker path."""
    checkpoint_id = f"{kind}/{name}"
    if checkpoint_id not in await deps.state.runs.checkpoints(model_id):
        raise ApiError(404, f"training run {model_id!r} has no checkpoint {checkpoint_id!r}", "unknown_checkpoint")
    if kind == "sampler_weights":
        await deps.state.runs.forget_name(model_id, name)
    ticket = await deps.submit(DeleteCheckpointRequest(model_id=model_id, checkpoint_id=checkpoint_id))
    return {"request_id": ticket.request_id}


@router.get("/checkpoints")
async def list_user_checkpoints(deps: DepsParam, limit: int = Query(100, ge=1, le=1000),
                                offset: int = Query(0, ge=0)) -> dict:
    ids, _ = await deps.state.runs.page(0, 10000)
    everything = []
    for model_id in ids:
        everything += [(record.time, model_id, cid, record)
                       for cid, record in (await deps.state.runs.checkpoints(model_id)).items()]
    everything.sort(reverse=True)
    page = [_checkpoint(model_id, cid, record) for _, model_id, cid, record in everything[offset:offset + limit]]
    return {"checkpoints": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(everything)}}


@router.post("/weights_info")
async def weights_info(body: dict, deps: DepsParam) -> dict:
    parsed = parse_tinker_uri(str(body.get("tinker_path", "")))
    if parsed is None:
        raise ApiError(400, "weights_info takes tinker_path: tinker://<model_id>/(weights|sampler_weights)/<name>",
                       "invalid_path")
    run = await _training_run(parsed[0], deps)
    lora = (await deps.state.runs.get(parsed[0]))["lora"] or {}
    return {"base_model": run["base_model"], "is_lora": run["is_lora"], "lora_rank": run["lora_rank"],
            **{k: lora[k] for k in ("train_unembed", "train_mlp", "train_attn") if k in lora}}


@router.get("/sessions")
async def list_sessions(deps: DepsParam, limit: int = Query(20, ge=1, le=1000), offset: int = Query(0, ge=0)) -> dict:
    return {"sessions": await deps.state.sessions.page(offset, limit)}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, deps: DepsParam) -> dict:
    described = await deps.state.sessions.describe(session_id)
    if described is None:
        raise ApiError(404, f"unknown session {session_id!r}", "unknown_session")
    return described


# What the SDK can ask for that this system does not keep or do, each with why.
UNSUPPORTED: list[tuple[str, str, str]] = [
    ("POST", "/training_runs/{model_id}/checkpoints/{kind}/{name}/publish",
     "checkpoints are not published: there are no other users to share them with"),
    ("DELETE", "/training_runs/{model_id}/checkpoints/{kind}/{name}/publish",
     "checkpoints are not published: there are no other users to share them with"),
    ("PUT", "/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl",
     "checkpoints have no TTL here: they are kept until deleted"),
    ("GET", "/training_runs/{model_id}/checkpoints/{kind}/{name}/external_weights_urls",
     "there are no external weights: save_weights_external is not supported"),
    ("POST", "/save_weights_external", "exporting weights to external storage is not supported; "
     "save_weights_for_sampler writes an HF-format archive under the worker's checkpoint root"),
    ("POST", "/copy_weights", "there are no projects to copy weights between"),
    ("PUT", "/sessions/{session_id}/project", "there are no projects"),
    ("GET", "/sessions/{session_id}/trace_export", "sessions are not traced"),
    ("POST", "/sessions/search", "session search is not supported; list_sessions and get_session are"),
    ("GET", "/audit", "there is no audit log"),
    ("GET", "/billing/usage/events", "there is no billing"),
    ("GET", "/billing/usage/checkpoints/current", "there is no billing"),
    ("POST", "/auth/token", "JWT auth is off (pjwt_auth_enabled=false): the API takes X-API-Key"),
    ("GET", "/auth/apikey/me", "API keys are configured by the operator (TINKERQ_API_KEYS), not managed here"),
    ("DELETE", "/auth/apikey/me", "API keys are configured by the operator (TINKERQ_API_KEYS), not managed here"),
    ("POST", "/cancel_future", "sample cancelling is off (sample_cancel_enabled=false)"),
    ("POST", "/retrieve_futures", "this server answers each future by retrieve_future "
     "(sample_use_retrieve_futures=false)"),
    ("POST", "/join_sampling_session", "sampling sessions need no joining (sample_join_sampling_session=false)"),
]


def _unsupported(why: str) -> Callable[[], Awaitable[dict]]:
    async def unsupported() -> dict:
        raise ApiError(400, f"not supported by this server: {why}", "unsupported")
    return unsupported


for _method, _path, _why in UNSUPPORTED:
    router.add_api_route(_path, _unsupported(_why), methods=[_method], include_in_schema=False,
                         name=f"unsupported {_method} {_path}")
