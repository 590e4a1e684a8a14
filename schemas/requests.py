"""Request types: what a producer enqueues and a worker executes."""

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from schemas.ids import ModelId


class _Strict(BaseModel):
    # NaN and inf are refused in every float of a request (loss inputs, advantages, loss and optimizer
    # settings): they would only come back as NaN losses and gradients, or poison a model's weights.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class SamplingParams(_Strict):
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    max_tokens: int = Field(16, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # None: stop at EOS. []: never stop early, not even at EOS. Strings or token ids, never mixed.
    stop: list[str] | list[int] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_not_mixed(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value:
            kinds = {type(v) for v in value}
            if len(kinds) > 1 or kinds - {str, int}:
                raise ValueError("stop must be all strings or all token ids, not a mix")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return value


class SampleRequest(_Strict):
    kind: Literal["sample"] = "sample"
    model_id: ModelId
    prompt_tokens: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    num_samples: int = Field(1, ge=1)
    sampling_params: SamplingParams = SamplingParams()
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0)
    # The snapshot this sample must be served from. The producer fills it with the model's latest
    # enqueued sync when the caller leaves it out, so FIFO order gives "sync before later samples".
    weights_version: int | None = Field(None, ge=0)


class WeightSyncRequest(_Strict):
    kind: Literal["weight_sync"] = "weight_sync"
    model_id: ModelId
    # A name persists a full HF-format snapshot; without one the sync is transient (in memory only).
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    # Assigned by the producer at enqueue (INCR); callers never set it.
    version: int | None = Field(None, ge=1)
    # Tinker sends syncs in its training seq_id order; None runs it in queue order.
    seq_id: int | None = Field(None, ge=0)

    @property
    def persist(self) -> bool:
        return self.name is not None


class LoraConfig(_Strict):
    rank: int = Field(32, ge=1, le=1024)
    alpha: float | None = None
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    @model_validator(mode="after")
    def _something_trains(self) -> "LoraConfig":
        if not (self.train_mlp or self.train_attn or self.train_unembed):
            raise ValueError("at least one of train_mlp, train_attn, train_unembed must be true")
        return self


class _TrainingOp(_Strict):
    model_id: ModelId
    # Training ops of a model run in seq_id order; None means "run in queue order".
    seq_id: int | None = Field(None, ge=0)


class CreateModelRequest(_TrainingOp):
    kind: Literal["create_model"] = "create_model"
    base_model: str = Field(min_length=1, max_length=256)
    lora: LoraConfig | None = LoraConfig()


class Datum(_Strict):
    """One training example: position i of model_input predicts target_tokens[i]."""

    model_input: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    loss_fn_inputs: dict[str, list[float]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _aligned(self) -> "Datum":
        n = len(self.model_input)
        for name, values in self.loss_fn_inputs.items():
            if len(values) != n:
                raise ValueError(f"loss_fn_inputs[{name!r}] has {len(values)} entries, model_input has {n}")
        return self


LossFn = Literal["cross_entropy", "importance_sampling", "ppo", "cispo"]


class ForwardRequest(_TrainingOp):
    kind: Literal["forward"] = "forward"
    data: list[Datum] = Field(min_length=1)
    loss_fn: LossFn = "cross_entropy"
    loss_fn_config: dict[str, float] = Field(default_factory=dict)


class ForwardBackwardRequest(ForwardRequest):
    kind: Literal["forward_backward"] = "forward_backward"  # type: ignore[assignment]


class AdamParams(_Strict):
    learning_rate: float = Field(1e-4, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-12, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip_norm: float = Field(0.0, ge=0.0, description="0 disables clipping")


class OptimStepRequest(_TrainingOp):
    kind: Literal["optim_step"] = "optim_step"
    adam_params: AdamParams = AdamParams()


class SaveStateRequest(_TrainingOp):
    kind: Literal["save_state"] = "save_state"
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    include_optimizer: bool = True


class LoadStateRequest(_TrainingOp):
    kind: Literal["load_state"] = "load_state"
    path: str = Field(min_length=1, max_length=1024)
    optimizer: bool = False
    base_model: str | None = None


Request = Annotated[
    Union[
        SampleRequest,
        WeightSyncRequest,
        CreateModelRequest,
        ForwardRequest,
        ForwardBackwardRequest,
        OptimStepRequest,
        SaveStateRequest,
        LoadStateRequest,
    ],
    Field(discriminator="kind"),
]

_REQUEST_ADAPTER: TypeAdapter[Request] = TypeAdapter(Request)

def parse_request(payload: Any) -> Request:
    """Validate a JSON-decoded payload into its request type (raises pydantic.ValidationError)."""
    return _REQUEST_ADAPTER.validate_python(payload)
