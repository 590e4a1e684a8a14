"""FSDP for the trainer ranks (TINKERQ_RAY_TRAINER_SHARDING=fsdp): a base's decoder layers sharded over the ranks with
torch's FSDP2 (`fully_shard`), for a base whose weights do not fit one device beside the training pass.

What is sharded: each decoder layer's weights (the bulk of a model), one FSDP unit per layer, gathered whole before
the layer runs and freed after, forward and backward. The embedding, the final norm and the unembedding stay whole
on every rank: the unembedding reads its weight itself, chunk by chunk (unembedding.py), not through a module call
FSDP could hook. LoRA adapters are added after sharding and are plain tensors, whole on every rank: their gradients
are summed by the ranks' commit as without FSDP, so the results stay the in-process trainer's bit for bit (a gathered
weight holds the same values).

The price: a layer's gather takes every rank, so every rank runs the same passes in lockstep. A rank given fewer of a
request's micro-batches than another runs filler passes (`filler`) until they are even, and drops their outputs and
gradients. A group re-formed after a rank died needs new shards: every rank loads its bases again (trainer_actor.py).
"""

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from schemas import Datum, ForwardRequest


def mesh(device: torch.device, world: int) -> DeviceMesh:
    """The ranks of the trainer group (every rank calls this once it joined the group)."""
    return init_device_mesh(device.type, (world,))


def shard_layers(model: torch.nn.Module, over: DeviceMesh) -> None:
    """Shard each decoder layer of a causal LM loaded in host memory; FSDP moves the shards to the mesh's device."""
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=over)


def filler(model_id: str) -> ForwardRequest:
    """A pass of one token through the model's adapter, whose result is dropped: it takes part in every layer's
    gathers as a real pass does (its zero-weighted loss still reaches every layer in the backward)."""
    datum = Datum(model_input=[0], loss_fn_inputs={"target_tokens": [0.0], "weights": [0.0]})
    return ForwardRequest(model_id=model_id, data=[datum], loss_fn="cross_entropy")
