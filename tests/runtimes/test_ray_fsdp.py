"""The Ray runtime's trainer ranks with their base sharded over them (FSDP2, ray_trainer_sharding="fsdp"; on the CPU
over gloo) train what the in-process trainer trains, bit for bit: the same outputs, losses and adapters, also where a
request's micro-batches split unevenly over the ranks (the rank with fewer runs filler passes: a sharded layer's
gather takes every rank), for forward-only calls, for a named sync's merged weights (gathered from the shards), and
after a rank was killed mid-step (every rank loads its shards again for the re-formed group)."""

import tarfile

import pytest
import ray
import torch
from safetensors.torch import load
from torch.distributed.tensor import DTensor

from schemas import AdamParams, ForwardBackwardRequest, ForwardRequest, OptimStepRequest, WeightSyncRequest
from support.ray_helpers import (
    MICRO_BATCH_TOKENS,
    PROMPTS,
    adapter,
    config,
    create,
    datum,
    same_adapter,
    steps_through_a_kill,
)
from worker.ray_runtime import cluster
from worker.ray_runtime.data_parallel import assignment
from worker.runtime.registry import build_runtime


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory):
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False)
    threads = torch.get_num_threads()
    local = build_runtime(config(tmp_path_factory.mktemp("local")))
    sharded = build_runtime(config(tmp_path_factory.mktemp("fsdp"), runtime="ray", ray_gpus=2,
                                   ray_engine_replicas=1, ray_trainer_sharding="fsdp"))
    yield local, sharded
    sharded.engine.close()
    torch._C.set_num_threads(threads)
    cluster.disconnect()


def rounds(model: str, n: int) -> list[tuple[ForwardBackwardRequest, OptimStepRequest]]:
    """n steps whose data make 3 micro-batches: runs of 2 and 1 on the two ranks."""
    out = []
    for r in range(n):
        data = [datum(p, [40 + r, 41, 42, 43], 1.0 if k % 2 else -0.5) for k, p in enumerate(PROMPTS + PROMPTS[:1])]
        out.append((ForwardBackwardRequest(model_id=model, data=data, loss_fn="importance_sampling"),
                    OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=0.05))))
    return out


def test_each_rank_holds_half_of_each_layer_and_the_rest_whole(runtimes):
    _, sharded = runtimes
    sharded.warm("tinyq-micro")

    def held(self) -> tuple[str, tuple, tuple, str]:
        model = self.trainer.bases.get("tinyq-micro").model
        weight = model.get_decoder().layers[0].mlp.up_proj.weight
        return (type(weight).__name__, tuple(weight.shape), tuple(weight.to_local().shape),
                type(model.get_decoder().embed_tokens.weight).__name__)

    answers = ray.get([rank.__ray_call__.remote(held) for rank in sharded.trainer.ranks])
    for kind, whole, local, embedding in answers:
        assert kind == DTensor.__name__ and embedding == "Parameter"
        assert local[0] * 2 == whole[0] and local[1:] == whole[1:]


def test_sharded_ranks_train_what_one_process_trains(runtimes):
    local, sharded = runtimes
    model = "fsdp:train:0"
    for rt in runtimes:
        create(rt, model)
    steps = rounds(model, 3)
    runs = assignment(steps[0][0], MICRO_BATCH_TOKENS, 2)
    assert sorted(len(run) for run in runs) == [1, 2], runs  # one rank runs a filler pass
    for fb, opt in steps:
        assert sharded.execute(fb) == local.execute(fb)
        assert sharded.execute(opt) == local.execute(opt)
        assert same_adapter(adapter(local, model), adapter(sharded, model))
    forward = ForwardRequest(model_id=model, data=steps[0][0].data, loss_fn="importance_sampling")
    assert sharded.execute(forward) == local.execute(forward)


def merged_weights(path: str) -> dict[str, torch.Tensor]:
    """The merged model at a sampler archive's root."""
    with tarfile.open(path) as archive:
        return load(archive.extractfile("model.safetensors").read())


def test_a_named_sync_gathers_the_merged_weights_from_the_shards(runtimes):
    local, sharded = runtimes
    model = "fsdp:named:0"
    for rt in runtimes:
        create(rt, model)
        fb, opt = rounds(model, 1)[0]
        rt.execute(fb)
        rt.execute(opt)
        rt.execute(WeightSyncRequest(model_id=model, version=1, name="named"))
    ours, theirs = (rt.trainer.save_sampler_weights(model, "again") for rt in runtimes)
    a, b = merged_weights(ours), merged_weights(theirs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any("up_proj" in k for k in a)


def test_a_sharded_rank_killed_mid_step_comes_back_and_every_rank_reshards(runtimes):
    local, sharded = runtimes
    model = "fsdp:killed:0"
    for rt in runtimes:
        create(rt, model)
    rank = sharded.trainer.ranks[1]
    before, pid = ray.get(rank.hello.remote(), timeout=60)
    steps_through_a_kill(local, sharded, rounds(model, 2), pid)
    assert ray.get(rank.hello.remote(), timeout=60)[0] != before
    if local.trainer.has_model("fsdp:train:0"):  # a model trained before the kill came along too
        assert same_adapter(adapter(local, "fsdp:train:0"), adapter(sharded, "fsdp:train:0"))
