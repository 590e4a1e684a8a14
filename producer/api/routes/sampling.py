"""Sampling sessions (a model's snapshot, by transient sync or by path) and the samples drawn from them."""

from fastapi import APIRouter

from producer.api import bodies
from producer.api.deps import Authorized, DepsParam
from producer.api.http_errors import ApiError
from producer.api.ids import derived_id
from schemas.ids import base_model_id
from tinkerq.uris import parse_tinker_uri

router = APIRouter(prefix="/api/v1", dependencies=Authorized)


@router.post("/create_sampling_session")
async def create_sampling_session(body: bodies.CreateSamplingSession, deps: DepsParam) -> dict:
    await deps.live_session(body.session_id)
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    if body.model_path is not None:
        model_id, version = await _named_snapshot(body.model_path, deps)
        info = await deps.known_model(model_id)
        await deps.state.samplers.put(sampler_id, model_id, version, info["base_model"], body.model_path)
    elif body.base_model is not None:
        base = deps.served_base(body.base_model)
        await deps.state.samplers.put(sampler_id, base_model_id(base), 0, base, None, bare=True)
    else:
        raise ApiError(400, "create_sampling_session needs model_path or base_model", "invalid_request")
    await deps.state.sessions.add(body.session_id, "samplers", sampler_id)
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


async def _named_snapshot(path: str, deps: DepsParam) -> tuple[str, int]:
    parsed = parse_tinker_uri(path)
    named = parsed is not None and parsed[1] == "sampler_weights"
    version = await deps.state.runs.named_version(parsed[0], parsed[2]) if named else None
    if version is None:
        raise ApiError(404, f"no sampler weights at {path!r}", "unknown_path")
    return parsed[0], version


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: bodies.SamplerId, deps: DepsParam) -> dict:
    sampler = await deps.state.samplers.get(sampler_id)
    if sampler is None:
        raise ApiError(404, f"unknown sampling session {sampler_id!r}", "unknown_sampler")
    return {"sampler_id": sampler_id, "base_model": sampler["base_model"], "model_path": sampler["model_path"] or None}


@router.post("/asample")
async def asample(body: bodies.ASample, deps: DepsParam) -> dict:
    sampler = await deps.state.samplers.get(body.sampling_session_id)
    if sampler is None:
        raise ApiError(404, f"unknown sampling session {body.sampling_session_id!r}", "unknown_sampler")
    # The SDK resends a 429'd sample with the same seq_id: the same request id makes it idempotent.
    ticket = await deps.submit(body.to_request(sampler), derived_id("sa", body.sampling_session_id, body.seq_id))
    return {"request_id": ticket.request_id, "sample_sequence_ids": body.sequence_ids}
