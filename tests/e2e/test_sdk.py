"""The real `tinker` SDK (pinned in pyproject) drives the system unmodified: API, worker and Redis
as separate processes, the tiny local model, the flow of a Tinker user."""

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.slow
BASE = "tinyq-micro"
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def stack(module_stack):
    """Worker (torch runtime) + two API processes on one port (each call may reach either, so what one
    remembers the other must find in Redis) with a tiny forward_backward chunk size, so chunking happens. One stack
    serves the module: each test trains models of its own."""
    start_worker, start_api = module_stack
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


def provenance_datum(prompt: list[int], seq, advantage: float) -> types.Datum:
    """As tinker-cookbook's recipes/rl_loop.py builds a stable_reinforce datum (with_sampled_provenance): its
    targets on the prompt are 0, not the prompt's tokens that its spans name."""
    tokens = list(seq.tokens)
    pad = [0.0] * (len(prompt) - 1)
    base = datum(prompt, tokens, logprobs=np.array(pad + list(seq.logprobs), dtype=np.float32),
                 advantages=np.array(pad + [advantage] * len(tokens), dtype=np.float32))
    base = dataclasses.replace(base, loss_fn_inputs={**base.loss_fn_inputs, "target_tokens": np.array(
        [0] * (len(prompt) - 1) + tokens, dtype=np.int64)})
    return base.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(tokens))])


def test_every_sdk_loss_and_base_model_sampling(stack):
    client, _ = stack
    trainer = client.create_lora_training_client(base_model=BASE, rank=8, seed=0)
    params = types.SamplingParams(max_tokens=6, seed=1)
    recorded = trainer.save_weights_and_get_sampling_client(record_stability_info=True)
    out = recorded.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=3, sampling_params=params).result()
    advantages = [1.0, -0.5, 0.25]
    data = [provenance_datum(PROMPT, seq, a) for seq, a in zip(out.sequences, advantages)]

    # stable_reinforce: what the loss reads of the sampler was recorded at sampling time
    fb = trainer.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.5}).result()
    expected = 0.0
    for seq, adv, result in zip(out.sequences, advantages, fb.loss_fn_outputs):
        p = np.asarray(result["logprobs"].data)[len(PROMPT) - 1:]
        q = np.asarray(seq.logprobs)
        w = np.minimum(np.exp(p - q), 2.0)
        expected -= float(np.sum(w * adv * p - 0.25 * (p - q) ** 2))
    assert fb.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)

    # a sequence sampled without record_stability_info, tokens that are not the sequence's, no spans: clear 400s
    plain = trainer.save_weights_and_get_sampling_client()
    unrecorded = plain.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params)
    wrong = provenance_datum(PROMPT, out.sequences[0], 1.0)
    wrong = dataclasses.replace(wrong, loss_fn_inputs={**wrong.loss_fn_inputs, "target_tokens": np.array(
        PROMPT[1:] + [(t + 1) % 2000 for t in out.sequences[0].tokens], dtype=np.int64)})
    # an input that is not what was sampled from
    other_input = dataclasses.replace(provenance_datum(PROMPT, out.sequences[0], 1.0), model_input=types.ModelInput
                                      .from_ints([t + 1 for t in PROMPT] + list(out.sequences[0].tokens)[:-1]))
    for bad, says in ((provenance_datum(PROMPT, unrecorded.result().sequences[0], 1.0), "no recorded sequence"),
                      (wrong, "targets .* are not the tokens of sampled_tokens"),
                      (other_input, "model_input 0..5 are not the tokens of prompt_tokens"),
                      (sft_data()[0], "needs loss_fn_input_spans")):
        with pytest.raises(tinker.BadRequestError, match=says):
            trainer.forward_backward([bad], "stable_reinforce").result()

    # dro needs its beta; gspo its sequence_ratio_mask
    rl = [datum(PROMPT, list(s.tokens), logprobs=np.array([0.0] * 4 + list(s.logprobs), dtype=np.float32),
                advantages=np.array([0.0] * 4 + [a] * len(s.tokens), dtype=np.float32),
                sequence_ratio_mask=np.array([0.0] * 4 + [1.0] * len(s.tokens), dtype=np.float32))
          for s, a in zip(out.sequences, advantages)]
    assert np.isfinite(trainer.forward_backward(rl, "dro", {"beta": 0.05}).result().metrics["loss:sum"])
    assert np.isfinite(trainer.forward_backward(rl, "gspo").result().metrics["loss:sum"])
    with pytest.raises(tinker.RequestFailedError, match="beta"):
        trainer.forward_backward(rl, "dro").result()

    # forward_backward_custom (the SDK's client-side path: a forward, then a weighted cross_entropy)
    def neg_ll(batch, logprobs):
        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["advantages"].data)).sum() for d, lp in zip(batch, logprobs))
        return loss, {"custom:sum": float(loss)}

    import torch

    custom = trainer.forward_backward_custom(rl, neg_ll).result()
    assert np.isfinite(custom.metrics["loss:sum"])

    # the bare base model: what a fresh (untrained, LoRA B = 0) model's forward computes
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    base = client.create_sampling_client(base_model=BASE)
    fresh = client.create_lora_training_client(base_model=BASE, rank=4)
    probe = PROMPT + [40, 41, 42]
    base_lps = base.compute_logprobs(types.ModelInput.from_ints(probe)).result()
    fresh_lps = np.asarray(fresh.forward([datum(probe[:1], probe[1:])], "cross_entropy").result()
                           .loss_fn_outputs[0]["logprobs"].data)
    assert np.allclose(base_lps[1:], fresh_lps, atol=1e-4)
    trained = trainer.save_weights_and_get_sampling_client().compute_logprobs(
        types.ModelInput.from_ints(probe)).result()
    assert not np.allclose(trained[1:], base_lps[1:], atol=1e-3)


def test_a_custom_loss_traced_by_the_sdk_runs_on_the_server(stack):
    """With custom_loss_server_side (this server's client/config), create_custom_loss uploads the traced graph
    and forward_backward_custom is one forward_backward(loss_fn="custom"): the same numbers as running the
    same function on the client's side (the SDK's own two-pass path, used for a plain callable)."""
    import torch

    client, _ = stack
    trainer = client.create_lora_training_client(base_model=BASE, rank=8, seed=0)

    def clipped_ratio(logprobs, advantages, logprobs_ref):
        ratio = torch.exp(logprobs - logprobs_ref)
        loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.5, 1.5) * advantages).sum()
        return loss, {"custom/clipped_ratio:sum": loss, "custom/ratio:mean": ratio.mean()}

    handle = client.create_custom_loss(clipped_ratio, {"logprobs": 1, "advantages": 1, "logprobs_ref": 1}).result()
    assert handle.loss_id
    completion = [40, 41, 42, 43]
    n = len(PROMPT) - 1 + len(completion)
    data = [datum(PROMPT, completion, advantages=np.linspace(-1, 1, n, dtype=np.float32),
                  logprobs_ref=np.full(n, -7.0, dtype=np.float32)) for _ in range(2)]

    def plain(batch, logprobs):  # the same loss as a callable: the SDK runs it on the client side
        total, ratio_mean = 0.0, 0.0
        for d, lp in zip(batch, logprobs):
            adv = torch.tensor(d.loss_fn_inputs["advantages"].data)
            ref = torch.tensor(d.loss_fn_inputs["logprobs_ref"].data)
            loss, metrics = clipped_ratio(lp, adv, ref)
            total, ratio_mean = total + loss, ratio_mean + metrics["custom/ratio:mean"] / len(batch)
        return total, {"custom/clipped_ratio:sum": float(total), "custom/ratio:mean": float(ratio_mean)}

    on_server = trainer.forward_backward_custom(data, handle).result()
    on_client = trainer.forward_backward_custom(data, plain).result()
    for key in ("loss:sum", "custom/clipped_ratio:sum", "custom/ratio:mean"):
        assert on_server.metrics[key] == pytest.approx(on_client.metrics[key], rel=1e-5), key

    forged = {"format": 1, "nodes": [{"op": "placeholder", "name": "logprobs", "target": "logprobs"},
                                     {"op": "call_function", "name": "boom", "target": "os.system",
                                      "args": ["true"], "kwargs": {}},
                                     {"op": "output", "name": "output", "target": "output",
                                      "args": [{"tuple": [{"ref": "boom"}, {"dict": {}}]}], "kwargs": {}}]}
    import httpx

    api = stack[1]
    session_id = trainer.model_id.split(":")[0]
    sent = httpx.post(f"{api.url}/api/v1/create_custom_loss", json={
        "session_id": session_id, "custom_loss_seq_id": 99, "name": "forged",
        "inputs": [{"name": "logprobs", "rank": 1}], "graph": forged, "type": "create_custom_loss"})
    refused = httpx.post(f"{api.url}/api/v1/retrieve_future", json={"request_id": sent.json()["request_id"]},
                         timeout=40).json()
    assert "os.system" in refused["error"] and refused["category"] == "user"


def test_the_rest_client_sees_runs_checkpoints_and_sessions(stack):
    import time

    client, _ = stack
    trainer = client.create_lora_training_client(base_model=BASE, rank=8, seed=0,
                                                 user_metadata={"renderer_name": "role_colon"})
    state = trainer.save_state("s1").result().path
    sampler_path = trainer.save_weights_for_sampler("w1").result().path
    rest = client.create_rest_client()
    run = rest.get_training_run(trainer.model_id).result()
    assert (run.base_model, run.lora_rank, run.is_lora) == (BASE, 8, True)
    assert run.user_metadata == {"renderer_name": "role_colon"}  # what the cookbook reads back on resume
    assert run.last_checkpoint.tinker_path == state and run.last_sampler_checkpoint.tinker_path == sampler_path
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == trainer.model_id
    listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert sorted(c.checkpoint_id for c in listed) == ["sampler_weights/w1", "weights/s1"]
    assert all(c.size_bytes and c.size_bytes > 0 for c in listed)
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.lora_rank, info.train_unembed) == (BASE, 8, True)
    assert trainer.model_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    session_id = trainer.model_id.split(":")[0]
    assert trainer.model_id in rest.get_session(session_id).result().training_run_ids
    assert session_id in rest.list_sessions().result().sessions

    rest.delete_checkpoint_from_tinker_path(state).result()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(rest.list_checkpoints(trainer.model_id).result().checkpoints) > 1:
        time.sleep(0.2)
    assert [c.checkpoint_id for c in rest.list_checkpoints(trainer.model_id).result().checkpoints] == \
        ["sampler_weights/w1"]
    with pytest.raises(tinker.RequestFailedError, match="checkpoint_not_found"):  # the archive is gone
        client.create_training_client_from_state(state).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("nobody:train:0").result()
    with pytest.raises(tinker.BadRequestError, match="not published"):
        rest.publish_checkpoint_from_tinker_path(sampler_path).result()
