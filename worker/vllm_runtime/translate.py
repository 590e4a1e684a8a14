"""Translating between our sample requests and vLLM's: pure functions, no engine.

One SampleRequest with num_samples=n becomes n vLLM requests; with a seed s, sample k gets seed s+k, as
in the PyTorch engine, so a seeded sample does not depend on n or on what it is batched with.
Logprobs are vLLM's raw logprobs (the model's own distribution, before temperature, top-k and top-p):
exactly what the trainer's forward computes for the same tokens, which is what importance sampling needs.
"""

import secrets
from typing import Any

from schemas import GeneratedSequence, SampleOutput, SampleRequest, TopkLogprobs


def sampling_params(request: SampleRequest, sample_index: int) -> dict[str, Any]:
    """Keyword arguments for vllm.SamplingParams of one sample of `request`."""
    params = request.sampling_params
    seed = params.seed + sample_index if params.seed is not None else secrets.randbits(62)
    kwargs: dict[str, Any] = {
        "n": 1, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        "max_tokens": params.max_tokens, "seed": seed, "logprobs": 0, "detokenize": False,
    }
    if params.stop == []:
        kwargs["ignore_eos"] = True  # [] means never stop early, not even at EOS
    elif params.stop and isinstance(params.stop[0], int):
        kwargs["stop_token_ids"] = list(params.stop)
    elif params.stop:
        kwargs.update(stop=list(params.stop), detokenize=True, include_stop_str_in_output=True)
    if wants_prompt_scores(request) and sample_index == 0:  # the prompt is scored once per request
        kwargs["prompt_logprobs"] = request.topk_prompt_logprobs
    return kwargs


def wants_prompt_scores(request: SampleRequest) -> bool:
    return request.prompt_logprobs or request.topk_prompt_logprobs > 0


def sequence(completion: Any) -> GeneratedSequence:
    """A vLLM CompletionOutput as our sequence; the logprob of each token is the one it was drawn with."""
    logprobs = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
    stop_reason = "length" if completion.finish_reason == "length" else "stop"
    return GeneratedSequence(tokens=list(completion.token_ids), logprobs=logprobs, stop_reason=stop_reason)


def output(request: SampleRequest, results: list[Any]) -> SampleOutput:
    """Our SampleOutput from the vLLM RequestOutputs of the request's samples (in sample order)."""
    sequences = [sequence(result.outputs[0]) for result in results]
    prompt, topk = None, None
    if wants_prompt_scores(request):
        scored = results[0].prompt_logprobs
        if request.prompt_logprobs:
            prompt = [None] + [scored[i][token].logprob for i, token in enumerate(request.prompt_tokens) if i > 0]
        if request.topk_prompt_logprobs:
            topk = _topk(scored, request.topk_prompt_logprobs)
    return SampleOutput(sequences=sequences, prompt_logprobs=prompt, topk_prompt_logprobs=topk,
                        weights_version=request.weights_version)


def _topk(scored: list[dict[int, Any] | None], k: int) -> TopkLogprobs:
    """vLLM returns the top k plus the prompt token itself (rank > k when outside them): keep the top k."""
    ids: list[list[int]] = [[]]
    values: list[list[float]] = [[]]
    for position in scored[1:]:
        best = sorted(position.items(), key=lambda item: item[1].rank)[:k]
        ids.append([token for token, _ in best])
        values.append([entry.logprob for _, entry in best])
    return TopkLogprobs(token_ids=ids, logprobs=values)
