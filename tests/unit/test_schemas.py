import pytest
from pydantic import ValidationError

from schemas import (
    Datum,
    ErrorResponse,
    ForwardBackwardOutput,
    LimitExceeded,
    Limits,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    parse_request,
    parse_result,
)


def sample(**overrides) -> SampleRequest:
    return SampleRequest(**{"model_id": "m", "prompt_tokens": [1, 2, 3], **overrides})


def test_stop_as_strings_or_token_ids_but_never_mixed():
    assert SamplingParams(stop="</s>").stop == ["</s>"]
    assert SamplingParams(stop=[2, 7]).stop == [2, 7]
    assert SamplingParams(stop=[]).stop == []
    with pytest.raises(ValidationError, match="not a mix"):
        SamplingParams(stop=["x", 2])


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", 0),
                                         ("max_tokens", 0), ("seed", -3)])
def test_sampling_params_reject_out_of_range(field, value):
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"kind": "sample"},
        {"kind": "nope", "model_id": "m"},
        {"kind": "sample", "model_id": "m", "prompt_tokens": []},
        {"kind": "sample", "model_id": "m", "prompt_tokens": [-1]},
        {"kind": "sample", "model_id": "bad id", "prompt_tokens": [1]},
        {"kind": "sample", "model_id": "m{x}", "prompt_tokens": [1]},
        {"kind": "sample", "model_id": "m", "prompt_tokens": [1], "surprise": 1},
        {"kind": "weight_sync", "model_id": "m", "name": "../etc"},
        {"kind": "create_model", "model_id": "m", "base_model": "b",
         "lora": {"train_mlp": False, "train_attn": False, "train_unembed": False}},
        {"kind": "forward_backward", "model_id": "m", "data": [{"model_input": [1, 2],
                                                                 "loss_fn_inputs": {"weights": [1.0]}}]},
        {"kind": "forward_backward", "model_id": "m", "data": [], "loss_fn": "cross_entropy"},
        {"kind": "forward_backward", "model_id": "m", "data": [{"model_input": [1]}], "loss_fn": "magic"},
    ],
)
def test_malformed_payloads_are_validation_errors(payload):
    with pytest.raises(ValidationError):
        parse_request(payload)


def test_datum_alignment_message_names_the_input():
    with pytest.raises(ValidationError, match="advantages"):
        Datum(model_input=[1, 2, 3], loss_fn_inputs={"advantages": [0.0]})


@pytest.mark.parametrize(
    "request_,field,limit_env",
    [
        (sample(num_samples=1000), "num_samples", "TINKERQ_MAX_NUM_SAMPLES"),
        (sample(sampling_params={"max_tokens": 10**6}), "max_tokens", "TINKERQ_MAX_TOKENS"),
        (sample(prompt_tokens=[1] * 40000), "len(prompt_tokens)", "TINKERQ_MAX_PROMPT_TOKENS"),
        (sample(topk_prompt_logprobs=50), "topk_prompt_logprobs", "TINKERQ_MAX_TOPK"),
        (sample(num_samples=100, sampling_params={"max_tokens": 4000}), "num_samples * (prompt + max_tokens)",
         "TINKERQ_MAX_TOKENS_PER_REQUEST"),
    ],
)
def test_limit_errors_name_field_and_limit(request_, field, limit_env):
    with pytest.raises(LimitExceeded) as info:
        Limits().check(request_)
    assert field in str(info.value) and limit_env in str(info.value)
    assert str(info.value.limit) in str(info.value)


def test_limits_read_from_environment(monkeypatch):
    from tinkerq.config import LimitsConfig  # schemas/ reads no environment: the deployment's config does

    monkeypatch.setenv("TINKERQ_MAX_NUM_SAMPLES", "2")
    with pytest.raises(LimitExceeded, match="limit of 2"):
        LimitsConfig().check(sample(num_samples=3))
    LimitsConfig().check(sample(num_samples=2))


def test_results_round_trip_through_json():
    out = SampleOutput(sequences=[{"tokens": [1], "logprobs": [-0.1], "stop_reason": "stop"}],
                       prompt_logprobs=[float("nan"), -1.5], weights_version=3)
    back = parse_result(out.model_dump_json())
    assert back == SampleOutput(sequences=out.sequences, prompt_logprobs=[None, -1.5], weights_version=3)
    err = ErrorResponse(error="x", status=429, code="queue_full", retryable=True)
    assert parse_result(err.model_dump_json()) == err


def test_metric_keys_must_be_name_colon_reduction():
    ForwardBackwardOutput(loss_fn_outputs=[], metrics={"loss:sum": 1.0})
    with pytest.raises(ValidationError, match="name:reduction"):
        ForwardBackwardOutput(loss_fn_outputs=[], metrics={"loss": 1.0})
