"""Assemble the Ray runtime (`worker/runtime/registry.py` picks it): join or start Ray, place the bundles, start the
engine replicas and trainer ranks on them, and put the facades in front."""

import logging
import os
from pathlib import Path

import ray

from tinkerq.config import RuntimeConfig
from worker.ray_runtime import cluster
from worker.ray_runtime.engine_actor import EngineReplica
from worker.ray_runtime.engines import RayEngine
from worker.ray_runtime.trainer_actor import CONCURRENCY_GROUPS, TrainerRank
from worker.ray_runtime.trainers import CALL_TIMEOUT_S, RayTrainer
from worker.ray_runtime.weight_sync import GroupSync
from worker.runtime.versioned import Runtime

log = logging.getLogger(__name__)


def _refused(config: RuntimeConfig, gpu: bool, bundles: int, engines: int) -> str | None:
    """Why these settings cannot run on this placement; None where they can."""
    tp = config.vllm_tensor_parallel_size
    if tp > 1 and engines * tp > bundles:
        return (f"{engines} engine replica(s) of vllm_tensor_parallel_size={tp} need {engines * tp} bundles; the "
                f"placement has {bundles} (TINKERQ_RAY_GPUS)")
    if (gpu and config.ray_trainer_sharding == "fsdp" and config.engine == "vllm"
            and config.vllm_gpu_memory_utilization == "auto"):
        # `auto` measures a rank's training pass alone, which over a sharded base would wait for the other ranks
        return ("ray_trainer_sharding=fsdp on GPUs needs vllm_gpu_memory_utilization set to a number, not auto "
                "(TINKERQ_VLLM_GPU_MEMORY_UTILIZATION)")
    return None


def make_runtime(config: RuntimeConfig) -> Runtime:
    bundles = max(config.ray_gpus, 1)
    tp = config.vllm_tensor_parallel_size  # each replica spans tp bundles (its engine's GPUs, one node)
    engines = config.ray_engine_replicas or max(bundles // tp, 1)
    ranks = config.ray_trainer_ranks or bundles
    connected = cluster.connect(config.ray_address or None,
                                cpus=config.ray_num_cpus or max(bundles, os.cpu_count() or 1),
                                namespace=config.ray_namespace)
    placement = cluster.place(bundles)
    # Replica i sits on bundle i*tp and, with tensor parallelism, uses the GPUs of bundles i*tp..i*tp+tp-1.
    firsts = [i * tp % bundles for i in range(engines)]
    refused, devices = _refused(config, placement.gpu, bundles, engines), []
    if not refused:
        try:
            devices = [placement.devices(b, tp) for b in firsts]
        except ValueError as exc:  # a replica's bundles span nodes
            refused = str(exc)
    if refused:
        placement.remove()
        if connected:
            cluster.disconnect()
        raise ValueError(refused)
    sharded = config.ray_trainer_sharding == "fsdp"
    # named in the worker's namespace also where this process was connected already (by an embedder, or a test
    # holding two runtimes)
    named = {"namespace": config.ray_namespace} if config.ray_namespace else {}
    # Each bundle hosts an engine replica and a trainer rank, so each gets a share of its device (on a GPU,
    # vLLM's own gpu_memory_utilization decides how much memory it takes).
    share = 0.5
    # A rank Ray restarts rejoins a re-formed group and takes a survivor's models (trainers.RayTrainer._regroup).
    rank_actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(TrainerRank)
    trainers = [rank_actor.options(**placement.options(i % bundles, share), name=f"trainer-{i}", **named,
                                   max_restarts=config.ray_max_restarts, max_task_retries=0)
                .remote(config, i, ranks) for i in range(ranks)]
    # each replica sizes vLLM's share of its GPUs from the trainer rank on its own bundle, where there is one
    replicas = [ray.remote(EngineReplica).options(**placement.options(b, share), name=f"engine-{i}", **named,
                                                  max_restarts=config.ray_max_restarts, max_task_retries=0)
                .remote(config, trainers[b] if placement.gpu and b < ranks and not sharded else None, devices[i])
                for i, b in enumerate(firsts)]
    host, port = ray.get(trainers[0].address.remote(), timeout=CALL_TIMEOUT_S)
    ray.get([t.join.remote(host, port) for t in trainers], timeout=CALL_TIMEOUT_S)
    log.info("Ray runtime: %d bundles (%s), %d engine replicas, %d trainer ranks, weights by %s", bundles,
             "GPU" if placement.gpu else "CPU", engines, ranks, config.ray_weight_transport)

    def close() -> None:
        for trainer in trainers:
            ray.kill(trainer, no_restart=True)
        placement.remove()
        if connected:
            cluster.disconnect()

    # The trainer's transport decides what its exports are (trainers.TRANSPORTS); the engine facade takes either.
    engine = RayEngine(replicas, config.max_snapshots, GroupSync(trainers[0], CALL_TIMEOUT_S), on_close=close)
    return Runtime(RayTrainer(trainers, Path(config.checkpoint_root), config.ray_weight_transport, sharded), engine)
