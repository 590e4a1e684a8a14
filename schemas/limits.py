"""Configured bounds on what a request may ask for, checked before anything reaches a GPU."""

from pydantic import BaseModel, ConfigDict, Field

from schemas.requests import ForwardRequest, Request, SampleRequest


class LimitExceeded(ValueError):
    """A request asks for more than the deployment allows. The message names field and limit."""

    def __init__(self, field: str, value: int, limit: int, env: str) -> None:
        self.field, self.value, self.limit = field, value, limit
        super().__init__(f"{field}={value} exceeds the limit of {limit} (set by {env})")


class Limits(BaseModel):
    """Plain data: the defaults suit a single small GPU. A deployment sets them as TINKERQ_* environment
    variables, read by `tinkerq.config.LimitsConfig` (the one place that reads them)."""

    model_config = ConfigDict(frozen=True)

    max_num_samples: int = Field(128, description="Samples one sample request may ask for (num_samples).")
    max_tokens: int = Field(4096, description="Tokens one sample may generate (sampling_params.max_tokens).")
    max_prompt_tokens: int = Field(32768, description=(
        "Tokens of one prompt, and of one datum's model_input in a forward or forward_backward."))
    max_topk: int = Field(20, description="Top-k prompt logprobs a sample request may ask for (topk_prompt_logprobs).")
    max_tokens_per_request: int = Field(262144, description=(
        "Bounds the size of one result: num_samples * (prompt + max_tokens) tokens of a sample request, the total "
        "tokens of a forward or forward_backward's datums."))
    max_datums: int = Field(4096, description="Datums in one forward or forward_backward.")
    max_shard_queue_depth: int = Field(10000, description=(
        "Jobs waiting in one shard queue; a submit past it is refused with 429 queue_full (retryable), as "
        "backpressure."))

    def _bound(self, field: str, value: int, limit_name: str) -> None:
        limit = getattr(self, limit_name)
        if value > limit:
            raise LimitExceeded(field, value, limit, f"TINKERQ_{limit_name.upper()}")

    def check(self, request: Request) -> None:
        """Raise LimitExceeded for the first bound the request breaks."""
        if isinstance(request, SampleRequest):
            self._check_sample(request)
        elif isinstance(request, ForwardRequest):
            self._bound("len(data)", len(request.data), "max_datums")
            tokens = sum(len(d.model_input) for d in request.data)
            self._bound("total tokens in data", tokens, "max_tokens_per_request")
            for datum in request.data:
                self._bound("len(model_input)", len(datum.model_input), "max_prompt_tokens")

    def _check_sample(self, request: SampleRequest) -> None:
        self._bound("num_samples", request.num_samples, "max_num_samples")
        self._bound("sampling_params.max_tokens", request.sampling_params.max_tokens, "max_tokens")
        self._bound("len(prompt_tokens)", len(request.prompt_tokens), "max_prompt_tokens")
        self._bound("topk_prompt_logprobs", request.topk_prompt_logprobs, "max_topk")
        budget = request.num_samples * (len(request.prompt_tokens) + request.sampling_params.max_tokens)
        self._bound("num_samples * (prompt + max_tokens)", budget, "max_tokens_per_request")
