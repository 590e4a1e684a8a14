"""torch.compile over each decoder layer inside the trainer's forward (opt-in: `TrainOptions.compile_layers`).

What the fused kernels leave (the LoRA matmuls' casts and epilogues, residual adds, dtype casts between HF's ops)
is elementwise work and kernel launches, which bind a small model on a GPU. Inductor fuses them per layer. Every
layer is one compiled function: dynamo reuses the code across the layers of one class and marks the token count
dynamic, so ragged micro-batches do not recompile. The compiled forward is swapped in for the duration of one
trainer call only (the sampler keeps HF's code), and wraps the layer's own forward, so activation checkpointing
(transformers' hook, around it) recomputes through it.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_COMPILED = "_tinkerq_compiled_forward"


def _compiled(layer: torch.nn.Module):
    fn = layer.__dict__.get(_COMPILED)
    if fn is None:
        fn = torch.compile(type(layer).forward.__get__(layer), dynamic=True)
        layer.__dict__[_COMPILED] = fn
    return fn


@contextmanager
def compiled_layers(layers: list[torch.nn.Module], enabled: bool) -> Iterator[None]:
    """The layers' forward compiled for the duration (a no-op unless `enabled`)."""
    if not enabled:
        yield
        return
    for layer in layers:
        layer.forward = _compiled(layer)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
