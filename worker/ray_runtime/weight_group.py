"""Weight sync from trainer rank 0 to the engine replicas without Ray's object store (a pickle into it, one out of it
per replica, a Ray call's overhead each): a replica on the trainer's own GPU maps the export's memory by CUDA IPC and
copies it; any other replica takes a broadcast over a group of rank 0 and those replicas: NCCL, from GPU memory to
GPU memory, where every member has a GPU of its own (`backend_for`), else gloo from host memory.

Group members: rank 0 is trainer rank 0, the others the replicas not served by IPC, in index order. The group is
formed on the first sync that needs it and again whenever a member was restarted since (each member says which
formation it joined: its `generation`, 0 for none) or the backend its members call for changed. A sync: the trainer
stages an export (its buffers, one per dtype: the adapter's tensors are views of them, see lora_io.AdapterExport) and
answers the WeightsMeta receivers allocate from (with IPC handles of the buffers where they are on a GPU); the group
broadcasts the buffers from rank 0 in buckets of at most BUCKET_BYTES, all posted at once and waited for once. The
facade's snapshot record (snapshots.py) still keeps a reference in the object store, to rebuild a replica Ray
restarts: the trainer makes it after the sync, so it delays the trainer's next call, not the sync.

The NCCL path has not run: it needs two GPUs, and no machine with several has been lent (docs/gpu-and-ray.md).
"""

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from worker.torch_runtime.host_copy import copy_to_host
from worker.torch_runtime.lora_io import Layout, LoraWeights, _packed, _unpacked

log = logging.getLogger(__name__)

BUCKET_BYTES = 256 << 20
# A broadcast waiting longer than this for a member has lost it (gloo notices a dead peer's closed socket at once;
# this bounds a member that is alive but never posted its part). The facade (weight_sync.py) then forms the group
# again.
GROUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WeightsMeta:
    """What a receiver allocates and reassembles an export from (small: no tensor data)."""

    config: Any
    layout: Layout
    buffers: tuple[tuple[torch.dtype, int], ...]
    generation: int  # the formation the sender is in
    gpu: str | None = None  # the GPU the sender's buffers are on (its UUID), None for host memory
    handles: tuple = ()  # per buffer, its CUDA IPC handle (torch's reduction) where `gpu` is set


@dataclass(frozen=True)
class OnTrainer:
    """A model's current weights, left on trainer rank 0 until the engine facade sends them (RayTrainer's export
    under the group transport)."""

    model_id: str


def backend_for(sender_gpu: str | None, receiver_gpus: list[str | None]) -> str:
    """NCCL where the sender's buffers and every receiver are on GPUs, each a GPU of its own (NCCL refuses two ranks
    on one device); else gloo, through host memory."""
    gpus = [sender_gpu, *receiver_gpus]
    if None in gpus or len(set(gpus)) != len(gpus) or not dist.is_nccl_available():
        return "gloo"
    return "nccl"


def gpu_of(device: torch.device | str) -> str | None:
    """The physical GPU a device is (its UUID: each Ray actor numbers the GPUs it sees from 0), None off a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


class GroupMember:
    """One actor's place in the weights group, and on the sender its staged export."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.gpu = gpu_of(device)
        self.backend = "gloo"
        self.group: Any = None
        self._store: Any = None
        self.generation = 0
        self._staged: tuple[list[torch.Tensor], WeightsMeta] | None = None
        self._on_host: list[torch.Tensor] | None = None  # the staged buffers' host copy, once made

    def join(self, host: str, port: int, rank: int, world: int, generation: int, backend: str = "gloo") -> None:
        """Every member calls this at once; it returns when all have (rank 0 hosts the rendezvous store)."""
        self.leave()
        timeout = timedelta(seconds=GROUP_TIMEOUT_S)
        self._store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout)  # rank 0's serves the others
        if backend == "nccl":
            self.group = nccl_group(self._store, rank, world, self.device, timeout)
        else:
            self.group = dist.ProcessGroupGloo(self._store, rank, world, timeout)
        self.generation, self.backend = generation, backend

    def leave(self) -> None:
        self.group, self._store, self.generation, self.backend = None, None, 0, "gloo"

    def broadcast(self, buffers: list[torch.Tensor]) -> None:
        """Rank 0's buffers into everyone's, bucket by bucket, with one wait at the end."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        works = [self.group.broadcast([bucket], options) for buffer in buffers for bucket in buckets(buffer)]
        for work in works:
            work.wait()

    # -- the sender --

    def stage(self, weights: LoraWeights) -> WeightsMeta:
        """Hold the export until `unstage`; what receivers need to take it."""
        buffers, layout = _packed(weights.tensors)
        handles = _ipc_handles(buffers)
        meta = WeightsMeta(weights.config, layout, tuple((b.dtype, b.numel()) for b in buffers), self.generation,
                           self.gpu if handles else None, handles)
        self._staged, self._on_host = (buffers, meta), None
        return meta

    def send(self, generation: int) -> None:
        """Broadcast the staged export in formation `generation`: over NCCL from the GPU, over gloo from its host
        copy."""
        if generation != self.generation:
            raise RuntimeError(f"asked to send in formation {generation}; this member is in {self.generation}")
        self.broadcast(self._staged[0] if self.backend == "nccl" else self._host_buffers())

    def unstage(self) -> LoraWeights:
        """The export last staged, on the host (for the facade's record), no longer held here."""
        meta, buffers = self._staged[1], self._host_buffers()
        self._staged, self._on_host = None, None
        return _unpacked(meta.config, buffers, meta.layout)

    def _host_buffers(self) -> list[torch.Tensor]:
        """The staged buffers in host memory, copied once for the broadcast and the record alike (no copy on the
        CPU). From a GPU through pinned memory: a copy from the device into pageable memory is many times slower
        (bench/ipc_check.py)."""
        if self._on_host is None:
            buffers = self._staged[0]
            if buffers and buffers[0].is_cuda:
                copied = copy_to_host(buffers)
                copied.wait()
                self._on_host = copied.tensors
            else:
                self._on_host = list(buffers)
        return self._on_host

    # -- a receiver --

    def receive(self, meta: WeightsMeta) -> LoraWeights:
        """By CUDA IPC where the sender's buffers are on this member's GPU, else by the group's broadcast."""
        if meta.gpu is not None and meta.gpu == self.gpu:
            return self._mapped(meta)
        if meta.generation != self.generation or self.group is None:
            raise RuntimeError(f"the weights group is formation {self.generation}, the sender's {meta.generation}")
        device = self.device if self.backend == "nccl" else "cpu"
        buffers = [torch.empty(n, dtype=dtype, device=device) for dtype, n in meta.buffers]
        self.broadcast(buffers)
        return _unpacked(meta.config, buffers, meta.layout)

    @staticmethod
    def _mapped(meta: WeightsMeta) -> LoraWeights:
        """A copy of the sender's buffers, read through their IPC handles: the engines keep what they are handed
        (vLLM's in-place LoRA path re-activates slots from it), and the sender frees its buffers after the sync."""
        shared = [rebuild(*args) for rebuild, args in meta.handles]
        buffers = [tensor.clone() for tensor in shared]
        torch.cuda.current_stream(buffers[0].device).synchronize()  # copied before the handles are let go
        del shared
        return _unpacked(meta.config, buffers, meta.layout)


def nccl_group(store: Any, rank: int, world: int, device: torch.device, timeout: timedelta) -> Any:
    """An NCCL group on this member's GPU; a collective that outlasts `timeout` raises (cluster.configure_actor)."""
    torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())  # "cuda" alone
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, options)


def _ipc_handles(buffers: list[torch.Tensor]) -> tuple:
    """CUDA IPC handles of buffers on a GPU; none (the group's host path serves every replica) off a GPU or where
    the process cannot share its memory."""
    if not buffers or not buffers[0].is_cuda:
        return ()
    torch.cuda.current_stream(buffers[0].device).synchronize()  # written before another process reads them
    try:
        return tuple(reduce_tensor(buffer) for buffer in buffers)
    except RuntimeError:
        log.exception("CUDA IPC handles could not be made: syncs go through host memory")
        return ()


def buckets(buffer: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous slices of at most BUCKET_BYTES (the same on every member: they depend only on size and dtype)."""
    flat = buffer.view(-1)
    return list(flat.split(max(1, BUCKET_BYTES // flat.element_size())))
