"""torch's CUDA allocator for a worker: expandable segments unless the operator chose otherwise.

vLLM's share of a GPU is sized from what the trainer beside it reserves over a dry pass (vllm_runtime/memory_share.py).
With torch's default allocator, blocks that one pass splits and the next cannot reuse stay reserved, so a large
shape's pass reserves far more than it allocates at its peak, and vLLM's share shrinks by the difference. Expandable
segments map pages into one growing segment instead, so what is reserved follows what is allocated: the engine beside
the trainer gets a larger KV cache, and samples faster (bench/RESULTS.md). vLLM turns them off around its sleep-mode
pool by itself (its device_allocator/cumem.py).

The setting is an environment variable, so that the processes a worker starts (vLLM's tensor-parallel workers, Ray's
actors: ray_runtime/cluster.py forwards it) allocate the same way; where torch is imported already, this
process's allocator is set as well.
"""

import logging
import os
import sys
from collections.abc import Mapping

log = logging.getLogger(__name__)
# torch's own precedence, the device-agnostic name first (as vLLM's device_allocator/alloc_conf.py reads them)
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
DEFAULT = "expandable_segments:True"


def chosen(environ: Mapping[str, str]) -> tuple[str, str, bool]:
    """The variable and value the worker's processes allocate by, and whether the operator chose it."""
    for name in ALLOC_CONF_VARS:
        if environ.get(name):
            return name, environ[name], True
    return "PYTORCH_CUDA_ALLOC_CONF", DEFAULT, False


def configure() -> tuple[str, str]:
    """Set the default where no allocator setting was given; returns the variable in effect and its value."""
    name, value, operators = chosen(os.environ)
    if operators:
        log.info("torch CUDA allocator: %s=%s (the operator's)", name, value)
        return name, value
    os.environ[name] = value
    torch = sys.modules.get("torch")
    if torch is not None:
        # torch may have read the environment already (when it reads it differs between releases): this process's
        # allocator takes the setting too, for every segment it maps from here on (written as vLLM's alloc_conf.py does)
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        (setter or torch.cuda.memory._set_allocator_settings)(value)
    log.info("torch CUDA allocator: %s=%s (the worker's default; the trainer's reserved memory then follows what it "
             "allocates, and vLLM's share grows by the difference)", name, value)
    return name, value
