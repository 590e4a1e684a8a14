"""The PyTorch runtime: what is sampled is what was trained, to 1e-4, through every feature."""

import json
import math

import pytest
import torch

from schemas import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ErrorResponse,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateRequest,
    LoraConfig,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    SaveStateRequest,
    WeightSyncRequest,
)
from tinkerq.config import RuntimeConfig
from worker.runtime import DomainError
from worker.runtime.registry import build_runtime

BASE = "tinyq-micro"
PROMPT = [5, 6, 7, 8, 9, 10]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return build_runtime(RuntimeConfig(runtime="torch", engine="torch", checkpoint_root=str(root), max_snapshots=3))


_models = iter(range(10**6))


def new_model(rt, rank=8, seed=0, base=BASE, train_unembed=True) -> str:
    model_id = f"t{next(_models)}:train:0"
    rt.execute(CreateModelRequest(model_id=model_id, base_model=base,
                                  lora=LoraConfig(rank=rank, seed=seed, train_unembed=train_unembed)))
    return model_id


def sample(rt, model_id, version=0, prompt=PROMPT, **params) -> SampleOutput:
    extra = {k: params.pop(k) for k in ("num_samples", "prompt_logprobs", "topk_prompt_logprobs") if k in params}
    request = SampleRequest(model_id=model_id, prompt_tokens=prompt, weights_version=version,
                            sampling_params=SamplingParams(**{"max_tokens": 8, **params}), **extra)
    (out,) = rt.sample([request])
    assert isinstance(out, SampleOutput), out
    return out


def datum(prompt, completion, **inputs) -> Datum:
    full = prompt + completion
    return Datum(model_input=full[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in full[1:]], **inputs})


def trainer_logprobs(rt, model_id, prompt, completion) -> list[float]:
    out = rt.execute(ForwardRequest(model_id=model_id, data=[datum(prompt, completion)]))
    return out.loss_fn_outputs[0]["logprobs"]


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def rl_step(rt, model_id, version, lr=5e-2) -> int:
    """One importance-sampling step that rewards the first sample's tokens, then a sync."""
    out = sample(rt, model_id, version, num_samples=2, seed=version)
    data = [datum(PROMPT, s.tokens, logprobs=[0.0] * 5 + s.logprobs, advantages=[0.0] * 5 + [a] * len(s.tokens))
            for s, a in zip(out.sequences, (1.0, -1.0))]
    rt.execute(ForwardBackwardRequest(model_id=model_id, data=data, loss_fn="importance_sampling"))
    rt.execute(OptimStepRequest(model_id=model_id, adam_params=AdamParams(learning_rate=lr)))
    rt.execute(WeightSyncRequest(model_id=model_id, version=version + 1))
    return version + 1


def test_sampler_logprobs_equal_trainer_forward_after_each_sync(rt):
    model = new_model(rt)
    worst, version = 0.0, 0
    for _ in range(3):
        out = sample(rt, model, version, num_samples=3, seed=11, prompt_logprobs=True)
        for seq in out.sequences:
            assert all(math.isfinite(lp) and lp < 0 for lp in seq.logprobs)  # never zero-filled
            lps = trainer_logprobs(rt, model, PROMPT, seq.tokens)
            worst = max(worst, max_diff(lps[len(PROMPT) - 1:], seq.logprobs))
            worst = max(worst, max_diff(lps[: len(PROMPT) - 1], out.prompt_logprobs[1:]))
        version = rl_step(rt, model, version)
    print(f"max |sampler - trainer| logprob difference over 3 syncs: {worst:.2e}")
    assert worst < TOLERANCE


def test_a_sync_changes_what_is_served_and_old_snapshots_stay_exact(rt):
    model = new_model(rt)
    before = sample(rt, model, 0, temperature=0)
    version = rl_step(rt, model, 0, lr=0.2)
    after = sample(rt, model, version, temperature=0)
    old_again = sample(rt, model, 0, temperature=0)
    assert after.weights_version == 1 and old_again.weights_version == 0
    assert (after.sequences[0].tokens, after.sequences[0].logprobs) != (before.sequences[0].tokens,
                                                                         before.sequences[0].logprobs)
    assert old_again.sequences[0].tokens == before.sequences[0].tokens
    assert max_diff(old_again.sequences[0].logprobs, before.sequences[0].logprobs) < TOLERANCE


def test_evicted_snapshot_is_an_explicit_error(rt):
    model = new_model(rt)
    version = 0
    for _ in range(3):
        version = rl_step(rt, model, version)
    (evicted,) = rt.sample([SampleRequest(model_id=model, prompt_tokens=PROMPT, weights_version=0)])
    assert isinstance(evicted, ErrorResponse) and evicted.code == "snapshot_evicted"
    assert rt.engine.live_versions(model) == [1, 2, 3]


def test_mixed_batch_of_models_and_versions_gives_each_row_its_own_weights(rt):
    a, b = new_model(rt, seed=1), new_model(rt, seed=2)
    rl_step(rt, a, 0, lr=0.2)
    requests = [SampleRequest(model_id=m, prompt_tokens=PROMPT, weights_version=v,
                              sampling_params=SamplingParams(max_tokens=6, seed=5)) for m, v in
                [(a, 0), (a, 1), (b, 0)]]
    together = rt.sample(requests)
    alone = [rt.sample([r])[0] for r in requests]
    for t, s in zip(together, alone):
        assert t.sequences[0].tokens == s.sequences[0].tokens
        assert max_diff(t.sequences[0].logprobs, s.sequences[0].logprobs) < TOLERANCE
    assert together[0].sequences[0].logprobs != together[1].sequences[0].logprobs


def test_seeds_make_samples_reproducible(rt):
    model = new_model(rt)
    first = sample(rt, model, num_samples=3, seed=42, max_tokens=10)
    again = sample(rt, model, num_samples=3, seed=42, max_tokens=10)
    other = sample(rt, model, num_samples=3, seed=43, max_tokens=10)
    tokens = [s.tokens for s in first.sequences]
    assert tokens == [s.tokens for s in again.sequences]
    assert tokens != [s.tokens for s in other.sequences]
    assert len({tuple(t) for t in tokens}) > 1  # the samples of one request differ from each other


def test_greedy_and_top_k_1_follow_the_trainers_argmax(rt):
    model = new_model(rt)
    greedy = sample(rt, model, temperature=0, max_tokens=6).sequences[0]
    top1 = sample(rt, model, top_k=1, seed=3, max_tokens=6).sequences[0]
    assert greedy.tokens == top1.tokens
    trained = rt.trainer.models[model]
    trained.base.model.set_adapter(trained.adapter)
    context = list(PROMPT)
    for token in greedy.tokens:  # each greedy token is the trainer's most likely next token
        logits = trained.base.model(input_ids=torch.tensor([context])).logits[0, -1]
        assert int(torch.argmax(logits)) == token
        context.append(token)


def test_top_p_and_temperature_shape_the_draw(rt):
    model = new_model(rt)
    greedy = sample(rt, model, temperature=0, max_tokens=6).sequences[0].tokens
    nucleus = sample(rt, model, num_samples=4, top_p=1e-6, seed=9, max_tokens=6)
    assert all(s.tokens == greedy for s in nucleus.sequences)  # a tiny nucleus keeps only the argmax
    cold = sample(rt, model, num_samples=4, temperature=1e-4, seed=9, max_tokens=6)
    assert all(s.tokens == greedy for s in cold.sequences)
    hot = sample(rt, model, num_samples=4, temperature=5.0, seed=9, max_tokens=6)
    assert any(s.tokens != greedy for s in hot.sequences)


def test_stop_tokens_stop_strings_and_length(rt):
    model = new_model(rt)
    free = sample(rt, model, seed=7, max_tokens=10, stop=[]).sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 10
    stop_token = free.tokens[3]
    stopped = sample(rt, model, seed=7, max_tokens=10, stop=[stop_token]).sequences[0]
    assert stopped.stop_reason == "stop" and stopped.tokens == free.tokens[: free.tokens.index(stop_token) + 1]
    tokenizer = rt.trainer.models[model].base.tokenizer
    text = tokenizer.decode(free.tokens[:5])
    stop_text = text[-3:] if len(text.strip()) >= 3 else text
    by_string = sample(rt, model, seed=7, max_tokens=10, stop=[stop_text]).sequences[0]
    assert by_string.stop_reason == "stop" and stop_text in tokenizer.decode(by_string.tokens)
    assert len(by_string.tokens) <= 5


def test_eos_stops_unless_stop_is_empty(rt):
    model = new_model(rt)
    base = rt.engine.base_of[model]  # the engine's own copy of the base (it samples while the trainer trains)
    eos = base.tokenizer.eos_token_id
    with torch.no_grad():  # make EOS overwhelmingly likely through the base's unembedding bias-free row
        base.model.base_model.model.lm_head.base_layer.weight[eos] *= 0
        base.model.base_model.model.lm_head.base_layer.weight[eos] += 5 * base.model.base_model.model.model.norm.weight
    try:
        with_eos = sample(rt, model, seed=1, max_tokens=10).sequences[0]
        no_stop = sample(rt, model, seed=1, max_tokens=10, stop=[]).sequences[0]
    finally:
        base.model.base_model.model.lm_head.base_layer.weight.data.copy_(
            type(base.model.base_model.model)
            .from_pretrained(base.path).lm_head.weight.data)
    assert eos in with_eos.tokens and with_eos.tokens[-1] == eos and with_eos.stop_reason == "stop"
    assert len(no_stop.tokens) == 10 and no_stop.stop_reason == "length"


def test_prompt_logprobs_and_top_k_prompt_logprobs(rt):
    model = new_model(rt)
    out = sample(rt, model, prompt_logprobs=True, topk_prompt_logprobs=4, max_tokens=1)
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    top = out.topk_prompt_logprobs
    assert top.token_ids[0] == [] and all(len(row) == 4 for row in top.token_ids[1:])
    for j, (ids, lps) in enumerate(zip(top.token_ids[1:], top.logprobs[1:]), start=1):
        assert lps == sorted(lps, reverse=True)
        assert lps[0] >= out.prompt_logprobs[j] - 1e-6
        if ids[0] == PROMPT[j]:
            assert abs(lps[0] - out.prompt_logprobs[j]) < 1e-5


def test_supervised_cross_entropy_drives_the_loss_down(rt):
    model = new_model(rt)
    data = [datum([1, 2, 3], [40, 41, 42, 43], weights=[0.0, 0.0] + [1.0] * 4)]
    losses = []
    for _ in range(8):
        out = rt.execute(ForwardBackwardRequest(model_id=model, data=data, loss_fn="cross_entropy"))
        losses.append(out.metrics["loss:sum"])
        rt.execute(OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=2e-2)))
    assert losses[-1] < 0.5 * losses[0], losses


def logprobs_of(rt, model):
    return trainer_logprobs(rt, model, PROMPT, [11, 12, 13, 14])


def train_step(rt, model, lr=1e-2):
    rt.execute(ForwardBackwardRequest(model_id=model, data=[datum(PROMPT, [11, 12, 13, 14])],
                                      loss_fn="cross_entropy"))
    rt.execute(OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=lr)))


def test_save_and_load_round_trip_with_and_without_optimizer(rt):
    model = new_model(rt)
    for _ in range(3):
        train_step(rt, model)
    path = rt.execute(SaveStateRequest(model_id=model, name="three", include_optimizer=True)).path
    saved = logprobs_of(rt, model)
    with_opt, without_opt = "loaded-opt:train:0", "loaded-plain:train:0"
    rt.execute(LoadStateRequest(model_id=with_opt, path=path, optimizer=True))
    rt.execute(LoadStateRequest(model_id=without_opt, path=path, optimizer=False))
    assert max_diff(logprobs_of(rt, with_opt), saved) == 0.0
    for m in (model, with_opt, without_opt):
        train_step(rt, m)
    assert max_diff(logprobs_of(rt, with_opt), logprobs_of(rt, model)) < 1e-6  # identical next step
    assert max_diff(logprobs_of(rt, without_opt), logprobs_of(rt, model)) > 1e-4  # fresh Adam differs


# Tied embeddings: stored once when the unembedding is not trained, untied in the export when it is.
@pytest.mark.parametrize("base, train_unembed", [(BASE, True), ("tinyq-tied", False), ("tinyq-tied", True)])
def test_named_sync_writes_an_hf_snapshot_that_loads_as_the_served_weights(rt, tmp_path, base, train_unembed):
    from transformers import AutoModelForCausalLM

    from worker.torch_runtime.checkpoints import extract_archive

    model = new_model(rt, base=base, train_unembed=train_unembed)
    version = rl_step(rt, model, 0, lr=0.2)
    out = rt.execute(WeightSyncRequest(model_id=model, version=version + 1, name="snap"))
    assert out.persisted and out.path.endswith("snap.tar.gz")
    export = extract_archive(__import__("pathlib").Path(out.path), tmp_path / "x")
    # transformers loads an lm_head beside a tied config as is; other loaders (vLLM) re-tie it
    tied = json.loads((export / "config.json").read_text()).get("tie_word_embeddings", False)
    assert tied == (base == "tinyq-tied" and not train_unembed)
    hf = AutoModelForCausalLM.from_pretrained(export)
    served = sample(rt, model, version + 1, temperature=0, max_tokens=5).sequences[0]
    logits = hf(input_ids=torch.tensor([PROMPT + served.tokens[:-1]])).logits[0].float()
    lps = torch.log_softmax(logits, -1)[len(PROMPT) - 1:].gather(-1, torch.tensor(served.tokens)[:, None])[:, 0]
    assert max_diff(lps.tolist(), served.logprobs) < TOLERANCE
    transient = rt.execute(WeightSyncRequest(model_id=model, version=version + 2))
    assert not transient.persisted and transient.path is None


def test_bad_training_input_is_a_clear_error(rt):
    model = new_model(rt)
    with pytest.raises(DomainError, match="target_tokens"):
        rt.execute(ForwardRequest(model_id=model, data=[Datum(model_input=[1, 2])]))
    with pytest.raises(DomainError, match="outside"):
        rt.execute(ForwardRequest(model_id=model, data=[datum([1], [10**6])]))
    with pytest.raises(DomainError, match="advantages"):
        rt.execute(ForwardBackwardRequest(model_id=model, data=[datum([1], [2], logprobs=[0.0])],
                                          loss_fn="importance_sampling"))
    (too_long,) = rt.sample([SampleRequest(model_id=model, prompt_tokens=[1] * 1000, weights_version=0,
                                           sampling_params=SamplingParams(max_tokens=100))])
    assert too_long.code == "context_exceeded"
    with pytest.raises(DomainError, match="unknown model"):
        rt.execute(CreateModelRequest(model_id="x", base_model="no-such-model"))



def test_requests_admitted_mid_decode_sample_exactly_what_they_would_alone(rt):
    """Continuous batching: requests that join a running batch between decode steps (prompts longer and
    shorter than its cache, other versions and models, prompt scores asked) get the same tokens and logprobs
    as alone, and each result is handed back as soon as its rows are done, before the batch ends."""
    a, b = new_model(rt, seed=1), new_model(rt, seed=2)
    rl_step(rt, a, 0, lr=0.2)

    def req(model, version, prompt, max_tokens, **extra):
        return SampleRequest(model_id=model, prompt_tokens=prompt, weights_version=version,
                             sampling_params=SamplingParams(max_tokens=max_tokens, seed=7, stop=[]), **extra)

    every = {"long": req(a, 1, PROMPT, 12), "short": req(b, 0, PROMPT[:2], 3, num_samples=2),
             "wide": req(a, 0, PROMPT * 3, 6, prompt_logprobs=True, topk_prompt_logprobs=2),
             "narrow": req(b, 0, [9], 4), "bad_token": req(a, 0, [5, 10**6], 8), "late": req(b, 0, PROMPT, 5)}
    # what each call of admit (one after each decode step) finds queued; "late" comes once all else is done
    joiners = [[], ["wide"], [], ["narrow", "bad_token"]] + [[]] * 7 + [["late"]]
    done_order, results = [], {}

    def admit(accept):
        return [(key, every[key]) for key in (joiners.pop(0) if joiners else []) if accept(every[key])]

    def done(key, result):
        done_order.append(key)
        results[key] = result

    rt.sample_stream([("long", every["long"]), ("short", every["short"])], done, admit)
    assert not joiners
    assert isinstance(results.pop("bad_token"), ErrorResponse)
    assert done_order.index("short") < done_order.index("long")  # handed back while "long" still ran
    assert done_order[-2:] == ["long", "late"]
    assert set(results) == set(every) - {"bad_token"}
    for key, joined in results.items():
        (alone,) = rt.sample([every[key]])
        assert joined.weights_version == every[key].weights_version, key
        assert [s.tokens for s in joined.sequences] == [s.tokens for s in alone.sequences], key
        for s, t in zip(joined.sequences, alone.sequences):
            assert max_diff(s.logprobs, t.logprobs) < TOLERANCE, key
        if key == "wide":
            assert max_diff(joined.prompt_logprobs[1:], alone.prompt_logprobs[1:]) < TOLERANCE
            assert joined.topk_prompt_logprobs == alone.topk_prompt_logprobs


def test_a_sliding_window_model_runs_each_batch_as_it_started_and_samples_exactly(rt):
    """A model whose KV cache keeps only a window (as Mistral- and Gemma-2-style models do; here a full layer,
    then a 6-token sliding one): no row can join its cache, so a running batch takes nobody in, and what it
    samples (past the window, from uneven prompts, rows ending at different steps) equals the trainer's
    forward and the same request alone."""
    model = new_model(rt, seed=3, base="tinyq-window")
    version = rl_step(rt, model, 0, lr=0.2)

    def req(prompt, max_tokens):
        return SampleRequest(model_id=model, prompt_tokens=prompt, weights_version=version,
                             sampling_params=SamplingParams(max_tokens=max_tokens, seed=5, stop=[]))

    batch = {"long": req(PROMPT * 2, 14), "short": req(PROMPT[:2], 4), "one": req([9], 10)}
    late = ("late", req(PROMPT, 3))
    offers = [[late]] * 20
    results = {}

    def admit(accept):
        return [(key, r) for key, r in offers.pop() if accept(r)]

    rt.sample_stream(list(batch.items()), results.__setitem__, admit)
    assert len(offers) == 20 and set(results) == set(batch)  # "late" was never taken in
    for key, request in batch.items():
        (joined,), (alone,) = results[key].sequences, rt.sample([request])[0].sequences
        assert joined.tokens == alone.tokens and len(joined.tokens) == request.sampling_params.max_tokens, key
        assert max_diff(joined.logprobs, alone.logprobs) < TOLERANCE, key
        forward = trainer_logprobs(rt, model, request.prompt_tokens, joined.tokens)
        assert max_diff(joined.logprobs, forward[len(request.prompt_tokens) - 1:]) < TOLERANCE, key


def test_dtype_auto_is_bfloat16_on_a_gpu_and_float32_on_the_cpu():
    from worker.torch_runtime.base_models import resolve_dtype

    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


def base_forward_logprobs(base: str, prompt: list[int], completion: list[int]) -> list[float]:
    """The bare base model's own forward (a fresh HF model: no adapter anywhere), per completion token."""
    from transformers import AutoModelForCausalLM

    from tinkerq.catalog import BaseModelCatalog

    model = AutoModelForCausalLM.from_pretrained(BaseModelCatalog.from_env().path(base), dtype=torch.float32).eval()
    full = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(full).logits.float(), dim=-1)[0, :-1]
    return logprobs.gather(-1, full[0, 1:, None])[:, 0].tolist()[len(prompt) - 1:]


def test_a_bare_base_model_serves_its_untrained_weights_beside_trained_adapters(rt):
    model = new_model(rt)
    version = rl_step(rt, model, 0, lr=0.2)  # the adapter now differs from the base
    params = SamplingParams(max_tokens=8, seed=5)
    bare = SampleRequest.of_base(BASE, prompt_tokens=PROMPT, num_samples=2, prompt_logprobs=True,
                                 sampling_params=params)
    trained = SampleRequest(model_id=model, prompt_tokens=PROMPT, weights_version=version, sampling_params=params)
    together = rt.sample([bare, trained])
    (alone,) = rt.sample([bare])
    assert all(isinstance(o, SampleOutput) for o in together + [alone]), together
    assert together[0].weights_version == 0
    assert [s.tokens for s in together[0].sequences] == [s.tokens for s in alone.sequences]  # batching changes nothing
    for seq in together[0].sequences:
        assert max_diff(base_forward_logprobs(BASE, PROMPT, seq.tokens), seq.logprobs) < TOLERANCE
    trained_lps = trainer_logprobs(rt, model, PROMPT, together[1].sequences[0].tokens)[len(PROMPT) - 1:]
    assert max_diff(trained_lps, together[1].sequences[0].logprobs) < TOLERANCE
    base_lps = base_forward_logprobs(BASE, PROMPT, together[1].sequences[0].tokens)
    assert max_diff(trained_lps, base_lps) > 1e-2  # the trained model is not the base
    (unknown,) = rt.sample([SampleRequest.of_base("no-such-base", prompt_tokens=PROMPT)])
    assert isinstance(unknown, ErrorResponse) and unknown.code == "unknown_base_model"


@pytest.mark.parametrize("base, train_unembed", [(BASE, True), ("tinyq-tied", False), ("tinyq-tied", True)])
def test_the_syncs_fast_export_is_peft_state_dict_exactly_and_a_copy(rt, base, train_unembed):
    """export_weights skips peft's state dict after the first call (lora_io.AdapterExport): the same names and
    values as peft's own export, and a snapshot that later training steps leave alone."""
    from worker.torch_runtime.lora_io import export_adapter

    model = new_model(rt, base=base, train_unembed=train_unembed)
    trained = rt.trainer.models[model]
    rt.trainer.export_weights(model)  # builds the cached exporter
    assert trained.exporter is not None
    train_step(rt, model, lr=5e-2)
    fast, peft = rt.trainer.export_weights(model), export_adapter(trained.base, trained.adapter)
    assert list(fast.tensors) == list(peft.tensors)
    # the adapter alone: peft would add the base's frozen lm_head matrix whenever the unembedding is adapted
    # (272 MB in bf16 for Qwen2.5-0.5B, in every sync and checkpoint)
    assert all(".lora_" in key for key in fast.tensors), [key for key in fast.tensors if ".lora_" not in key]
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in fast.tensors.items())  # trained: B moved off zero
    for key, tensor in peft.tensors.items():
        assert fast.tensors[key].dtype == tensor.dtype and torch.equal(fast.tensors[key], tensor), key
    kept = {k: v.clone() for k, v in fast.tensors.items()}
    train_step(rt, model, lr=5e-2)
    assert all(torch.equal(fast.tensors[k], v) for k, v in kept.items())  # the snapshot did not move
    assert any(not torch.equal(t, kept[k]) for k, t in rt.trainer.export_weights(model).tensors.items())


def test_an_exported_adapter_pickles_each_storage_once():
    """Ray carries every sync to the engine replicas pickled; AdapterExport's tensors are views of one buffer, which
    plain pickle writes whole once per tensor (a sync of n tensors moved n times the adapter's bytes)."""
    import pickle

    from peft import LoraConfig as PeftLoraConfig

    from worker.torch_runtime.lora_io import LoraWeights

    flat = torch.arange(40 * 256, dtype=torch.float32)
    views = {f"layer.{i}.lora_A.weight": part.view(16, 16) for i, part in enumerate(flat.split(256))}
    weights = LoraWeights(PeftLoraConfig(r=16), {**views, "own": torch.ones(3, 5)})
    data = pickle.dumps(weights)
    assert len(data) < 1.2 * (flat.numel() + 15) * 4 + 4096
    back = pickle.loads(data)
    assert list(back.tensors) == list(weights.tensors) and back.config == weights.config
    assert all(torch.equal(back.tensors[k], t) and back.tensors[k].shape == t.shape for k, t in weights.tensors.items())
