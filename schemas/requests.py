"""Request types: what a producer enqueues and a worker executes."""

import hashlib
import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from schemas.arrays import ArrayEquality, InputArray, TokenArray
from schemas.ids import CHECKPOINT_NAME, CHECKPOINT_NAME_PATTERN, SEQUENCE_ID_PATTERN, ModelId, base_model_id


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
    # Set: sample the bare base model (no adapter, version 0), under model_id = base_model_id(base_model).
    base_model: str | None = Field(None, min_length=1, max_length=256)
    # Set (record_stability_info): the sequence id of each sample, under which the worker records its prompt,
    # tokens and logprobs for stable_reinforce training to name later.
    record_as: list[Annotated[str, Field(pattern=SEQUENCE_ID_PATTERN)]] | None = None

    @model_validator(mode="after")
    def _one_sequence_id_per_sample(self) -> "SampleRequest":
        if self.record_as is not None and len(self.record_as) != self.num_samples:
            raise ValueError(f"record_as names {len(self.record_as)} sequences for {self.num_samples} samples")
        return self

    @model_validator(mode="after")
    def _base_sample_routes_by_its_base(self) -> "SampleRequest":
        if self.base_model is not None:
            if self.model_id != base_model_id(self.base_model):
                raise ValueError(f"a base-model sample has model_id {base_model_id(self.base_model)!r}")
            if self.weights_version not in (None, 0):
                raise ValueError("a base-model sample is served from the base weights: weights_version 0")
        return self

    @classmethod
    def of_base(cls, base_model: str, **fields: Any) -> "SampleRequest":
        return cls(model_id=base_model_id(base_model), base_model=base_model, weights_version=0, **fields)


class WeightSyncRequest(_Strict):
    kind: Literal["weight_sync"] = "weight_sync"
    model_id: ModelId
    # A name persists a full HF-format snapshot; without one the sync is transient (in memory only).
    name: str | None = Field(None, pattern=CHECKPOINT_NAME_PATTERN)
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


class Datum(ArrayEquality, _Strict):
    """One training example: position i of model_input predicts target_tokens[i]."""

    # Arrays (schemas/arrays.py): given as lists, numpy arrays or the packed form; held as read-only numpy arrays.
    model_input: TokenArray
    loss_fn_inputs: dict[str, InputArray] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _aligned(self) -> "Datum":
        n = len(self.model_input)
        if n == 0:
            raise ValueError("model_input has no tokens")
        for name, values in self.loss_fn_inputs.items():
            if len(values) != n:
                raise ValueError(f"loss_fn_inputs[{name!r}] has {len(values)} entries, model_input has {n}")
        return self


# Per-token inputs the API fills from a stable_reinforce datum's provenance spans (see producer/api/provenance.py)
STABLE_MASK = "tq_sampled_mask"  # 1 where the target is a token the named sequence sampled
STABLE_LOGPROBS = "tq_sampled_logprobs"  # the sampler's own logprob of it, as recorded at sampling time

LossFn = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce", "custom"]


class CustomLossInput(_Strict):
    name: str = Field(pattern=r"^[a-z_][a-z0-9_]{0,63}$")
    rank: Literal[0, 1, 2]


class CustomLoss(_Strict):
    """A loss the client traced (the SDK's CustomLossGraph) and the inputs it reads, `logprobs` first. It is
    data: the worker rebuilds it from its own table of allowed operations (torch_runtime/custom_loss.py)."""

    name: str = Field(min_length=1, max_length=128)
    inputs: list[CustomLossInput] = Field(min_length=1, max_length=16)
    graph: dict[str, Any]

    @property
    def loss_id(self) -> str:
        """Content-addressed: the same traced loss has the same id."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return "loss-" + hashlib.blake2b(canonical.encode(), digest_size=12).hexdigest()


CHECKPOINT_ID_PATTERN = rf"^(weights|sampler_weights)/{CHECKPOINT_NAME}$"


class DeleteCheckpointRequest(_TrainingOp):
    """Delete one of the model's saved checkpoints ("weights/<name>" or "sampler_weights/<name>")."""

    kind: Literal["delete_checkpoint"] = "delete_checkpoint"
    checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)


class CreateCustomLossRequest(_Strict):
    """Check a custom loss on a worker (it compiles it) before forward_backward(loss_fn="custom") uses it.
    Routed by `model_id` = losses_model_id(session), runs in queue order."""

    kind: Literal["create_custom_loss"] = "create_custom_loss"
    model_id: ModelId
    loss: CustomLoss
    seq_id: None = None


class ForwardRequest(_TrainingOp):
    kind: Literal["forward"] = "forward"
    data: list[Datum] = Field(min_length=1)
    loss_fn: LossFn = "cross_entropy"
    loss_fn_config: dict[str, float] = Field(default_factory=dict)
    # loss_fn="custom": the loss (as created by create_custom_loss), carried along so the job is self-contained
    custom_loss: CustomLoss | None = None
    # The producer reads the result's arrays in the packed form (schemas/arrays.py). Producers before that form
    # leave it out, and get number lists.
    packed_results: bool = False

    @model_validator(mode="after")
    def _custom_loss_given_for_custom(self) -> "ForwardRequest":
        if (self.loss_fn == "custom") != (self.custom_loss is not None):
            raise ValueError("loss_fn 'custom' comes with its custom_loss, and only it does")
        return self


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
    name: str = Field(pattern=CHECKPOINT_NAME_PATTERN)
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
        CreateCustomLossRequest,
        DeleteCheckpointRequest,
    ],
    Field(discriminator="kind"),
]

_REQUEST_ADAPTER: TypeAdapter[Request] = TypeAdapter(Request)

def parse_request(payload: Any) -> Request:
    """Validate a JSON-decoded payload into its request type (raises pydantic.ValidationError)."""
    return _REQUEST_ADAPTER.validate_python(payload)


def seq_id_of(request: Request) -> int | None:
    """A sequenced op's seq_id; None for an op that runs in queue order, and for samples (they carry none)."""
    return getattr(request, "seq_id", None)
