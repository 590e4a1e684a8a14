"""Training: models are created (or loaded) and trained, and their weights saved, all as futures."""

from fastapi import APIRouter, Request

from producer.api import bodies, proto
from producer.api.deps import Authorized, DepsParam
from producer.api.errors import ApiError
from tinkerq.uris import tinker_uri

router = APIRouter(prefix="/api/v1", dependencies=Authorized)


def _future(ticket, model_id: str) -> dict:
    return {"request_id": ticket.request_id, "model_id": model_id}


@router.post("/create_model")
async def create_model(body: bodies.CreateModel, deps: DepsParam) -> dict:
    await deps.live_session(body.session_id)
    deps.served_base(body.base_model)
    request = body.to_request()
    return _future(await deps.submit(request), request.model_id)


@router.post("/get_info")
async def get_info(body: bodies.ModelRef, deps: DepsParam) -> dict:
    info = await deps.known_model(body.model_id)
    base = info["base_model"]
    model_data = {"arch": deps.catalog.architecture(base) or "unknown", "model_name": base}
    tokenizer = deps.catalog.built_path(base)  # the SDK's get_tokenizer() loads it from here, offline
    if tokenizer is not None:
        model_data["tokenizer_id"] = str(tokenizer)
    return {"type": "get_info", "model_id": body.model_id, "model_data": model_data, "is_lora": True,
            "lora_rank": info.get("lora_rank"), "model_name": info["base_model"]}


@router.post("/forward_backward")
async def forward_backward(request: Request, deps: DepsParam) -> dict:
    message = proto.parse_forward_backward(await proto.read_body(request, deps.settings.max_body_bytes))
    await deps.known_model(message.model_id)
    return _future(await deps.submit(proto.to_request(message)), message.model_id)


@router.post("/optim_step")
async def optim_step(body: bodies.OptimStep, deps: DepsParam) -> dict:
    await deps.known_model(body.model_id)
    return _future(await deps.submit(body.to_request()), body.model_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(body: bodies.SaveWeightsForSampler, deps: DepsParam) -> dict:
    info = await deps.known_model(body.model_id)
    ticket = await deps.submit(body.to_request())
    if body.path is not None:
        await deps.state.name_snapshot(body.model_id, body.path, ticket.version)
        note = {"kind": "sync", "path": tinker_uri(body.model_id, "sampler_weights", body.path)}
    else:
        sampler_id = f"{body.model_id}:sample:{body.sampling_session_seq_id or 0}:{ticket.version}"
        await deps.state.put_sampler(sampler_id, body.model_id, ticket.version, info["base_model"], None)
        note = {"kind": "sync", "sampling_session_id": sampler_id}
    await deps.state.note(ticket.request_id, note)
    return _future(ticket, body.model_id)


@router.post("/save_weights")
async def save_weights(body: bodies.SaveWeights, deps: DepsParam) -> dict:
    await deps.known_model(body.model_id)
    ticket = await deps.submit(body.to_request())
    await deps.state.note(ticket.request_id, {"kind": "save_state",
                                              "path": tinker_uri(body.model_id, "weights", body.path)})
    return _future(ticket, body.model_id)


@router.post("/load_weights")
async def load_weights(body: bodies.LoadWeights, deps: DepsParam) -> dict:
    if body.model_id is not None:  # legacy: load into an existing model, in its seq order
        await deps.known_model(body.model_id)
    elif body.session_id is not None and body.model_seq_id is not None:
        await deps.live_session(body.session_id)
    else:
        raise ApiError(400, "load_weights needs model_id, or session_id and model_seq_id", "invalid_request")
    request = body.to_request()
    return _future(await deps.submit(request), request.model_id)
