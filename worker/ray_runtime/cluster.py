"""Starting or joining Ray, and the placement group a worker's actors live on (one device per bundle)."""

import logging
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from worker.runtime import cuda_allocator

log = logging.getLogger(__name__)
# the worker's log level, for its actors: their INFO lines (vLLM's engine runs, memory plans) reach the worker's log
# through Ray's log_to_driver
ACTOR_LOG_LEVEL_ENV = "TINKERQ_RAY_ACTOR_LOG_LEVEL"
# beside TINKERQ_*: what the actors' imports and allocations read (cuda_allocator.py: they allocate as the worker does)
FORWARDED_ENV = ("PYTHONPATH", "HF_HOME", *cuda_allocator.ALLOC_CONF_VARS)
READY_TIMEOUT_S = 300.0  # a placement group that cannot be placed by then is an error, not a hang
SHUTDOWN_TIMEOUT_S = 30.0


def connect(address: str | None, cpus: int | None = None, namespace: str = "") -> bool:
    """Join the cluster at `address` ("auto": the one on this host), or start a local one of `cpus` CPUs; False
    if this process was connected already (whoever connected it disconnects it).
    The worker's TINKERQ_* settings, PYTHONPATH and torch's allocator settings go to every actor, so they build
    what the consumer would (`actor_env`)."""
    if address and address.startswith("ray://"):
        # Ray Client refuses streaming actor calls, which carry every sample's result (engines.py): refuse at
        # start rather than fail the first sample.
        raise ValueError(f"--ray-address {address}: Ray Client (ray://) cannot stream the engine replicas' results; "
                         "run the worker on a node of the cluster (`ray start --address HEAD:6379` there) with "
                         "--ray-address auto")
    if ray.is_initialized():
        return False
    namespace = namespace or f"tinkerq-{socket.gethostname()}-{os.getpid()}"
    runtime_env = {"env_vars": actor_env(os.environ)}
    if address:
        ray.init(address=address, namespace=namespace, runtime_env=runtime_env, log_to_driver=True)
    else:
        ray.init(num_cpus=cpus, namespace=namespace, include_dashboard=False, runtime_env=runtime_env,
                 log_to_driver=True)
    return True


def actor_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What every actor's process gets of the worker's environment (also on a cluster started elsewhere)."""
    env = {k: v for k, v in environ.items() if k.startswith("TINKERQ_") or k in FORWARDED_ENV}
    env.setdefault(ACTOR_LOG_LEVEL_ENV, logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    return env


def configure_actor() -> None:
    """In an actor's process, first: log at the worker's level (Ray prefixes each line with the actor's name and
    pid); and an NCCL collective that outlasts its group's timeout (a peer died) raises in its caller, which re-forms
    the group, instead of NCCL's watchdog ending the process (torch's default), which would take a surviving trainer
    rank's models with it."""
    logging.basicConfig(level=os.environ.get(ACTOR_LOG_LEVEL_ENV, "WARNING"),
                        format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # CleanUpOnly: abort the communicator, raise
    import torch  # Ray sets OMP_NUM_THREADS=1 for an actor without CPUs of its own: say what torch got

    log.info("torch in this actor uses %d CPU thread(s) (OMP_NUM_THREADS=%s)", torch.get_num_threads(),
             os.environ.get("OMP_NUM_THREADS"))


def disconnect() -> None:
    """ray.shutdown, bounded: a wedged raylet must not keep the worker from exiting."""
    thread = threading.Thread(target=ray.shutdown, daemon=True)
    thread.start()
    thread.join(SHUTDOWN_TIMEOUT_S)
    if thread.is_alive():
        log.warning("ray.shutdown did not finish in %.0f s; exiting without it", SHUTDOWN_TIMEOUT_S)


@dataclass(frozen=True)
class Placement:
    """N bundles packed onto as few nodes as possible; each holds one engine replica and one trainer rank
    (colocated, as SkyRL's colocate_all and veRL's hybrid engine do), each taking a share of its device."""

    group: PlacementGroup
    bundles: int
    gpu: bool

    def options(self, bundle: int, share: float) -> dict:
        """Ray actor options placing an actor on `bundle`, with `share` of its device."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = {"num_gpus": share, "num_cpus": 0} if self.gpu else {"num_cpus": share}
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle,
                                                    placement_group_capture_child_tasks=True)
        return {**resources, "scheduling_strategy": strategy}

    def devices(self, first: int, count: int) -> list[str] | None:
        """The GPUs of bundles first..first+count-1, as their node numbers them (what CUDA_VISIBLE_DEVICES lists there),
        for one process that uses them all: a tensor-parallel engine replica. None where Ray's own assignment serves
        (one bundle) or there are no GPUs. The bundles must share a node (ValueError)."""
        if count == 1:
            return None
        bundles = [(first + k) % self.bundles for k in range(count)]
        nodes = {placement_group_table(self.group)["bundles_to_node_id"][b] for b in bundles}
        if len(nodes) > 1:
            raise ValueError(f"bundles {bundles} span {len(nodes)} nodes: a tensor-parallel engine needs its GPUs "
                             "on one node (vLLM's multiprocessing executor)")
        if not self.gpu:
            return None
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        @ray.remote(num_gpus=0.01, num_cpus=0)
        def gpu() -> str:
            return str(ray.get_gpu_ids()[0])

        on = [PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=b) for b in bundles]
        return ray.get([gpu.options(scheduling_strategy=strategy).remote() for strategy in on],
                       timeout=READY_TIMEOUT_S)

    def remove(self) -> None:
        remove_placement_group(self.group)


def place(bundles: int, gpu: bool | None = None) -> Placement:
    """A placement group of `bundles` bundles: one GPU each where the cluster has GPUs (unless `gpu` says),
    else one CPU each."""
    if bundles < 1:
        raise ValueError(f"a Ray worker needs at least one bundle, got {bundles}")
    if gpu is None:
        gpu = ray.cluster_resources().get("GPU", 0) > 0
    shape = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
    group = placement_group([dict(shape) for _ in range(bundles)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(f"Ray could not place {bundles} bundles of {shape} in {READY_TIMEOUT_S:.0f} s "
                           f"(cluster: {ray.cluster_resources()})") from None
    return Placement(group, bundles, gpu)
