"""Result types: exactly one of these is stored per request."""

import math
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_serializer, field_validator

from schemas.arrays import ArrayEquality, OutputArray


class _Out(BaseModel):
    # A non-finite output (a loss that overflows, a NaN metric) is stored as the JSON string "Infinity",
    # "-Infinity" or "NaN", which parse_result reads back as the float (pydantic's default would write null,
    # which no float field parses).
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")


class GeneratedSequence(_Out):
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


class TopkLogprobs(_Out):
    """Row-major [len(prompt), k] top-k prompt logprobs; row 0 (no context) is empty."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]


def _nan_to_none(values: list[float | None] | None) -> list[float | None] | None:
    if values is None:
        return None
    return [None if v is None or math.isnan(v) else v for v in values]


class SampleOutput(_Out):
    type: Literal["sample"] = "sample"
    sequences: list[GeneratedSequence]
    # Same length as the prompt; position 0 has no context and is None.
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: TopkLogprobs | None = None
    weights_version: int

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _nan_is_missing(cls, values: Any) -> Any:
        return _nan_to_none(values) if isinstance(values, list) else values


class WeightSyncOutput(_Out):
    type: Literal["weight_sync"] = "weight_sync"
    model_id: str
    version: int
    persisted: bool
    path: str | None = None
    # False when this sync was a replay of one already applied (idempotent no-op).
    applied: bool = True


class CreateModelOutput(_Out):
    type: Literal["create_model"] = "create_model"
    model_id: str
    base_model: str
    lora_rank: int | None = None


class ForwardBackwardOutput(ArrayEquality, _Out):
    type: Literal["forward_backward"] = "forward_backward"
    # One dict per datum, in input order: name -> per-token values (at least "logprobs"), as arrays
    # (schemas/arrays.py).
    loss_fn_outputs: list[dict[str, OutputArray]]
    # Keys are "name:reduction" (e.g. "loss:sum"), as the Tinker client merges them by suffix.
    metrics: dict[str, float]

    @field_validator("metrics")
    @classmethod
    def _metric_keys(cls, metrics: dict[str, float]) -> dict[str, float]:
        for key in metrics:
            if key.count(":") != 1:
                raise ValueError(f"metric key {key!r} must be 'name:reduction'")
        return metrics


class OptimStepOutput(_Out):
    type: Literal["optim_step"] = "optim_step"
    metrics: dict[str, float] = Field(default_factory=dict)


class SaveStateOutput(_Out):
    type: Literal["save_state"] = "save_state"
    path: str
    include_optimizer: bool


class LoadStateOutput(_Out):
    type: Literal["load_state"] = "load_state"
    model_id: str
    path: str
    optimizer: bool
    base_model: str | None = None
    lora_rank: int | None = None


class CreateCustomLossOutput(_Out):
    type: Literal["create_custom_loss"] = "create_custom_loss"
    loss_id: str


class DeleteCheckpointOutput(_Out):
    type: Literal["delete_checkpoint"] = "delete_checkpoint"
    checkpoint_id: str
    deleted: bool  # False: it was not there (deleted before, or never saved)


class CheckpointRecord(_Out):
    """What the worker registers of a saved checkpoint, for the REST API's listings."""

    time: float
    size_bytes: int | None = None


class ErrorResponse(_Out):
    type: Literal["error"] = "error"
    error: str
    status: int = Field(ge=400, le=599)
    code: str
    retryable: bool = False

    @field_serializer("error")
    def _bounded(self, error: str) -> str:
        return error[:4000]


Result = Annotated[
    Union[
        SampleOutput,
        WeightSyncOutput,
        CreateModelOutput,
        ForwardBackwardOutput,
        OptimStepOutput,
        SaveStateOutput,
        LoadStateOutput,
        CreateCustomLossOutput,
        DeleteCheckpointOutput,
        ErrorResponse,
    ],
    Field(discriminator="type"),
]

_RESULT_ADAPTER: TypeAdapter[Result] = TypeAdapter(Result)


def parse_result(raw: str | bytes) -> Result:
    return _RESULT_ADAPTER.validate_json(raw)


class RecordedSequence(_Out):
    """What a sampler records of one sequence when asked to (record_stability_info): what stable_reinforce
    training reads back through the datum's provenance spans."""

    tokens: list[int]
    logprobs: list[float]
