"""The trainer's own CUDA stream: where its kernels run, beside the engine's.

The sampling lane drives the engine on the device's default stream while the training lane runs the trainer, and
kernels queued on one stream run in order: on the default stream the trainer's forward_backward and the engine's
decode steps would take turns on the GPU. On a stream of its own (a non-blocking one, which does not wait for the
default stream) the trainer's kernels run beside the engine's. Each op waits for what the default stream had queued
before it (its inputs, the adapter a sync or a create wrote) and is finished before it returns, so what it wrote
(gradients, the adapter's weights) is whole for whoever reads it next, on any stream."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_streams: dict[int, torch.cuda.Stream] = {}


@contextmanager
def training_stream(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(index)
    stream.wait_stream(torch.cuda.current_stream(index))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()
