"""The torch runtime behind the queue, with each engine: syncs order what samples see, several models
share a worker, pinned snapshots are served exactly until evicted."""

import hashlib
import importlib.util

import pytest

from producer import Producer
from schemas import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from support.stack import burst_worker
from tinkerq.local_models import LOCAL_MODELS, build

PROMPT = [5, 6, 7, 8]
# vLLM where it is installed (make test installs it, and test_vllm_engine fails loudly if it is missing).
ENGINES = ["torch"] + (["vllm"] if importlib.util.find_spec("vllm") else [])


@pytest.mark.parametrize("engine", ENGINES)
def test_samples_before_a_sync_see_old_weights_and_after_it_new(r, config, tmp_path, engine):
    producer = Producer(r, config)
    models = ["qa:train:0", "qb:train:0"]
    for i, m in enumerate(models):
        producer.submit(CreateModelRequest(model_id=m, base_model="tinyq-micro", lora=LoraConfig(rank=8, seed=i)))
    greedy = SamplingParams(max_tokens=6, temperature=0)

    def greedy_sample(m):
        return producer.submit(SampleRequest(model_id=m, prompt_tokens=PROMPT, sampling_params=greedy))

    before = {m: greedy_sample(m) for m in models}
    target = [40, 41, 42, 43, 44, 45]
    full = PROMPT + target
    datum = Datum(model_input=full[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in full[1:]],
                                                         "weights": [0.0] * 3 + [1.0] * 6})
    for seq in range(1, 21, 2):  # teach model a to continue PROMPT with `target`
        producer.submit(ForwardBackwardRequest(model_id=models[0], seq_id=seq, data=[datum]))
        producer.submit(OptimStepRequest(model_id=models[0], seq_id=seq + 1,
                                         adam_params=AdamParams(learning_rate=2e-2)))
    sync = producer.submit(WeightSyncRequest(model_id=models[0]))
    after = {m: greedy_sample(m) for m in models}
    burst_worker(r, config, tmp_path, runtime="torch", engine=engine).run(burst=True, logging_level="WARNING")

    assert producer.get(sync.request_id).version == 1
    a_before, a_after = producer.get(before[models[0]].request_id), producer.get(after[models[0]].request_id)
    assert (a_before.weights_version, a_after.weights_version) == (0, 1)
    learned = sum(t in target for t in a_after.sequences[0].tokens)
    assert learned >= 4 > sum(t in target for t in a_before.sequences[0].tokens), (a_before, a_after)
    b_before, b_after = producer.get(before[models[1]].request_id), producer.get(after[models[1]].request_id)
    assert b_before.weights_version == b_after.weights_version == 0
    assert b_before.sequences[0].tokens == b_after.sequences[0].tokens  # model b never trained


@pytest.mark.parametrize("engine", ENGINES)
def test_pinned_snapshots_are_served_until_evicted(r, config, tmp_path, engine):
    producer = Producer(r, config)
    model = "qc:train:0"
    producer.submit(CreateModelRequest(model_id=model, base_model="tinyq-micro", lora=LoraConfig(rank=8, seed=0)))
    datum = Datum(model_input=PROMPT, loss_fn_inputs={"target_tokens": [float(t) for t in PROMPT[1:] + [40]]})
    syncs = []
    for _ in range(5):  # each version differs from the last
        producer.submit(ForwardBackwardRequest(model_id=model, data=[datum]))
        producer.submit(OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=5e-2)))
        syncs.append(producer.submit(WeightSyncRequest(model_id=model)))
    greedy = SamplingParams(max_tokens=6, temperature=0, stop=[])
    pinned = {v: producer.submit(SampleRequest(model_id=model, prompt_tokens=PROMPT, sampling_params=greedy,
                                               weights_version=v)) for v in (0, 1, 3, 5, 9)}
    burst_worker(r, config, tmp_path, runtime="torch", engine=engine, max_snapshots=3) \
        .run(burst=True, logging_level="WARNING")

    assert [producer.get(s.request_id).version for s in syncs] == [1, 2, 3, 4, 5]
    out = {v: producer.get(t.request_id) for v, t in pinned.items()}
    assert out[0].code == out[1].code == "snapshot_evicted"
    assert out[9].code == "weights_not_ready"
    assert (out[3].weights_version, out[5].weights_version) == (3, 5)
    assert out[3].sequences[0].tokens != out[5].sequences[0].tokens or \
        out[3].sequences[0].logprobs != out[5].sequences[0].logprobs


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_a_local_model_name_builds_the_same_files_everywhere(tmp_path):
    build("tinyq-micro", LOCAL_MODELS["tinyq-micro"], tmp_path / "one")
    build("tinyq-micro", LOCAL_MODELS["tinyq-micro"], tmp_path / "two")
    assert digest(tmp_path / "one") == digest(tmp_path / "two")
