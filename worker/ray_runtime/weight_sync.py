"""The engine facade's side of a sync by the weights group (weight_group.py says what the members do): which replicas
take trainer rank 0's export by CUDA IPC and which by the group's broadcast, forming the group when its members
changed, and which replicas did not take it."""

import logging
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError

from worker.ray_runtime.weight_group import GROUP_TIMEOUT_S, WeightsMeta, backend_for

log = logging.getLogger(__name__)


class GroupSync:
    """Forms the group over trainer rank 0 and the replicas a sync broadcasts to, and runs each sync."""

    def __init__(self, sender: ActorHandle, timeout_s: float) -> None:
        self.sender, self.timeout_s = sender, timeout_s
        self.generation = 0
        self.formed: set[int] = set()  # the replicas in the current formation
        self.backend = "gloo"  # the current formation's (weight_group.backend_for)
        self.unmapped: set[str] = set()  # replica incarnations whose CUDA IPC read failed: they take the broadcast

    def deliver(self, model_id: str, version: int, replicas: dict[int, tuple[ActorHandle, str]],
                base_model: str | None) -> tuple[ray.ObjectRef, list[int]]:
        """Send the model's current weights to these replicas (index -> (handle, incarnation)), which add the model
        (base_model given) or apply them as `version`: by CUDA IPC to those on the trainer's GPU, over the group to
        the others. A reference to the weights (for the snapshot record) and the replicas that did not take them
        (each to be rebuilt from the record).

        Every replica says first, while the trainer stages the export, that it is the incarnation the facade synced
        and which formation it is in: a broadcast that counted a member that died or was restarted since would wait
        out GROUP_TIMEOUT_S on every member (gloo does not notice a peer that died between two collectives)."""
        staged = self.sender.stage_weights.remote(model_id)
        asked = {i: handle.weights_ready.remote(incarnation) for i, (handle, incarnation) in replicas.items()}
        meta = ray.get(staged, timeout=self.timeout_s)
        ready = {i: _value(ref, self.timeout_s) for i, ref in asked.items()}  # (GPU, formation); None: not there
        failed = {i for i, answer in ready.items() if answer is None}
        mapped = {i for i in ready if i not in failed and meta.gpu is not None and ready[i][0] == meta.gpu
                  and replicas[i][1] not in self.unmapped}
        grouped = {i: replicas[i] for i in ready if i not in failed and i not in mapped}
        sent = self._send(meta, grouped, ready) if grouped else None
        meta = WeightsMeta(meta.config, meta.layout, meta.buffers, self.generation, meta.gpu, meta.handles)
        targets = mapped | (set(grouped) if sent is not None else set())  # none waits on a broadcast never sent
        taken = {i: replicas[i][0].receive_weights.remote(replicas[i][1], model_id, version, meta, base_model)
                 for i in sorted(targets)}
        calls = [*taken.values(), *([sent] if sent is not None else [])]
        ray.wait(calls, num_returns=len(calls), timeout=GROUP_TIMEOUT_S + self.timeout_s)
        lost = {i for i, ref in taken.items() if not _ok(ref)}
        self.unmapped |= {replicas[i][1] for i in lost & mapped}  # never again by IPC, this incarnation
        failed |= lost
        if grouped and (sent is None or not _ok(sent)):
            failed |= set(grouped)  # the broadcast failed: whatever they hold, they are rebuilt
        if failed:
            self.formed = set()  # formed again at the next sync that needs it
            log.warning("weights group: replicas %s did not take %s v%d", sorted(failed), model_id, version)
        return self.sender.staged_weights.remote(), sorted(failed)

    def _send(self, meta: WeightsMeta, grouped: dict[int, tuple[ActorHandle, str]],
              ready: dict[int, tuple[str | None, int]]) -> ray.ObjectRef | None:
        """Rank 0's broadcast to these replicas (the group formed again first where its members changed); None if
        the group could not be formed (a member died meanwhile)."""
        backend = backend_for(meta.gpu, [ready[i][0] for i in grouped])
        if (meta.generation != self.generation or set(grouped) != self.formed or backend != self.backend
                or any(ready[i][1] != self.generation for i in grouped)):
            try:
                self._form(grouped, backend)
            except Exception:  # a member lost while joining: this sync leaves the group out
                log.exception("weights group: forming it with replicas %s failed", sorted(grouped))
                return None
        return self.sender.send_staged.remote(self.generation)

    def _form(self, replicas: dict[int, tuple[ActorHandle, str]], backend: str) -> None:
        self.generation += 1
        members = [self.sender, *(handle for handle, _ in replicas.values())]
        ray.wait([m.weights_leave.remote() for m in members], num_returns=len(members), timeout=self.timeout_s)
        host, port = ray.get(self.sender.address.remote(), timeout=self.timeout_s)
        ray.get([m.weights_join.remote(host, port, rank, len(members), self.generation, backend)
                 for rank, m in enumerate(members)], timeout=GROUP_TIMEOUT_S + self.timeout_s)
        self.formed, self.backend = set(replicas), backend
        log.info("weights group formed (formation %d, %s): trainer rank 0 and replicas %s", self.generation, backend,
                 sorted(replicas))


def _value(ref: ray.ObjectRef, timeout_s: float) -> Any:
    """The call's value; None where the member died or refused (Stale: restarted since it was synced)."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except Exception:  # noqa: BLE001 - any failure means the same: do not count it in this sync
        return None


def _ok(ref: ray.ObjectRef) -> bool:
    try:
        ray.get(ref, timeout=0)
        return True
    except GetTimeoutError:
        return False
    except Exception:  # noqa: BLE001 - the member died or refused (Stale, a broken group): it did not take them
        return False
