"""The Ray runtime (2 engine replicas, 2 data-parallel trainer ranks on a real local Ray cluster) serves what
the in-process runtime serves: the same tokens, sampled logprobs to 1e-5 in float32, and from the trainer the
very same logprobs, losses and adapters (data parallelism runs the in-process trainer's own micro-batches and
sums their gradients in its order: worker/ray_runtime/data_parallel.py)."""

import os
import signal
import threading
import time

import pytest
import ray  # the `ray` extra is part of `make test`: a missing one fails here, never skips
import torch

from schemas import (
    AdamParams,
    CreateModelRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardRequest,
    LoraConfig,
    OptimStepRequest,
    SampleOutput,
    WeightSyncRequest,
)
from support.ray_helpers import (
    BASE,
    MICRO_BATCH_TOKENS,
    PROMPTS,
    adapter,
    close,
    config,
    create,
    datum,
    requests,
    same_adapter,
    step,
    steps_through_a_kill,
)
from worker.ray_runtime import cluster
from worker.ray_runtime.trainers import RanksLost
from worker.runtime import DomainError
from worker.runtime.registry import build_runtime


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module (starting one costs seconds), shut down in bounded time (another
    module joins a cluster of its own)."""
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False)
    yield
    cluster.disconnect()




@pytest.fixture(scope="module")
def runtimes(ray_cluster, tmp_path_factory):
    """The in-process runtime and the Ray one, side by side."""
    threads = torch.get_num_threads()  # the in-process runtime sets this process's; given back after
    local = build_runtime(config(tmp_path_factory.mktemp("local")))
    distributed = build_runtime(config(tmp_path_factory.mktemp("ray"), runtime="auto", ray_gpus=2))
    yield local, distributed
    distributed.engine.close()
    torch._C.set_num_threads(threads)  # torch.set_num_threads is a no-op once vLLM ran here




def test_two_replicas_and_two_ranks_serve_what_one_process_serves(runtimes):
    local, distributed = runtimes
    model = "equal:train:0"
    for rt in runtimes:
        create(rt, model)
    for version in range(3):
        mine, theirs = local.sample(requests(model, version)), distributed.sample(requests(model, version))
        for a, b in zip(mine, theirs):
            assert isinstance(a, SampleOutput) and isinstance(b, SampleOutput), (a, b)
            assert b.weights_version == version
            assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
            for sa, sb in zip(a.sequences, b.sequences):
                assert close(sa.logprobs, sb.logprobs)
            assert close(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
        (fb_a, opt_a), (fb_b, opt_b) = step(local, model, mine, version), step(distributed, model, theirs, version)
        # the trainer: the same float32 operations on the same values in the same order, so equal exactly
        assert fb_a == fb_b  # metrics and per-token outputs
        assert opt_a.metrics == opt_b.metrics
        assert same_adapter(adapter(local, model), adapter(distributed, model))
    assert distributed.engine.live_versions(model) == [1, 2, 3]


def same_samples(mine: list, theirs: list, version: int) -> None:
    for a, b in zip(mine, theirs, strict=True):
        assert isinstance(a, SampleOutput) and isinstance(b, SampleOutput), (a, b)
        assert b.weights_version == version
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert all(close(sa.logprobs, sb.logprobs) for sa, sb in zip(a.sequences, b.sequences))


def test_syncs_travel_over_the_weights_group_and_a_restarted_replica_rejoins_it(runtimes):
    """A sync is broadcast from trainer rank 0 over the weights group (weight_group.py), and the snapshot record keeps
    the very weights that were sent. An engine replica SIGKILLed between syncs is rebuilt from the record, the next
    sync forms the group again with its new incarnation, and every replica serves each live version as in process."""
    local, distributed = runtimes
    group = distributed.engine.group
    assert distributed.trainer.transport == "group", "the Ray runtime's default transport"
    model = "group:train:0"
    for rt in runtimes:
        create(rt, model)
    outputs = [rt.sample(requests(model, 0)) for rt in runtimes]
    for rt, out in zip(runtimes, outputs, strict=True):
        step(rt, model, out, 0)
    formation = group.generation
    assert formation >= 1 and set(group.formed) == {0, 1} and group.backend == "gloo"  # no GPU: host memory
    recorded = dict(distributed.engine.record.records()[-1][2])  # the record of this model: version -> reference
    assert same_adapter(ray.get(recorded[1]).tensors, adapter(distributed, model))

    replica = distributed.engine.replicas[1]
    os.kill(ray.get(replica.hello.remote(), timeout=60)[1], signal.SIGKILL)
    outputs = [rt.sample(requests(model, 1)) for rt in runtimes]  # the lost replica's share fails, retryably
    for rt in runtimes:
        step(rt, model, local.sample(requests(model, 1)), 1)
    assert group.generation == formation + 1, "the restarted replica is in a new formation of the group"
    for version in (1, 2):
        same_samples(local.sample(requests(model, version)), distributed.sample(requests(model, version)), version)


def test_a_replica_killed_just_before_a_sync_misses_the_broadcast_and_is_rebuilt_holding_it(runtimes):
    """The facade still counts the replica in the formed group when the sync starts. Asked before the broadcast, the
    replica answers as a new incarnation (Ray restarted it), so the group is formed again without it (a broadcast
    counting it would wait out the group's timeout on every member: gloo does not notice a peer that died between
    two collectives); it is rebuilt from the record, which holds the weights it missed, and rejoins at the next sync."""
    local, distributed = runtimes
    group = distributed.engine.group
    model = "missed:train:0"
    for rt in runtimes:
        create(rt, model)
    for rt in runtimes:
        step(rt, model, local.sample(requests(model, 0)), 0)
    formation = group.generation
    os.kill(ray.get(distributed.engine.replicas[0].hello.remote(), timeout=60)[1], signal.SIGKILL)
    started = time.monotonic()
    for rt in runtimes:
        step(rt, model, local.sample(requests(model, 1)), 1)  # its sync is the one the dead replica was due
    assert time.monotonic() - started < 60, "the dead member was found by the group's timeout"
    for version in (1, 2):
        same_samples(local.sample(requests(model, version)), distributed.sample(requests(model, version)), version)
    for rt in runtimes:
        step(rt, model, local.sample(requests(model, 2)), 2)
    assert group.generation > formation
    same_samples(local.sample(requests(model, 3)), distributed.sample(requests(model, 3)), 3)


def test_a_durable_checkpoint_of_the_ray_runtime_rebuilds_the_model_and_its_live_snapshots(runtimes):
    """Durability holds on Ray as in process: rank 0 writes the model's whole state and the live snapshots' weights
    (from the facade's record) to one archive; after the model is dropped, every rank reads it back and the replicas
    serve each live version again, and training goes on as the in-process runtime's, bit for bit."""
    local, distributed = runtimes
    model = "durable:train:0"
    for rt in runtimes:
        create(rt, model)
    for version in range(2):
        for rt in runtimes:
            step(rt, model, local.sample(requests(model, version)), version)
    live, before = distributed.engine.live_versions(model), adapter(distributed, model)
    checkpoint = distributed.checkpoint(model, "durable-1")
    assert checkpoint is not None and checkpoint.applied == 2
    distributed.restore(model, checkpoint)  # forgets the model first: everything below comes from the archive
    assert distributed.engine.live_versions(model) == live and same_adapter(adapter(distributed, model), before)
    for version in live:
        same_samples(local.sample(requests(model, version)), distributed.sample(requests(model, version)), version)
    fb_a, _ = step(local, model, local.sample(requests(model, 2)), 2)
    fb_b, _ = step(distributed, model, local.sample(requests(model, 2)), 2)
    assert fb_a == fb_b and same_adapter(adapter(local, model), adapter(distributed, model))


def test_a_durable_checkpoint_is_copied_at_capture_and_written_while_training_goes_on(runtimes):
    """As in process (durable_async): rank 0 copies the state aside when the checkpoint is captured, and writes it in
    a thread of its own while the next step runs; the archive holds the captured state, not the step's."""
    local, distributed = runtimes
    model = "async:train:0"
    create(distributed, model)
    step(distributed, model, distributed.sample(requests(model, 0)), 0)
    captured = adapter(distributed, model)
    pending = distributed.capture(model)
    assert pending is not None and pending.off_thread
    written: dict = {}
    writer = threading.Thread(target=lambda: written.update(made=pending.write("async-1")))
    writer.start()
    step(distributed, model, distributed.sample(requests(model, 1)), 1)  # meanwhile: the state moves on
    writer.join(timeout=300)
    assert not writer.is_alive() and written["made"] is not None
    assert not same_adapter(adapter(distributed, model), captured)
    distributed.restore(model, written["made"])
    assert same_adapter(adapter(distributed, model), captured) and distributed.engine.live_versions(model) == [0, 1]


def test_an_evicted_persisted_snapshot_is_read_back_and_served_by_every_replica(runtimes):
    """A persisted sync (a name) that later syncs evicted is read back from its archive (rank 0 reads it) into the
    record and every replica when a sample asks for it, and served as the in-process runtime serves it."""
    local, distributed = runtimes
    model = "persisted:train:0"
    for rt in runtimes:
        create(rt, model)
        rt.execute(WeightSyncRequest(model_id=model, version=1, name="kept"))
        for version in range(1, 4):  # max_snapshots=3: version 1 goes
            step(rt, model, local.sample(requests(model, version)), version)
    assert 1 not in distributed.engine.live_versions(model)
    same_samples(local.sample(requests(model, 1)), distributed.sample(requests(model, 1)), 1)
    assert 1 in distributed.engine.live_versions(model)


def test_the_object_store_transport_serves_what_one_process_serves(runtimes):
    """The other transport (config.ray_weight_transport="object_store": syncs as copies through Ray's object store),
    on the same actors: the trainer's transport decides what its exports are."""
    local, distributed = runtimes
    distributed.trainer.transport = "object_store"
    try:
        model = "store:train:0"
        for rt in runtimes:
            create(rt, model)
            step(rt, model, local.sample(requests(model, 0)), 0)
        assert isinstance(distributed.engine.record.records()[-1][2][-1][1], ray.ObjectRef)
        same_samples(local.sample(requests(model, 1)), distributed.sample(requests(model, 1)), 1)
    finally:
        distributed.trainer.transport = "group"


def test_every_rank_holds_the_same_adapter(runtimes):
    _, distributed = runtimes
    model = "ranks:train:0"
    distributed.execute(CreateModelRequest(model_id=model, base_model=BASE, lora=LoraConfig(rank=4)))  # unseeded
    data = [datum(p, [40, 41, 42], 1.0) for p in PROMPTS]
    distributed.execute(ForwardBackwardRequest(model_id=model, data=data, loss_fn="importance_sampling"))
    distributed.execute(OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=0.05)))
    first, second = ray.get([rank.export_weights.remote(model) for rank in distributed.trainer.ranks])
    assert first.tensors.keys() == second.tensors.keys()
    assert all(torch.equal(first.tensors[k], second.tensors[k]) for k in first.tensors)


def test_a_failing_slice_leaves_no_gradient_on_any_rank(runtimes):
    local, distributed = runtimes
    model = "rollback:train:0"
    for rt in runtimes:
        create(rt, model)
    good = [datum(p, [40, 41], 1.0) for p in PROMPTS]
    bad = Datum(model_input=[5, 6], loss_fn_inputs={"target_tokens": [6.0, 7.0]})  # no advantages: a 400
    for rt in runtimes:
        with pytest.raises(Exception) as caught:
            rt.execute(ForwardBackwardRequest(model_id=model, data=good + [bad], loss_fn="importance_sampling"))
        assert getattr(caught.value, "status", None) == 400
        rt.execute(ForwardBackwardRequest(model_id=model, data=good, loss_fn="importance_sampling"))
        rt.execute(OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=0.05)))
    assert same_adapter(adapter(local, model), adapter(distributed, model))


def test_forward_only_equals_in_process(runtimes):
    local, distributed = runtimes
    model = "fwd:train:0"
    for rt in runtimes:
        create(rt, model)
    data = [datum(p, [40, 41, 42], 1.0) for p in PROMPTS]
    a, b = (rt.execute(ForwardRequest(model_id=model, data=data, loss_fn="importance_sampling")) for rt in runtimes)
    assert a == b


def test_the_weights_group_uses_nccl_only_where_every_member_has_a_gpu_of_its_own(monkeypatch):
    from worker.ray_runtime.weight_group import backend_for

    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)  # as on a CUDA build of torch
    assert backend_for("gpu-0", ["gpu-1", "gpu-2"]) == "nccl"
    assert backend_for(None, ["gpu-1"]) == "gloo"  # the trainer's export is in host memory
    assert backend_for("gpu-0", ["gpu-1", None]) == "gloo"  # a replica on the CPU
    assert backend_for("gpu-0", ["gpu-1", "gpu-1"]) == "gloo"  # two replicas on one GPU: NCCL refuses
    assert backend_for("gpu-0", ["gpu-0"]) == "gloo"  # on the sender's GPU (IPC serves such a replica)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert backend_for("gpu-0", ["gpu-1"]) == "gloo"


def test_a_step_spreads_over_both_ranks():
    """The data of a step is cut into the in-process trainer's micro-batches, and each rank gets a run of them."""
    from worker.ray_runtime.data_parallel import assignment
    from worker.torch_runtime.packing import plan

    data = [datum(p, [40, 41, 42, 43, 44, 45], 1.0) for p in PROMPTS for _ in range(2)]  # 11, 11, 8, 8, ... tokens
    runs = assignment(ForwardBackwardRequest(model_id="m", data=data, loss_fn="importance_sampling"),
                      MICRO_BATCH_TOKENS, 2)
    passes = plan([len(d.model_input) for d in data], MICRO_BATCH_TOKENS)
    assert [span for run in runs for span in run] == passes == [(0, 1), (1, 3), (3, 5), (5, 7), (7, 8)]
    assert [sum(len(d.model_input) for a, b in run for d in data[a:b]) for run in runs] == [30, 40]


def test_remove_model_drops_it_on_every_rank_and_it_can_be_built_again(runtimes):
    """What durable restore does to a stale copy (Runtime.forget, then a replay of its journal)."""
    local, distributed = runtimes
    model = "removed:train:0"
    create(distributed, model)
    data = [datum(p, [40, 41, 42], 1.0) for p in PROMPTS]
    distributed.execute(ForwardBackwardRequest(model_id=model, data=data, loss_fn="importance_sampling"))
    distributed.forget(model)
    assert not distributed.trainer.has_model(model)
    assert ray.get([rank.__ray_call__.remote(lambda self: self.trainer.has_model(model))
                    for rank in distributed.trainer.ranks]) == [False, False]
    assert distributed.engine.live_versions(model) == []
    for rt in runtimes:  # built again from scratch: no gradient of the first life is left on any rank
        create(rt, model)
        rt.execute(ForwardBackwardRequest(model_id=model, data=data, loss_fn="importance_sampling"))
        rt.execute(OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=0.05)))
    assert same_adapter(adapter(local, model), adapter(distributed, model))


def test_warm_loads_a_base_on_every_rank_and_replica_before_any_model_of_it(runtimes):
    """What a standby's preload calls (worker/shards/preload.py): the base loaded in each trainer rank's and each engine
    replica's own process, not on first use after a takeover; a base not served is refused."""
    _, distributed = runtimes
    warmed = "tinyq-tied"  # no other test of this module loads it

    def held() -> list[bool]:
        return ray.get([rank.__ray_call__.remote(lambda self: self.trainer.bases.loaded(warmed) is not None)
                        for rank in distributed.trainer.ranks]
                       + [replica.__ray_call__.remote(lambda self: self.engine.bases.loaded(warmed) is not None)
                          for replica in distributed.engine.replicas])

    assert held() == [False] * 4
    distributed.warm(warmed)
    assert held() == [True] * 4
    with pytest.raises(DomainError):
        distributed.warm("no-such-base")


def test_a_ray_client_address_is_refused_before_ray_starts(monkeypatch):
    """Ray Client cannot stream actor results (every sample comes back that way): the worker refuses it at
    start, naming what to do instead, rather than failing its first sample."""
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init called for a ray:// address"))
    with pytest.raises(ValueError, match="--ray-address auto"):
        cluster.connect("ray://head:10001")




@pytest.mark.parametrize("killed", [0, 1])
def test_a_trainer_rank_killed_mid_step_comes_back_holding_the_models(runtimes, killed):
    """A trainer rank's process SIGKILLed as a forward_backward starts is restarted by Ray; the group is re-formed
    with it and every model copied into it from the surviving rank, the forward_backward completes (run again if
    the rank died inside it), and every step after is still the in-process trainer's, bit for bit."""
    local, distributed = runtimes
    model = f"killed{killed}:train:0"
    for rt in runtimes:
        create(rt, model)
    rank = distributed.trainer.ranks[killed]
    before, pid = ray.get(rank.hello.remote(), timeout=60)
    steps = []
    for round_ in range(2):
        data = [datum(p, [40 + round_, 41, 42], 1.0 if k % 2 else -0.5) for k, p in enumerate(PROMPTS)]
        steps.append((ForwardBackwardRequest(model_id=model, data=data, loss_fn="importance_sampling"),
                      OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=0.05))))
    steps_through_a_kill(local, distributed, steps, pid)
    after, new_pid = ray.get(rank.hello.remote(), timeout=60)
    assert (after, new_pid) != (before, pid) and distributed.trainer.incarnations[killed] == after
    # every model the ranks held came along, not only the one trained here
    for other in ("fwd:train:0", "equal:train:0"):
        if local.trainer.has_model(other):
            assert same_adapter(adapter(local, other), adapter(distributed, other)), other


def test_with_every_trainer_rank_killed_the_models_are_gone_and_the_trainer_serves_again(runtimes):
    """No survivor to copy from: the call fails (the consumer's durable restore rebuilds the models on their next
    use, e2e/test_durable.py), the trainer knows no model, and a new one trains as in process. Last in this module:
    it drops every model the ranks held."""
    local, distributed = runtimes
    model = "orphan:train:0"
    for rt in runtimes:
        create(rt, model)
    for rank in distributed.trainer.ranks:
        os.kill(ray.get(rank.hello.remote(), timeout=60)[1], signal.SIGKILL)
    data = [datum(p, [40, 41, 42], 1.0) for p in PROMPTS]
    request = ForwardBackwardRequest(model_id=model, data=data, loss_fn="importance_sampling")
    with pytest.raises(RanksLost):
        distributed.trainer.forward(request, True)
    assert not distributed.trainer.has_model(model)
    create(distributed, model)
    local.trainer.remove_model(model)
    create(local, model)
    assert distributed.execute(request) == local.execute(request)


def test_one_rank_runs_the_whole_request_as_the_in_process_trainer_does(runtimes, tmp_path):
    """One bundle (the single-GPU Ray worker): the rank gets the request whole, in one trainer call (not one call per
    micro-batch), and its outputs, loss and adapter after two forward_backwards and a step equal the in-process
    runtime's bit for bit."""
    from worker.ray_runtime.data_parallel import assignment

    local, _ = runtimes
    one = build_runtime(config(tmp_path, runtime="ray", ray_gpus=1, ray_namespace="one-rank"))
    try:
        model = "one-rank:train:0"
        data = [datum(p, [40, 41, 42, 43, 44, 45], 1.0 if i % 2 else -0.5) for i, p in enumerate(PROMPTS * 2)]
        request = ForwardBackwardRequest(model_id=model, data=data, loss_fn="importance_sampling")
        assert assignment(request, MICRO_BATCH_TOKENS, 1) == [[(0, len(data))]]
        answers = []
        for rt in (local, one):
            create(rt, model)
            answers.append([rt.execute(request), rt.execute(request.model_copy(update={"data": data[:3]})),
                            rt.execute(OptimStepRequest(model_id=model, adam_params=AdamParams(learning_rate=0.05)))])
        assert answers[0] == answers[1]
        assert same_adapter(adapter(local, model), adapter(one, model))
    finally:
        one.engine.close()
