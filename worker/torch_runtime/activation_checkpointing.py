"""Activation checkpointing of as many decoder layers as a memory budget asks for, through transformers' own hook.

A checkpointed layer keeps only its input and runs its forward again in the backward pass: half as much compute
again for that layer (the backward computes no weight gradients of the frozen base), most of its activation
memory saved. `layers_to_checkpoint` keeps as many layers whole as the budget holds (what one layer keeps per
token: measured on CUDA by the trainer, an estimate elsewhere), so small batches pay no recompute at all.
`recomputed_when_saved` is the same trade for one cheap tensor of a whole layer: autograd keeps how to make it
instead of the tensor.
"""

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig
from transformers.modeling_layers import GradientCheckpointingLayer


def layer_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """What one decoder layer keeps for the backward, per token (measured shapes of a Qwen2/Llama-style layer:
    the MLP's four intermediate-size tensors, q/k/v/attention output, layer inputs, two float32 norm inputs)."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    size = torch.empty((), dtype=dtype).element_size()
    return size * (4 * config.intermediate_size + 2 * q + 2 * kv + 3 * hidden) + 2 * 4 * hidden


def measured_bytes_per_token(forward: Callable[[], torch.Tensor], device: torch.device, tokens: int,
                             layers: int) -> int:
    """What one layer keeps per token, read off the allocator: the device memory that `forward` (a pass through
    every layer with autograd recording, over `tokens` tokens) leaves allocated while its output is alive, over
    tokens x layers. Exact for whatever kernels and adapters are in force; CUDA only."""
    before = torch.cuda.memory_allocated(device)
    output = forward()
    kept = torch.cuda.memory_allocated(device) - before
    del output
    return max(1, math.ceil(kept / (tokens * max(1, layers))))


def layers_to_checkpoint(layers: int, tokens: int, per_token: int, budget_bytes: float) -> int:
    if math.isinf(budget_bytes):
        return 0
    whole = int(budget_bytes // max(1, tokens * per_token))
    return max(0, layers - whole)


@contextmanager
def checkpointed(layers: list[torch.nn.Module], count: int) -> Iterator[None]:
    """Checkpoint the first `count` layers for the duration (forward and backward: the recompute runs in it).
    transformers' layers checkpoint only in training mode; only those layers' own flag is set (their children,
    dropout-free, stay in eval mode, as peft's mixed-adapter batches of the sampler want)."""
    chosen = [layer for layer in layers[:count] if isinstance(layer, GradientCheckpointingLayer)]
    # no dropout anywhere in the trainer's forward, so there is no RNG state to replay
    func = partial(checkpoint, use_reentrant=False, preserve_rng_state=False)
    saved = [(layer.gradient_checkpointing, layer.training) for layer in chosen]
    try:
        for layer in chosen:
            layer.gradient_checkpointing, layer.training = True, True
            layer._gradient_checkpointing_func = func
        yield
    finally:
        for layer, (flag, training) in zip(chosen, saved):
            layer.gradient_checkpointing, layer.training = flag, training


class _Recipe:
    """How to remake one saved tensor, and the tensor once remade (both savers of it in one backward share it)."""

    __slots__ = ("make", "value")

    def __init__(self, make: Callable[[], torch.Tensor]) -> None:
        self.make, self.value = make, None

    def get(self) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.make()
        return self.value


# What autograd keeps in place of a remade tensor: its recipe, and its size, stride and offset in the remade storage.
_Saved = tuple[_Recipe, torch.Size, tuple[int, ...], int]


@contextmanager
def recomputed_when_saved(target: torch.Tensor, make: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Inside, wherever autograd saves `target` (or a view of it: a linear layer saves its input folded to 2-d)
    for the backward, it keeps `make` instead, and the backward calls it under no_grad when it first needs the
    tensor. `make` must return `target`'s values, laid out as `target` is; every other saved tensor is kept as
    it is. Not for a checkpointed layer (its own hooks keep nothing but its input)."""
    # autograd keeps the hooks with what they packed: they must not hold `target` itself
    recipe, storage, device, origin = (_Recipe(make), target.untyped_storage().data_ptr(), target.device,
                                       target.storage_offset())

    def pack(t: torch.Tensor) -> torch.Tensor | _Saved:
        if t.untyped_storage().data_ptr() != storage or t.device != device:
            return t
        return recipe, t.size(), t.stride(), t.storage_offset() - origin

    def unpack(saved: torch.Tensor | _Saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        recipe, size, stride, offset = saved
        remade = recipe.get()
        return remade.as_strided(size, stride, remade.storage_offset() + offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
