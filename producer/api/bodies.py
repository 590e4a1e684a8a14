"""JSON bodies the Tinker SDK sends (extra fields are ignored, as the SDK adds some freely)."""

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from schemas.ids import ID_PATTERN, MODEL_ID_PATTERN

SessionId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
ModelId = Annotated[str, StringConstraints(pattern=MODEL_ID_PATTERN)]
SamplerId = Annotated[str, StringConstraints(pattern=MODEL_ID_PATTERN)]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,128}$")]
TinkerPath = Annotated[str, StringConstraints(max_length=512, pattern=r"^tinker://")]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SessionRef(Body):
    session_id: SessionId


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


class ModelRef(Body):
    model_id: ModelId


class AdamParamsBody(Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(Body):
    model_id: ModelId
    seq_id: int = Field(ge=0)
    adam_params: AdamParamsBody = AdamParamsBody()


class SaveWeightsForSampler(Body):
    model_id: ModelId
    seq_id: int | None = Field(None, ge=0)
    path: Name | None = None
    sampling_session_seq_id: int | None = Field(None, ge=0)


class SaveWeights(Body):
    model_id: ModelId
    seq_id: int | None = Field(None, ge=0)
    path: Name


class LoadWeights(Body):
    path: TinkerPath
    optimizer: bool = False
    # create-via-load (the model's seq 0) names the session; the legacy form names the model
    session_id: SessionId | None = None
    model_seq_id: int | None = Field(None, ge=0)
    model_id: ModelId | None = None
    seq_id: int | None = Field(None, ge=0)


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


class RetrieveFuture(Body):
    request_id: Annotated[str, StringConstraints(pattern=ID_PATTERN)]
    allow_metadata_only: bool = False
