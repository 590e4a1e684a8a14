"""The torch runtime behind the queue: syncs order what samples see, several models share a worker."""

import hashlib

from conftest import burst_worker
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
from tinkerq.local_models import LOCAL_MODELS, build

PROMPT = [5, 6, 7, 8]


def test_samples_before_a_sync_see_old_weights_and_after_it_new(r, config, tmp_path):
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
    burst_worker(r, config, tmp_path, runtime="torch").run(burst=True, logging_level="WARNING")

    assert producer.get(sync.request_id).version == 1
    a_before, a_after = producer.get(before[models[0]].request_id), producer.get(after[models[0]].request_id)
    assert (a_before.weights_version, a_after.weights_version) == (0, 1)
    learned = sum(t in target for t in a_after.sequences[0].tokens)
    assert learned >= 4 > sum(t in target for t in a_before.sequences[0].tokens), (a_before, a_after)
    b_before, b_after = producer.get(before[models[1]].request_id), producer.get(after[models[1]].request_id)
    assert b_before.weights_version == b_after.weights_version == 0
    assert b_before.sequences[0].tokens == b_after.sequences[0].tokens  # model b never trained


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_a_local_model_name_builds_the_same_files_everywhere(tmp_path):
    build("tinyq-micro", LOCAL_MODELS["tinyq-micro"], tmp_path / "one")
    build("tinyq-micro", LOCAL_MODELS["tinyq-micro"], tmp_path / "two")
    assert digest(tmp_path / "one") == digest(tmp_path / "two")
