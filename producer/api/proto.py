"""Protobuf bodies of the Tinker wire protocol (schema imported from the `tinker` package)."""

import math

import numpy as np
import zstandard
from fastapi import Request
from google.protobuf.message import DecodeError
from pydantic import ValidationError
from tinker.proto import tinker_public_pb2 as pb

from producer.api.http_errors import ApiError
from schemas import CustomLoss, Datum, ForwardBackwardOutput, ForwardBackwardRequest, ForwardRequest, SampleOutput

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
TOPK_EMPTY_LOGPROB = -99999.0
MEDIA_TYPE = "application/x-protobuf"


class BadProto(ValueError):
    """The body is not a usable ForwardBackwardRequest; the message says why."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request's protobuf body, zstd-decompressed if so encoded (to at most `limit` bytes)."""
    if MEDIA_TYPE not in request.headers.get("content-type", ""):
        raise ApiError(415, f"forward_backward takes a {MEDIA_TYPE} body", "unsupported_media_type")
    body = await request.body()
    encoding = request.headers.get("content-encoding", "").lower()
    if encoding == "zstd":
        try:
            return zstandard.ZstdDecompressor().decompress(body, max_output_size=limit)
        except zstandard.ZstdError as exc:
            raise ApiError(400, f"the zstd body does not decompress (or exceeds {limit} bytes): {exc}",
                           "invalid_encoding") from exc
    if encoding not in ("", "identity"):
        raise ApiError(415, f"unsupported content-encoding {encoding!r}", "unsupported_media_type")
    return body


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as exc:
        raise BadProto(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    return message


def to_request(message: pb.ForwardBackwardRequest, data: list[Datum] | None = None,
               custom: CustomLoss | None = None) -> ForwardRequest:
    """The queue request a forward / forward_backward message asks for (with `data` for its datums and the
    `custom` loss that loss_fn="custom" names, if given)."""
    kind = ForwardRequest if message.forward_only else ForwardBackwardRequest
    try:
        return kind(model_id=message.model_id, seq_id=message.seq_id, data=data or datums(message),
                    loss_fn=message.loss_fn, loss_fn_config=loss_config(message), custom_loss=custom)
    except ValidationError as exc:
        raise ApiError(400, f"invalid forward_backward: {exc}", "invalid_request") from exc


def datums(message: pb.ForwardBackwardRequest) -> list[Datum]:
    return [_datum(i, d) for i, d in enumerate(message.data)]


def _datum(index: int, datum: pb.Datum) -> Datum:
    chunks = []
    for chunk in datum.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise BadProto(f"data[{index}]: only encoded_text chunks are supported")
        if len(chunk.encoded_text.tokens) % 4:
            raise BadProto(f"data[{index}]: encoded_text.tokens is not an int32 array")
        chunks.append(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4"))
    # arrays all the way (schemas/arrays.py): a view of the message's bytes where there is one chunk
    tokens = chunks[0] if len(chunks) == 1 else np.concatenate(chunks) if chunks else np.zeros(0, "<i4")
    inputs = {name: _tensor(index, name, tensor, len(tokens)) for name, tensor in datum.loss_fn_inputs.items()}
    try:
        return Datum(model_input=tokens, loss_fn_inputs=inputs)
    except ValueError as exc:
        raise BadProto(f"data[{index}]: {exc}") from exc


def _tensor(index: int, name: str, tensor: pb.Tensor, length: int) -> np.ndarray:
    where = f"data[{index}].loss_fn_inputs[{name!r}]"
    if tensor.WhichOneof("encoding") != "dense":
        raise BadProto(f"{where}: only dense tensors are supported")
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise BadProto(f"{where}: unsupported dtype {tensor.dtype}")
    if len(tensor.dense) % np.dtype(dtype).itemsize:
        raise BadProto(f"{where}: {len(tensor.dense)} bytes is not a whole number of {np.dtype(dtype).name}")
    values = np.frombuffer(tensor.dense, dtype=np.dtype(dtype).newbyteorder("<"))
    if list(tensor.shape) not in ([], [length]) or values.size != length:
        raise BadProto(f"{where}: expected one value per model_input token ({length}), got shape "
                       f"{list(tensor.shape)} with {values.size} values")
    return values


def custom_loss_id(message: pb.ForwardBackwardRequest) -> str:
    """The id a loss_fn="custom" request names (loss_fn_config {"loss_id": ...}, from create_custom_loss)."""
    value = message.loss_fn_config_v2.get("loss_id")
    if value is None or value.WhichOneof("value") != "text":
        raise BadProto("loss_fn 'custom' needs loss_fn_config['loss_id'], the id create_custom_loss returned")
    return value.text


def loss_config(message: pb.ForwardBackwardRequest) -> dict[str, float]:
    """The numeric loss config (a custom loss's id is not part of it)."""
    if message.loss_fn_config_v2:
        config = {}
        for key, value in message.loss_fn_config_v2.items():
            if key == "loss_id" and message.loss_fn == "custom":
                continue
            kind = value.WhichOneof("value")
            try:
                config[key] = value.number if kind == "number" else float(value.text)
            except ValueError as exc:
                raise BadProto(f"loss_fn_config[{key!r}] must be a number, got {value.text!r}") from exc
        return config
    return dict(message.loss_fn_config)


def encode_forward_backward(output: ForwardBackwardOutput) -> bytes:
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=output.metrics)
    record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(output.loss_fn_outputs))
    names = output.loss_fn_outputs[0].keys() if output.loss_fn_outputs else ()
    for name in names:
        arrays = [np.asarray(d[name], dtype="<f4") for d in output.loss_fn_outputs]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype("<i8")
        record.fields[name].data = np.concatenate(arrays).tobytes()
        record.fields[name].offsets = offsets.tobytes()
        record.fields[name].dtype = pb.DTYPE_FLOAT32
    return message.SerializeToString()


def encode_sample(output: SampleOutput) -> bytes:
    message = pb.SampleResponse()
    for seq in output.sequences:
        message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        )
    if output.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in output.prompt_logprobs]
        message.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    if output.topk_prompt_logprobs is not None:
        top = output.topk_prompt_logprobs
        prompt_length = len(top.token_ids)  # one row per prompt position
        k = max((len(row) for row in top.token_ids), default=0)
        ids = np.zeros((prompt_length, k), dtype="<i4")
        lps = np.full((prompt_length, k), TOPK_EMPTY_LOGPROB, dtype="<f4")
        for row, (row_ids, row_lps) in enumerate(zip(top.token_ids, top.logprobs)):
            ids[row, : len(row_ids)] = row_ids
            lps[row, : len(row_lps)] = row_lps
        message.topk_prompt_logprobs.CopyFrom(pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(),
                                                              k=k, length=prompt_length))
    return message.SerializeToString()
