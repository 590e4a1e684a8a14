"""Activation checkpointing of as many decoder layers as a memory budget asks for, through transformers' own hook.

A checkpointed layer keeps only its input and runs its forward again in the backward pass: half as much compute
again for that layer (the backward computes no weight gradients of the frozen base), most of its activation
memory saved. `layers_to_checkpoint` keeps as many layers whole as the
budget holds (an estimate of what one layer saves per token), so small batches pay no recompute at all.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer


def layer_bytes_per_token(config, dtype: torch.dtype) -> int:
    """What one decoder layer keeps for the backward, per token (measured shapes of a Qwen2/Llama-style layer:
    the MLP's four intermediate-size tensors, q/k/v/attention output, layer inputs, two float32 norm inputs)."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    size = torch.empty((), dtype=dtype).element_size()
    return size * (4 * config.intermediate_size + 2 * q + 2 * kv + 3 * hidden) + 2 * 4 * hidden


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
