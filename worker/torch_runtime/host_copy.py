"""Copy a model's tensors to host memory inside a training step, for a durable checkpoint written on a side thread.

Training changes the adapter, AdamW's moments and the gradients in place at its next step, so what a checkpoint
writes must be copied before the step returns; writing it (serialising, tar, disk) can then happen while training
goes on. The copy is one `torch.cat` per device and dtype (a few kernels, however many tensors) into one buffer,
on a GPU followed by one copy into pinned host memory that is only enqueued: the step's thread does not wait for it,
the writer does (`HostTensors.wait`). Later kernels on the same stream run after the copy, so it reads the values
of this step.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclass
class HostTensors:
    tensors: list[torch.Tensor]  # on the CPU, in the order given; not to be read before wait()
    ready: list[Any]  # CUDA events recorded after the copies into pinned memory

    def wait(self) -> None:
        for event in self.ready:
            event.synchronize()


def copy_to_host(tensors: Sequence[torch.Tensor]) -> HostTensors:
    """Host copies of `tensors` (never views of them)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    ready = []
    with torch.no_grad():
        for (device, dtype), members in groups.items():
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in members])  # a copy, even of one tensor
            if device.type == "cuda":
                host = torch.empty(flat.numel(), dtype=dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                ready.append(event)
            else:
                host = flat.cpu()
            for i, part in zip(members, host.split([tensors[i].numel() for i in members]), strict=True):
                out[i] = part.view(tensors[i].shape)
    return HostTensors(out, ready)


def tree_to_host(tree: Any) -> tuple[Any, HostTensors]:
    """`tree` (dicts, lists, tuples) with every tensor replaced by its host copy; the containers are new too, so a
    later change to the live ones (an optimizer's param_groups) does not reach it."""
    leaves, spec = pytree.tree_flatten(tree)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    host = copy_to_host([leaves[i] for i in where])
    for i, tensor in zip(where, host.tensors, strict=True):
        leaves[i] = tensor
    return pytree.tree_unflatten(leaves, spec), host
