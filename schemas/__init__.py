"""Pure data types shared by producers and workers. No I/O lives here."""

from schemas.ids import ID_PATTERN, MODEL_ID_PATTERN, new_request_id
from schemas.limits import LimitExceeded, Limits
from schemas.requests import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateRequest,
    LoraConfig,
    OptimStepRequest,
    Request,
    SampleRequest,
    SamplingParams,
    SaveStateRequest,
    WeightSyncRequest,
    parse_request,
)
from schemas.results import (
    CreateModelOutput,
    ErrorResponse,
    ForwardBackwardOutput,
    GeneratedSequence,
    LoadStateOutput,
    OptimStepOutput,
    Result,
    SampleOutput,
    SaveStateOutput,
    TopkLogprobs,
    WeightSyncOutput,
    parse_result,
)

__all__ = [
    "ID_PATTERN", "MODEL_ID_PATTERN", "new_request_id", "LimitExceeded", "Limits",
    "AdamParams", "CreateModelRequest", "Datum", "ForwardBackwardRequest", "ForwardRequest",
    "LoadStateRequest", "LoraConfig", "OptimStepRequest", "Request", "SampleRequest",
    "SamplingParams", "SaveStateRequest", "WeightSyncRequest", "parse_request",
    "CreateModelOutput", "ErrorResponse", "ForwardBackwardOutput", "GeneratedSequence",
    "LoadStateOutput", "OptimStepOutput", "Result", "SampleOutput", "SaveStateOutput",
    "TopkLogprobs", "WeightSyncOutput", "parse_result",
]
