"""The engine facade's side of a sync by the weights group (weight_group.py says what the members do): which replicas
take trainer rank 0's export by CUDA IPC and which by the group's broadcast, forming the group when its members
changed, and which replicas did not take it."""

import logging

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError

from worker.ray_runtime.weight_group import GROUP_TIMEOUT_S, WeightsMeta

log = logging.getLogger(__name__)


class GroupSync:
    """Forms the group over trainer rank 0 and the replicas a sync broadcasts to, and runs each sync."""

    def __init__(self, sender: ActorHandle, timeout_s: float) -> None:
        self.sender, self.timeout_s = sender, timeout_s
        self.generation = 0
        self.formed: dict[int, str] = {}  # replica -> the incarnation it was when it joined
        self._gpus: dict[str, str | None] = {}  # a replica incarnation -> its GPU

    def deliver(self, model_id: str, version: int, replicas: dict[int, tuple[ActorHandle, str]],
                base_model: str | None) -> tuple[ray.ObjectRef, list[int]]:
        """Send the model's current weights to these replicas (index -> (handle, incarnation)), which add the model
        (base_model given) or apply them as `version`: by CUDA IPC to those on the trainer's GPU, over the group to
        the others. A reference to the weights (for the snapshot record) and the replicas that did not take them
        (each to be rebuilt from the record)."""
        meta = ray.get(self.sender.stage_weights.remote(model_id), timeout=self.timeout_s)
        mapped = {i for i, (handle, incarnation) in replicas.items()
                  if meta.gpu is not None and self._gpu(handle, incarnation) == meta.gpu}
        grouped = {i: replica for i, replica in replicas.items() if i not in mapped}
        calls = []
        if grouped:
            if meta.generation != self.generation or {i: inc for i, (_, inc) in grouped.items()} != self.formed:
                self._form(grouped)
            calls.append(self.sender.send_staged.remote(self.generation))
        meta = WeightsMeta(meta.config, meta.layout, meta.buffers, self.generation, meta.gpu, meta.handles)
        taken = {i: handle.receive_weights.remote(incarnation, model_id, version, meta, base_model)
                 for i, (handle, incarnation) in replicas.items()}
        ray.wait([*calls, *taken.values()], num_returns=len(calls) + len(taken),
                 timeout=GROUP_TIMEOUT_S + self.timeout_s)
        failed = [i for i, ref in taken.items() if not _ok(ref)]
        if not all(_ok(ref) for ref in calls):
            failed = sorted(set(failed) | set(grouped))
        if failed:
            self.formed = {}  # formed again at the next sync that needs it
            log.warning("weights group: replicas %s did not take %s v%d", failed, model_id, version)
        return self.sender.staged_weights.remote(), failed

    def _gpu(self, replica: ActorHandle, incarnation: str) -> str | None:
        """The GPU a replica's engine is on (asked once per incarnation)."""
        if incarnation not in self._gpus:
            self._gpus[incarnation] = ray.get(replica.weights_gpu.remote(), timeout=self.timeout_s)
        return self._gpus[incarnation]

    def _form(self, replicas: dict[int, tuple[ActorHandle, str]]) -> None:
        self.generation += 1
        members = [self.sender, *(handle for handle, _ in replicas.values())]
        ray.wait([m.weights_leave.remote() for m in members], num_returns=len(members), timeout=self.timeout_s)
        host, port = ray.get(self.sender.address.remote(), timeout=self.timeout_s)
        ray.get([m.weights_join.remote(host, port, rank, len(members), self.generation)
                 for rank, m in enumerate(members)], timeout=GROUP_TIMEOUT_S + self.timeout_s)
        self.formed = {i: incarnation for i, (_, incarnation) in replicas.items()}
        log.info("weights group formed (formation %d): trainer rank 0 and replicas %s", self.generation,
                 sorted(replicas))


def _ok(ref: ray.ObjectRef) -> bool:
    try:
        ray.get(ref, timeout=0)
        return True
    except GetTimeoutError:
        return False
    except Exception:  # noqa: BLE001 - the member died or refused (Stale, a broken group): it did not take them
        return False
