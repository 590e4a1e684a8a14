"""Pure data types shared by producers and workers. No I/O lives here."""

from schemas.ids import ID_PATTERN, MODEL_ID_PATTERN, is_request_id, new_request_id
from schemas.limits import LimitExceeded, Limits
from schemas.requests import (
    AdamParams,
    CreateCustomLossRequest,
    CreateModelRequest,
    CustomLoss,
    Datum,
    DeleteCheckpointRequest,
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
    seq_id_of,
)
from schemas.results import (
    CheckpointRecord,
    CreateCustomLossOutput,
    CreateModelOutput,
    DeleteCheckpointOutput,
    ErrorResponse,
    ForwardBackwardOutput,
    GeneratedSequence,
    LoadStateOutput,
    OptimStepOutput,
    RecordedSequence,
    Result,
    SampleOutput,
    SaveStateOutput,
    TopkLogprobs,
    WeightSyncOutput,
    parse_result,
)

__all__ = [
    "ID_PATTERN", "MODEL_ID_PATTERN", "is_request_id", "new_request_id", "LimitExceeded", "Limits",
    "AdamParams", "CreateCustomLossRequest", "CreateModelRequest", "CustomLoss", "DeleteCheckpointRequest", "Datum",
    "ForwardBackwardRequest", "ForwardRequest",
    "LoadStateRequest", "LoraConfig", "OptimStepRequest", "Request", "SampleRequest",
    "SamplingParams", "SaveStateRequest", "WeightSyncRequest", "parse_request", "seq_id_of",
    "CheckpointRecord", "CreateCustomLossOutput", "DeleteCheckpointOutput", "CreateModelOutput", "ErrorResponse",
    "ForwardBackwardOutput", "GeneratedSequence",
    "LoadStateOutput", "OptimStepOutput", "RecordedSequence", "Result", "SampleOutput", "SaveStateOutput",
    "TopkLogprobs", "WeightSyncOutput", "parse_result",
]
