"""Weight sync over a torch.distributed group of its own: trainer rank 0 broadcasts an adapter's export to the engine
replicas over gloo, from host memory, instead of handing them a copy through Ray's object store (a pickle into it,
one out of it per replica, and a Ray call's overhead each). Not built: NCCL between members on GPUs of their own and
CUDA IPC between members that share one (engine replica 0 shares trainer rank 0's bundle).

Members: rank 0 is trainer rank 0, rank 1 + i engine replica i. The group is formed on the first sync and again
whenever a member was restarted since (each member says which formation it joined: its `generation`, 0 for none).
A sync: the trainer stages an export (its buffers, one per dtype: the adapter's tensors are views of them, see
lora_io.AdapterExport) and answers the WeightsMeta receivers allocate from; every member then broadcasts the buffers
from rank 0 in buckets of at most BUCKET_BYTES, all posted at once and waited for once. The facade's snapshot record
(snapshots.py) still keeps a reference in the object store, to rebuild a replica Ray restarts: the trainer makes it
after the broadcast, so it delays the trainer's next call, not the sync.
"""

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError

from worker.torch_runtime.lora_io import Layout, LoraWeights, _packed, _unpacked

log = logging.getLogger(__name__)

BUCKET_BYTES = 256 << 20
# A broadcast waiting longer than this for a member has lost it (gloo notices a dead peer's closed socket at once;
# this bounds a member that is alive but never posted its part). The facade then forms the group again.
GROUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WeightsMeta:
    """What a receiver allocates and reassembles an export from (small: no tensor data)."""

    config: Any
    layout: Layout
    buffers: tuple[tuple[torch.dtype, int], ...]
    generation: int  # the formation the sender is in


@dataclass(frozen=True)
class OnTrainer:
    """A model's current weights, left on trainer rank 0 until the engine facade broadcasts them (RayTrainer's
    export under the group transport)."""

    model_id: str


class GroupMember:
    """One actor's place in the weights group."""

    def __init__(self) -> None:
        self.group: Any = None
        self._store: Any = None
        self.generation = 0

    def join(self, host: str, port: int, rank: int, world: int, generation: int) -> None:
        """Every member calls this at once; it returns when all have (rank 0 hosts the rendezvous store)."""
        self.leave()
        timeout = timedelta(seconds=GROUP_TIMEOUT_S)
        self._store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout)  # rank 0's serves the others
        self.group = dist.ProcessGroupGloo(self._store, rank, world, timeout)
        self.generation = generation

    def leave(self) -> None:
        self.group, self._store, self.generation = None, None, 0

    def broadcast(self, buffers: list[torch.Tensor]) -> None:
        """Rank 0's buffers into everyone's, bucket by bucket, with one wait at the end."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        works = [self.group.broadcast([bucket], options) for buffer in buffers for bucket in buckets(buffer)]
        for work in works:
            work.wait()

    def stage(self, weights: LoraWeights) -> tuple[list[torch.Tensor], WeightsMeta]:
        buffers, layout = _packed(weights.tensors)
        buffers = [buffer.cpu() for buffer in buffers]  # gloo's from host memory (a no-op on the CPU)
        meta = WeightsMeta(weights.config, layout, tuple((b.dtype, b.numel()) for b in buffers), self.generation)
        return buffers, meta

    def receive(self, meta: WeightsMeta) -> LoraWeights:
        if meta.generation != self.generation or self.group is None:
            raise RuntimeError(f"the weights group is formation {self.generation}, the sender's {meta.generation}")
        buffers = [torch.empty(n, dtype=dtype) for dtype, n in meta.buffers]
        self.broadcast(buffers)
        return _unpacked(meta.config, buffers, meta.layout)


def buckets(buffer: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous slices of at most BUCKET_BYTES (the same on every member: they depend only on size and dtype)."""
    flat = buffer.view(-1)
    return list(flat.split(max(1, BUCKET_BYTES // flat.element_size())))


class GroupSync:
    """The facade's side: forms the group over trainer rank 0 and the replicas a sync goes to, and runs the sync."""

    def __init__(self, sender: ActorHandle, timeout_s: float) -> None:
        self.sender, self.timeout_s = sender, timeout_s
        self.generation = 0
        self.formed: dict[int, str] = {}  # replica -> the incarnation it was when it joined

    def deliver(self, model_id: str, version: int, replicas: dict[int, tuple[ActorHandle, str]],
                base_model: str | None) -> tuple[ray.ObjectRef, list[int]]:
        """Broadcast the model's current weights to these replicas (index -> (handle, incarnation)), which add the
        model (base_model given) or apply them as `version`. A reference to the weights (for the snapshot record)
        and the replicas that did not take them (each to be rebuilt from the record)."""
        meta = ray.get(self.sender.stage_weights.remote(model_id), timeout=self.timeout_s)
        targets = {i: incarnation for i, (_, incarnation) in replicas.items()}
        if meta.generation != self.generation or targets != self.formed:
            self._form(replicas)
            meta = WeightsMeta(meta.config, meta.layout, meta.buffers, self.generation)
        sent = self.sender.send_staged.remote(self.generation)
        taken = {i: handle.receive_weights.remote(incarnation, model_id, version, meta, base_model)
                 for i, (handle, incarnation) in replicas.items()}
        ray.wait([sent, *taken.values()], num_returns=1 + len(taken), timeout=GROUP_TIMEOUT_S + self.timeout_s)
        failed = [i for i, ref in taken.items() if not _ok(ref)]
        if failed or not _ok(sent):
            self.formed = {}  # formed again at the next sync
            log.warning("weights group: replicas %s did not take %s v%d", failed or "(the sender failed)", model_id,
                        version)
            if not _ok(sent):
                failed = list(replicas)
        return self.sender.staged_weights.remote(), failed

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
