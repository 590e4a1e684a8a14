"""The real `tinker` SDK (pinned in pyproject) drives the system unmodified: API, worker and Redis
as separate processes, the tiny local model, the flow of a Tinker user."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

pytestmark = pytest.mark.slow
BASE = "tinyq-micro"
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture
def stack(start_worker, start_api, tmp_path):
    """Worker (torch runtime) + two API processes on one port (each call may reach either, so what one
    remembers the other must find in Redis) with a tiny forward_backward chunk size, so chunking happens."""
    start_worker(TINKERQ_RUNTIME="torch")
    api = start_api("--workers", "2", TINKERQ_FWDBWD_MAX_CHUNK_LEN="2")
    client = tinker.ServiceClient(base_url=api.url, api_key="tml-test-key")
    yield client, api
    client.close("success").result()


def datum(prompt, completion, **inputs) -> types.Datum:
    full = prompt + completion
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64), **inputs})


def sft_data():
    completion = [40, 41, 42, 43]
    weights = np.array([0.0] * (len(PROMPT) - 1) + [1.0] * len(completion), dtype=np.float32)
    return [datum(PROMPT, completion, weights=weights) for _ in range(5)]  # 5 datums: 3 chunks of <= 2


def test_the_whole_tinker_flow(stack):
    client, api = stack
    names = [m.model_name for m in tinker.RestClient(base_url=api.url, api_key="tml-test-key")
             .get_server_capabilities().result().supported_models]
    assert BASE in names
    trainer = client.create_lora_training_client(base_model=BASE, rank=8, seed=0)
    info = trainer.get_info()
    assert info.model_data.model_name == BASE and info.lora_rank == 8

    # SFT: forward_backward is split into chunks (first chunk sent last), then optim_step; loss goes down
    losses = []
    for _ in range(6):
        fb = trainer.forward_backward(sft_data(), "cross_entropy")
        op = trainer.optim_step(types.AdamParams(learning_rate=2e-2))
        out = fb.result()
        op.result()
        losses.append(out.metrics["loss:sum"])
        assert len(out.loss_fn_outputs) == 5
    assert losses[-1] < 0.6 * losses[0], losses

    # transient sync -> sampling session; sampled logprobs equal the trainer's forward logprobs
    sampler = trainer.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=6, seed=3, temperature=1.0)
    result = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=3, sampling_params=params,
                            include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    assert len(result.sequences) == 3
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(PROMPT)
    assert len(result.topk_prompt_logprobs[1]) == 3
    seq = result.sequences[0]
    fwd = trainer.forward([datum(PROMPT, list(seq.tokens))], "cross_entropy").result()
    trainer_lps = np.asarray(fwd.loss_fn_outputs[0]["logprobs"].data)[len(PROMPT) - 1:]
    assert np.max(np.abs(trainer_lps - np.asarray(seq.logprobs))) < 1e-4
    again = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=3, sampling_params=params).result()
    assert [list(s.tokens) for s in again.sequences] == [list(s.tokens) for s in result.sequences]  # seeded

    # stop tokens and stop strings
    stop_at = list(seq.tokens)[2]
    stopped = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=6, seed=3, stop=[stop_at])).result()
    assert stopped.sequences[0].stop_reason == "stop" and list(stopped.sequences[0].tokens)[-1] == stop_at
    by_text = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=6, seed=3, stop=["zzz-never"])).result()
    assert by_text.sequences[0].stop_reason == "length"
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    assert logprobs[0] is None and np.allclose(logprobs[1:], result.prompt_logprobs[1:], atol=1e-5)

    # the old sampling session keeps its snapshot after more training and a new sync
    trainer.forward_backward(sft_data(), "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    newer = trainer.save_weights_and_get_sampling_client()
    old_again = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=3,
                               sampling_params=params).result()
    assert [list(s.tokens) for s in old_again.sequences] == [list(s.tokens) for s in result.sequences]
    new_lps = newer.compute_logprobs(types.ModelInput.from_ints(PROMPT + [40, 41])).result()
    old_lps = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + [40, 41])).result()
    assert not np.allclose(new_lps[1:], old_lps[1:], atol=1e-3)  # the new session serves the new weights

    # persisted sync by name, sampled through create_sampling_client(model_path)
    path = trainer.save_weights_for_sampler("step-7").result().path
    assert path == f"tinker://{trainer.model_id}/sampler_weights/step-7"
    by_path = client.create_sampling_client(model_path=path)
    from_path = by_path.compute_logprobs(types.ModelInput.from_ints(PROMPT + [40, 41])).result()
    assert np.allclose(from_path[1:], new_lps[1:], atol=1e-5)

    # save_state, then load with and without optimizer: identical weights, and identical next step with it
    state_path = trainer.save_state("ckpt").result().path
    assert state_path == f"tinker://{trainer.model_id}/weights/ckpt"
    with_opt = client.create_training_client_from_state_with_optimizer(state_path)
    without_opt = client.create_training_client_from_state(state_path)
    probe = [datum(PROMPT, [40, 41, 42])]

    def lps(tc):
        return np.asarray(tc.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)

    assert np.allclose(lps(with_opt), lps(trainer), atol=1e-6)
    for tc in (trainer, with_opt, without_opt):
        tc.forward_backward(sft_data(), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert np.allclose(lps(with_opt), lps(trainer), atol=1e-5)
    assert not np.allclose(lps(without_opt), lps(trainer), atol=1e-4)


def test_user_errors_fail_the_future_not_the_client(stack):
    client, _ = stack
    trainer = client.create_lora_training_client(base_model=BASE, rank=4)
    bad = [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": np.array([1, 2, 999999], dtype=np.int64)})]
    with pytest.raises(tinker.RequestFailedError, match="outside"):
        trainer.forward_backward(bad, "cross_entropy").result()
    # the model is fine afterwards
    assert "loss:sum" in trainer.forward_backward(sft_data(), "cross_entropy").result().metrics
    with pytest.raises(tinker.NotFoundError):
        client.create_lora_training_client(base_model="no-such-model", rank=4).result()


def test_an_rl_loop_in_the_style_of_the_cookbook_learns(stack):
    """tinker-cookbook's basic RL recipe, shrunk: sample groups, reward, center, importance_sampling."""
    from transformers import AutoTokenizer

    from tinkerq.local_models import resolve

    client, api = stack
    assert "auth is OFF" in api.output()  # no TINKERQ_API_KEYS here: said loudly at start-up
    tokenizer = AutoTokenizer.from_pretrained(resolve(BASE))
    is_word = np.array([tokenizer.decode([i]).strip().isalpha() for i in range(len(tokenizer))])
    trainer = client.create_lora_training_client(base_model=BASE, rank=16, seed=0)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [20, 21]]
    params = types.SamplingParams(max_tokens=10, temperature=1.0)
    rewards_per_step = []
    for _ in range(14):
        sampler = trainer.save_weights_and_get_sampling_client()
        futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=8, sampling_params=params)
                   for p in prompts]
        data, rewards = [], []
        for prompt, future in zip(prompts, futures):
            sequences = future.result().sequences
            group = [float(is_word[list(s.tokens)].mean()) for s in sequences]
            rewards += group
            mean = float(np.mean(group))
            for seq, reward in zip(sequences, group):
                assert seq.logprobs is not None
                pad = [0.0] * (len(prompt) - 1)
                data.append(datum(prompt, list(seq.tokens),
                                  logprobs=np.array(pad + list(seq.logprobs), dtype=np.float32),
                                  advantages=np.array(pad + [reward - mean] * len(seq.tokens), dtype=np.float32)))
        fb = trainer.forward_backward(data, "importance_sampling")
        op = trainer.optim_step(types.AdamParams(learning_rate=2e-2))
        fb.result()
        op.result()
        rewards_per_step.append(float(np.mean(rewards)))
    first, last = np.mean(rewards_per_step[:3]), np.mean(rewards_per_step[-3:])
    assert last > first + 0.2, rewards_per_step
