"""JSON bodies the Tinker SDK sends (extra fields are ignored, as the SDK adds some freely), each able to turn
itself into the queue request it asks for. A body the queue's schemas refuse raises pydantic's ValidationError,
which the app answers with a 400 that says why."""

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from producer.api.http_errors import ApiError
from schemas import (
    AdamParams,
    CreateCustomLossRequest,
    CreateModelRequest,
    CustomLoss,
    LoadStateRequest,
    LoraConfig,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    SaveStateRequest,
    WeightSyncRequest,
)
from schemas.ids import CHECKPOINT_NAME_PATTERN, ID_PATTERN, MODEL_ID_PATTERN, losses_model_id

SessionId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
ModelId = Annotated[str, StringConstraints(pattern=MODEL_ID_PATTERN)]
SamplerId = Annotated[str, StringConstraints(pattern=MODEL_ID_PATTERN)]
Name = Annotated[str, StringConstraints(pattern=CHECKPOINT_NAME_PATTERN)]
TinkerPath = Annotated[str, StringConstraints(max_length=512, pattern=r"^tinker://")]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SessionRef(Body):
    session_id: SessionId


class CreateSession(Body):
    user_metadata: dict[str, Any] | None = None
    display_name: str | None = Field(None, max_length=256)


class FinishSession(Body):
    reason: dict[str, Any] | None = None


class LoraConfigBody(Body):
    rank: int = Field(32, ge=1, le=1024)
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class CreateModel(Body):
    session_id: SessionId
    model_seq_id: int = Field(ge=0)
    base_model: str = Field(min_length=1, max_length=256)
    lora_config: LoraConfigBody = LoraConfigBody()
    user_metadata: dict[str, Any] | None = None

    @property
    def model_id(self) -> str:
        return f"{self.session_id}:train:{self.model_seq_id}"  # as the SDK computes it

    def to_request(self) -> CreateModelRequest:
        return CreateModelRequest(model_id=self.model_id, base_model=self.base_model,
                                  lora=LoraConfig(**self.lora_config.model_dump()), seq_id=0)


class ModelRef(Body):
    model_id: ModelId


class AdamParamsBody(Body):
    """What the SDK sends; what it leaves out takes the queue's defaults (schemas.AdamParams)."""

    learning_rate: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    grad_clip_norm: float | None = None


class OptimStep(Body):
    model_id: ModelId
    seq_id: int = Field(ge=0)
    adam_params: AdamParamsBody = AdamParamsBody()

    def to_request(self) -> OptimStepRequest:
        return OptimStepRequest(model_id=self.model_id, seq_id=self.seq_id,
                                adam_params=AdamParams(**self.adam_params.model_dump(exclude_none=True)))


class SaveWeightsForSampler(Body):
    model_id: ModelId
    seq_id: int | None = Field(None, ge=0)
    path: Name | None = None
    sampling_session_seq_id: int | None = Field(None, ge=0)

    def to_request(self) -> WeightSyncRequest:
        return WeightSyncRequest(model_id=self.model_id, name=self.path, seq_id=self.seq_id)


class SaveWeights(Body):
    model_id: ModelId
    seq_id: int | None = Field(None, ge=0)
    path: Name

    def to_request(self) -> SaveStateRequest:
        return SaveStateRequest(model_id=self.model_id, seq_id=self.seq_id, name=self.path)


class LoadWeights(Body):
    path: TinkerPath
    optimizer: bool = False
    # create-via-load (the model's seq 0) names the session; the legacy form names the model
    session_id: SessionId | None = None
    model_seq_id: int | None = Field(None, ge=0)
    model_id: ModelId | None = None
    seq_id: int | None = Field(None, ge=0)
    user_metadata: dict[str, Any] | None = None

    def to_request(self) -> LoadStateRequest:
        """Into the named model in its seq order (legacy), or create-via-load: the new model's seq 0."""
        if self.model_id is not None:
            return LoadStateRequest(model_id=self.model_id, path=self.path, optimizer=self.optimizer,
                                    seq_id=self.seq_id)
        return LoadStateRequest(model_id=f"{self.session_id}:train:{self.model_seq_id}", path=self.path,
                                optimizer=self.optimizer)


class CustomLossInputBody(Body):
    name: str
    rank: int


class CreateCustomLoss(Body):
    session_id: SessionId
    custom_loss_seq_id: int = Field(ge=0)
    name: str = Field(min_length=1, max_length=128)
    inputs: list[CustomLossInputBody] = Field(min_length=1, max_length=16)
    graph: dict[str, Any]

    def to_loss(self) -> CustomLoss:
        return CustomLoss(name=self.name, inputs=[i.model_dump() for i in self.inputs], graph=self.graph)

    def to_request(self, loss: CustomLoss) -> CreateCustomLossRequest:
        return CreateCustomLossRequest(model_id=losses_model_id(self.session_id), loss=loss)


class CreateSamplingSession(Body):
    session_id: SessionId
    sampling_session_seq_id: int = Field(ge=0)
    model_path: TinkerPath | None = None
    base_model: str | None = None


class Chunk(Body):
    type: str = "encoded_text"
    tokens: list[Annotated[int, Field(ge=0)]] = []


class ModelInput(Body):
    chunks: list[Chunk] = Field(min_length=1)


class SamplingParamsBody(Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class ASample(Body):
    sampling_session_id: SamplerId
    seq_id: int = Field(ge=0)
    num_samples: int = Field(1, ge=1)
    prompt: ModelInput
    sampling_params: SamplingParamsBody
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0)
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int | None = None
    target_prompt_logprobs: Any = None
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None

    @property
    def sequence_ids(self) -> list[str]:
        """One id per sample, in result order (the SDK's SampledSequence.sequence_id)."""
        return [f"{self.sampling_session_id}:{self.seq_id}:{i}" for i in range(self.num_samples)]

    def to_request(self, sampler: dict[str, str]) -> SampleRequest:
        """The sample, served from the snapshot of `sampler` (a sampling session's record)."""
        unsupported = {"topk_sample_logprobs": self.topk_sample_logprobs,
                       "prompt_alt_tokens_k": self.prompt_alt_tokens_k,
                       "target_prompt_logprobs": self.target_prompt_logprobs,
                       "prompt_logprobs_last_n": self.prompt_logprobs_last_n}
        asked = [name for name, value in unsupported.items() if value]
        if asked:
            raise ApiError(400, f"not supported by this server: {', '.join(asked)}", "unsupported")
        if any(chunk.type != "encoded_text" for chunk in self.prompt.chunks):
            raise ApiError(400, "only encoded_text prompt chunks are supported", "unsupported")
        params = self.sampling_params
        if params.max_tokens is None:
            raise ApiError(400, "sampling_params.max_tokens is required", "invalid_request")
        return SampleRequest(
            model_id=sampler["model_id"], weights_version=int(sampler["version"]),
            base_model=sampler["base_model"] if sampler.get("bare") == "1" else None,
            prompt_tokens=[t for chunk in self.prompt.chunks for t in chunk.tokens],
            num_samples=self.num_samples, prompt_logprobs=self.prompt_logprobs,
            topk_prompt_logprobs=self.topk_prompt_logprobs,
            record_as=self.sequence_ids if self.record_stability_info else None,
            sampling_params=SamplingParams(max_tokens=params.max_tokens, seed=params.seed, stop=params.stop,
                                           temperature=params.temperature, top_k=params.top_k, top_p=params.top_p),
        )


class RetrieveFuture(Body):
    request_id: Annotated[str, StringConstraints(pattern=ID_PATTERN)]
    allow_metadata_only: bool = False
