"""The FastAPI application: Tinker's HTTP protocol on top of the producer library."""

import asyncio
import hashlib
import logging
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import zstandard
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import RedisError

from producer.api import bodies, proto
from producer.api.errors import ApiError, error_response, rejected_response
from producer.api.limits import BodySizeLimit
from producer.api.metrics import Metrics, ObserveLatency
from producer.api.settings import ApiSettings
from producer.api.state import ApiState
from producer.api.submitter import GroupSubmitter
from producer.api.waiter import AsyncResultWaiter
from producer.enqueue import Producer, Ticket
from producer.errors import Rejected
from schemas import (
    AdamParams,
    CreateModelRequest,
    ErrorResponse,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateRequest,
    LoraConfig,
    OptimStepRequest,
    Request as QueueRequest,
    SampleRequest,
    SamplingParams,
    SaveStateRequest,
    WeightSyncRequest,
    parse_result,
)
from tinkerq import keys
from tinkerq.config import QueueConfig
from tinkerq.uris import parse_tinker_uri, tinker_uri
from tinkerq import local_models

log = logging.getLogger("tinkerq.api")
PROTO = "application/x-protobuf"


@dataclass
class Deps:
    settings: ApiSettings
    producer: Producer
    state: ApiState
    waiter: AsyncResultWaiter
    metrics: Metrics
    submitter: GroupSubmitter

    async def submit(self, request: QueueRequest, request_id: str | None = None) -> Ticket:
        return await self.submitter.submit(request, request_id)


def create_app(redis_url: str, settings: ApiSettings | None = None, config: QueueConfig | None = None) -> FastAPI:
    settings = settings or ApiSettings()
    producer = Producer(Redis.from_url(redis_url), config or QueueConfig())
    async_redis = AsyncRedis.from_url(redis_url)
    deps = Deps(settings, producer, ApiState(async_redis, settings.session_ttl_s), AsyncResultWaiter(async_redis),
                Metrics(producer.queue_depths), GroupSubmitter(producer))
    if not settings.keys():
        log.warning("TINKERQ_API_KEYS is unset: API key auth is OFF; anyone who reaches this port can use it")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await deps.waiter.start()
        yield
        await deps.waiter.stop()
        producer.close()
        await async_redis.aclose()

    app = FastAPI(title="tinkerq", summary="Tinker-compatible API over a Redis/RQ job queue", lifespan=lifespan)
    app.state.deps = deps
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ObserveLatency, histogram=deps.metrics.latency)
    _install_handlers(app, deps)
    for router in _routes(deps):
        app.include_router(router)
    return app


def app_from_env() -> FastAPI:
    """The app of one `tinkerq api` process: REDIS_URL and TINKERQ_* settings from the environment."""
    return create_app(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))


def _install_handlers(app: FastAPI, deps: Deps) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code)

    @app.exception_handler(proto.BadProto)
    async def bad_proto(request: Request, exc: proto.BadProto) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request")

    @app.exception_handler(Rejected)
    async def rejected(request: Request, exc: Rejected) -> JSONResponse:
        return rejected_response(exc)

    @app.exception_handler(RedisError)
    async def redis_down(request: Request, exc: RedisError) -> JSONResponse:
        # Nothing was enqueued (or it was, and a retry with the same ids finds it): the SDK retries 503s.
        log.warning("Redis unavailable: %s", exc)
        return error_response(503, f"the job queue's Redis is unavailable ({type(exc).__name__}); retry later",
                              "queue_unavailable", {"retry-after": "1"})

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return error_response(422, f"invalid request body: {problems}", "invalid_request")



def _authorize(deps: Deps):
    async def check(request: Request) -> None:
        allowed = deps.settings.keys()
        if allowed and request.headers.get("x-api-key") not in allowed:
            raise ApiError(401, "missing or unknown X-API-Key", "unauthorized")
    return Depends(check)


def _derived_id(prefix: str, *parts: object) -> str:
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=12).hexdigest()
    return f"{prefix}-{digest}"


def _routes(deps: Deps):
    from fastapi import APIRouter

    public = APIRouter(prefix="/api/v1")
    api = APIRouter(prefix="/api/v1", dependencies=[_authorize(deps)])
    state = deps.state

    @public.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @public.get("/metrics", include_in_schema=False, response_class=Response)
    async def metrics() -> Response:
        body = await asyncio.to_thread(generate_latest, deps.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @api.post("/client/config")
    async def client_config() -> dict:
        return {"pjwt_auth_enabled": False, "fwdbwd_max_chunk_len": deps.settings.fwdbwd_max_chunk_len}

    @api.post("/client/dynamic_config")
    async def dynamic_config() -> dict:
        return {}

    @api.post("/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}

    @api.get("/get_server_capabilities")
    async def capabilities() -> dict:
        return {"supported_models": [
            {"model_name": name, "max_context_length": shape.context, "trainable": True, "sampleable": True}
            for name, shape in local_models.LOCAL_MODELS.items()
        ]}

    # -- sessions ------------------------------------------------------------------------------

    @api.post("/create_session")
    async def create_session() -> dict:
        return {"session_id": await state.create_session(), "type": "create_session"}

    async def live_session(session_id: str) -> None:
        status = await state.session_status(session_id)
        if status is None:
            raise ApiError(404, f"unknown session {session_id!r}", "unknown_session")
        if status == "finished":
            raise ApiError(410, f"session {session_id!r} is finished", "session_finished")

    @api.post("/session_heartbeat")
    async def heartbeat(body: bodies.SessionRef) -> dict:
        await live_session(body.session_id)
        await state.touch_session(body.session_id)
        return {"type": "session_heartbeat"}

    @api.post("/sessions/{session_id}/finish")
    async def finish_session(session_id: bodies.SessionId, body: bodies.FinishSession) -> dict:
        await live_session(session_id)
        await state.finish_session(session_id, str((body.reason or {}).get("type", "")))
        return {}

    # -- training ------------------------------------------------------------------------------

    async def known_model(model_id: str) -> dict:
        info = await state.model_info(model_id)
        if info is None:
            raise ApiError(404, f"unknown model {model_id!r} (create it first)", "unknown_model")
        return info

    @api.post("/create_model")
    async def create_model(body: bodies.CreateModel) -> dict:
        await live_session(body.session_id)
        if body.base_model not in local_models.LOCAL_MODELS:
            raise ApiError(404, f"base model {body.base_model!r} is not served here; see get_server_capabilities",
                           "unknown_base_model")
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        lora = LoraConfig(**body.lora_config.model_dump())
        ticket = await deps.submit(CreateModelRequest(model_id=model_id, base_model=body.base_model, lora=lora,
                                                      seq_id=0))
        return {"request_id": ticket.request_id, "model_id": model_id}

    @api.post("/get_info")
    async def get_info(body: bodies.ModelRef) -> dict:
        info = await known_model(body.model_id)
        model_data = {"arch": "qwen2", "model_name": info["base_model"]}
        tokenizer = local_models.cached_dir(info["base_model"])
        if tokenizer is not None:
            model_data["tokenizer_id"] = str(tokenizer)
        return {"type": "get_info", "model_id": body.model_id, "model_data": model_data, "is_lora": True,
                "lora_rank": info.get("lora_rank"), "model_name": info["base_model"]}

    @api.post("/forward_backward")
    async def forward_backward(request: Request) -> dict:
        message = proto.parse_forward_backward(await _proto_body(request, deps.settings.max_body_bytes))
        await known_model(message.model_id)
        try:
            kind = ForwardRequest if message.forward_only else ForwardBackwardRequest
            op = kind(model_id=message.model_id, seq_id=message.seq_id, data=proto.datums(message),
                      loss_fn=message.loss_fn, loss_fn_config=proto.loss_config(message))
        except ValidationError as exc:
            raise ApiError(400, f"invalid forward_backward: {exc}", "invalid_request") from exc
        ticket = await deps.submit(op)
        return {"request_id": ticket.request_id, "model_id": message.model_id}

    @api.post("/optim_step")
    async def optim_step(body: bodies.OptimStep) -> dict:
        await known_model(body.model_id)
        ticket = await deps.submit(OptimStepRequest(model_id=body.model_id, seq_id=body.seq_id,
                                                    adam_params=AdamParams(**body.adam_params.model_dump())))
        return {"request_id": ticket.request_id, "model_id": body.model_id}

    @api.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(body: bodies.SaveWeightsForSampler) -> dict:
        info = await known_model(body.model_id)
        ticket = await deps.submit(WeightSyncRequest(model_id=body.model_id, name=body.path, seq_id=body.seq_id))
        if body.path is not None:
            await state.name_snapshot(body.model_id, body.path, ticket.version)
            note = {"kind": "sync", "path": tinker_uri(body.model_id, "sampler_weights", body.path)}
        else:
            sampler_id = f"{body.model_id}:sample:{body.sampling_session_seq_id or 0}:{ticket.version}"
            await state.put_sampler(sampler_id, body.model_id, ticket.version, info["base_model"], None)
            note = {"kind": "sync", "sampling_session_id": sampler_id}
        await state.note(ticket.request_id, note)
        return {"request_id": ticket.request_id, "model_id": body.model_id}

    @api.post("/save_weights")
    async def save_weights(body: bodies.SaveWeights) -> dict:
        await known_model(body.model_id)
        ticket = await deps.submit(SaveStateRequest(model_id=body.model_id, seq_id=body.seq_id, name=body.path))
        await state.note(ticket.request_id, {"kind": "save_state",
                                             "path": tinker_uri(body.model_id, "weights", body.path)})
        return {"request_id": ticket.request_id, "model_id": body.model_id}

    @api.post("/load_weights")
    async def load_weights(body: bodies.LoadWeights) -> dict:
        if body.model_id is not None:  # legacy: load into an existing model, in its seq order
            await known_model(body.model_id)
            model_id, seq_id = body.model_id, body.seq_id
        elif body.session_id is not None and body.model_seq_id is not None:
            await live_session(body.session_id)
            model_id, seq_id = f"{body.session_id}:train:{body.model_seq_id}", None
        else:
            raise ApiError(400, "load_weights needs model_id, or session_id and model_seq_id", "invalid_request")
        ticket = await deps.submit(LoadStateRequest(model_id=model_id, path=body.path, optimizer=body.optimizer,
                                                    seq_id=seq_id))
        return {"request_id": ticket.request_id, "model_id": model_id}

    # -- sampling ------------------------------------------------------------------------------

    @api.post("/create_sampling_session")
    async def create_sampling_session(body: bodies.CreateSamplingSession) -> dict:
        await live_session(body.session_id)
        if body.model_path is None:
            raise ApiError(400, "sampling a bare base model is not supported; save_weights_for_sampler first",
                           "unsupported")
        model_id, version = await named_snapshot(body.model_path)
        info = await known_model(model_id)
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        await state.put_sampler(sampler_id, model_id, version, info["base_model"], body.model_path)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    async def named_snapshot(path: str) -> tuple[str, int]:
        parsed = parse_tinker_uri(path)
        version = await state.named_version(parsed[0], parsed[2]) if parsed and parsed[1] == "sampler_weights" else None
        if version is None:
            raise ApiError(404, f"no sampler weights at {path!r}", "unknown_path")
        return parsed[0], version

    @api.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: bodies.SamplerId) -> dict:
        sampler = await state.sampler(sampler_id)
        if sampler is None:
            raise ApiError(404, f"unknown sampling session {sampler_id!r}", "unknown_sampler")
        return {"sampler_id": sampler_id, "base_model": sampler["base_model"],
                "model_path": sampler["model_path"] or None}

    @api.post("/asample")
    async def asample(body: bodies.ASample) -> dict:
        sampler = await state.sampler(body.sampling_session_id)
        if sampler is None:
            raise ApiError(404, f"unknown sampling session {body.sampling_session_id!r}", "unknown_sampler")
        request = _sample_request(body, sampler)
        # The SDK resends a 429'd sample with the same seq_id: the same request id makes it idempotent.
        ticket = await deps.submit(request, _derived_id("sa", body.sampling_session_id, body.seq_id))
        ids = [f"{body.sampling_session_id}:{body.seq_id}:{i}" for i in range(body.num_samples)]
        return {"request_id": ticket.request_id, "sample_sequence_ids": ids}

    # -- futures -------------------------------------------------------------------------------

    @api.post("/retrieve_future", response_model=None)
    async def retrieve_future(body: bodies.RetrieveFuture) -> Response | dict:
        raw = await deps.waiter.wait(body.request_id, deps.settings.long_poll_s)
        if raw is None:
            if not await state.redis.exists(keys.request_key(body.request_id)):
                raise ApiError(404, f"unknown request id {body.request_id!r}", "unknown_request")
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        result = parse_result(raw)
        deps.metrics.results.labels(result.type, result.code if isinstance(result, ErrorResponse) else "ok").inc()
        # Only syncs and saves need what the API noted at submit (paths, sampling session ids).
        note = await state.get_note(body.request_id) if result.type in ("weight_sync", "save_state") else {}
        return _render(result, note or {})

    return [public, api]


async def _proto_body(request: Request, limit: int) -> bytes:
    if PROTO not in request.headers.get("content-type", ""):
        raise ApiError(415, f"forward_backward takes a {PROTO} body", "unsupported_media_type")
    body = await request.body()
    encoding = request.headers.get("content-encoding", "").lower()
    if encoding == "zstd":
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=limit)
        except zstandard.ZstdError as exc:
            raise ApiError(400, f"the zstd body does not decompress (or exceeds {limit} bytes): {exc}",
                           "invalid_encoding") from exc
    elif encoding not in ("", "identity"):
        raise ApiError(415, f"unsupported content-encoding {encoding!r}", "unsupported_media_type")
    return body


def _sample_request(body: bodies.ASample, sampler: dict[str, str]) -> SampleRequest:
    unsupported = {"topk_sample_logprobs": body.topk_sample_logprobs, "prompt_alt_tokens_k": body.prompt_alt_tokens_k,
                   "target_prompt_logprobs": body.target_prompt_logprobs,
                   "prompt_logprobs_last_n": body.prompt_logprobs_last_n}
    asked = [name for name, value in unsupported.items() if value]
    if asked:
        raise ApiError(400, f"not supported by this server: {', '.join(asked)}", "unsupported")
    if any(chunk.type != "encoded_text" for chunk in body.prompt.chunks):
        raise ApiError(400, "only encoded_text prompt chunks are supported", "unsupported")
    params = body.sampling_params
    if params.max_tokens is None:
        raise ApiError(400, "sampling_params.max_tokens is required", "invalid_request")
    try:
        return SampleRequest(
            model_id=sampler["model_id"], weights_version=int(sampler["version"]),
            prompt_tokens=[t for chunk in body.prompt.chunks for t in chunk.tokens],
            num_samples=body.num_samples, prompt_logprobs=body.prompt_logprobs,
            topk_prompt_logprobs=body.topk_prompt_logprobs,
            sampling_params=SamplingParams(max_tokens=params.max_tokens, seed=params.seed, stop=params.stop,
                                           temperature=params.temperature, top_k=params.top_k, top_p=params.top_p),
        )
    except ValidationError as exc:
        raise ApiError(400, f"invalid sample request: {exc}", "invalid_request") from exc


def _render(result, note: dict) -> Response | dict:
    match result.type:
        case "error":
            category = "user" if result.status < 500 else "server"
            return JSONResponse({"error": f"{result.code}: {result.error}", "category": category})
        case "sample":
            return Response(proto.encode_sample(result), media_type=PROTO)
        case "forward_backward":
            return Response(proto.encode_forward_backward(result), media_type=PROTO)
        case "create_model":
            return {"model_id": result.model_id, "type": "create_model"}
        case "optim_step":
            return {"metrics": result.metrics}
        case "weight_sync":
            return {"type": "save_weights_for_sampler", "path": note.get("path"),
                    "sampling_session_id": note.get("sampling_session_id")}
        case "save_state":
            return {"path": note["path"], "type": "save_weights"}
        case "load_state":
            return {"model_id": result.model_id, "path": result.path, "type": "load_weights"}
    raise ApiError(500, f"cannot render a {result.type} result", "internal_error")
