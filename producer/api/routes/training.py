"""Training: models are created (or loaded) and trained, and their weights saved, all as futures."""

from fastapi import APIRouter, Request

from producer.api import bodies, proto, provenance
from producer.api.deps import Authorized, DepsParam, ProtoAuthorized
from producer.api.http_errors import ApiError
from producer.api.ids import derived_id
from producer.enqueue import Ticket
from tinkerq.uris import tinker_uri

router = APIRouter(prefix="/api/v1", dependencies=Authorized)
proto_router = APIRouter(prefix="/api/v1", dependencies=ProtoAuthorized)


def _future(ticket: Ticket, model_id: str) -> dict:
    return {"request_id": ticket.request_id, "model_id": model_id}


@router.post("/create_model")
async def create_model(body: bodies.CreateModel, deps: DepsParam) -> dict:
    await deps.live_session(body.session_id)
    deps.served_base(body.base_model)
    request = body.to_request()
    ticket = await deps.submit(request)
    await deps.record_run(request.model_id, body.session_id, body.base_model, body.lora_config.model_dump(),
                          body.user_metadata)
    return _future(ticket, request.model_id)


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


@proto_router.post("/forward_backward")
async def forward_backward(request: Request, deps: DepsParam) -> dict:
    message = proto.parse_forward_backward(await proto.read_body(request, deps.settings.max_body_bytes))
    async with deps.in_sequence(message.model_id, message.seq_id):
        await deps.known_model(message.model_id)
        data, custom = None, None
        if message.loss_fn == "stable_reinforce":
            data = await provenance.resolve(deps.state.redis, message, proto.datums(message),
                                            deps.producer.config.stability_ttl_s)
        elif message.loss_fn == "custom":
            custom = await deps.custom_loss(message.model_id, proto.custom_loss_id(message))
        return _future(await deps.submit(proto.to_request(message, data, custom)), message.model_id)


@router.post("/create_custom_loss")
async def create_custom_loss(body: bodies.CreateCustomLoss, deps: DepsParam) -> dict:
    """Kept for the session, and checked (compiled) on a worker: the future fails if the graph is refused."""
    await deps.live_session(body.session_id)
    loss = body.to_loss()
    await deps.state.losses.put(body.session_id, loss)
    ticket = await deps.submit(body.to_request(loss), derived_id("cl", body.session_id, body.custom_loss_seq_id))
    return {"request_id": ticket.request_id}


@router.post("/optim_step")
async def optim_step(body: bodies.OptimStep, deps: DepsParam) -> dict:
    async with deps.in_sequence(body.model_id, body.seq_id):
        await deps.known_model(body.model_id)
        return _future(await deps.submit(body.to_request()), body.model_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(body: bodies.SaveWeightsForSampler, deps: DepsParam) -> dict:
    async with deps.in_sequence(body.model_id, body.seq_id):
        info = await deps.known_model(body.model_id)
        ticket = await deps.submit(body.to_request())
    if body.path is not None:
        await deps.state.runs.name_snapshot(body.model_id, body.path, ticket.version)
        note = {"kind": "sync", "path": tinker_uri(body.model_id, "sampler_weights", body.path)}
    else:
        sampler_id = f"{body.model_id}:sample:{body.sampling_session_seq_id or 0}:{ticket.version}"
        await deps.state.samplers.put(sampler_id, body.model_id, ticket.version, info["base_model"], None)
        await deps.state.sessions.add(body.model_id.split(":", 1)[0], "samplers", sampler_id)
        note = {"kind": "sync", "sampling_session_id": sampler_id}
    await deps.state.notes.put(ticket.request_id, note)
    return _future(ticket, body.model_id)


@router.post("/save_weights")
async def save_weights(body: bodies.SaveWeights, deps: DepsParam) -> dict:
    async with deps.in_sequence(body.model_id, body.seq_id):
        await deps.known_model(body.model_id)
        ticket = await deps.submit(body.to_request())
    await deps.state.notes.put(ticket.request_id, {"kind": "save_state",
                                              "path": tinker_uri(body.model_id, "weights", body.path)})
    return _future(ticket, body.model_id)


@router.post("/load_weights")
async def load_weights(body: bodies.LoadWeights, deps: DepsParam) -> dict:
    if body.model_id is not None:  # legacy: load into an existing model, in its seq order
        async with deps.in_sequence(body.model_id, body.seq_id):
            await deps.known_model(body.model_id)
            return _future(await deps.submit(body.to_request()), body.model_id)
    if body.session_id is None or body.model_seq_id is None:
        raise ApiError(400, "load_weights needs model_id, or session_id and model_seq_id", "invalid_request")
    await deps.live_session(body.session_id)
    request = body.to_request()
    ticket = await deps.submit(request)
    await deps.record_run(request.model_id, body.session_id, None, None, body.user_metadata)
    return _future(ticket, request.model_id)
