"""How much of the GPU a vLLM engine takes beside the trainer in its process (`TINKERQ_VLLM_GPU_MEMORY_UTILIZATION`).

vLLM takes `gpu_memory_utilization` x the device's memory when it starts (its weights, activations and KV cache;
it refuses to start if that much is not free), and keeps it. The trainer beside it needs room for its own peak: the
activations, gradients and optimizer state of one pass of `TINKERQ_TRAIN_MICRO_BATCH_TOKENS` tokens (gradients
accumulate over passes, so a larger call needs no more). `auto` measures that peak (what torch's allocator reserves
over the trainer's dry forward_backward, optim_step and forward_backward again on a throwaway adapter,
`TorchTrainer.peak_training_bytes`) just before the engine starts, and gives vLLM what is free less that peak and a
margin (where the trainer reads the base from the engine's weights, shared_base.py, its own copy has left the device
by then, so `free` counts it):

    share = (free - trainer peak - margin) / total

An explicit number is passed to vLLM as it is. A Ray engine replica measures the trainer rank on its own GPU the same
way (through a Ray call); where no trainer shares the GPU `auto` is 0.5, as before. On the CPU vLLM takes no share
(its KV cache is `TINKERQ_VLLM_CPU_KV_CACHE_GIB`).
"""

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the device is measured
    import torch

log = logging.getLogger(__name__)
# base model -> the trainer's peak device memory above what it holds now, and the tokens a pass it was measured at
TrainerNeed = Callable[[str], tuple[int, int]]
GIB = 2**30
NO_TRAINER_SHARE = 0.5  # auto where nothing measures a trainer: the fixed share of before
MAX_SHARE = 0.95  # vLLM's own guidance: leave the driver and the CUDA context some room


class NoRoomForEngine(RuntimeError):
    """What is free does not cover the trainer's peak and the margin: the engine would get nothing."""


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine of `base` was given and why (all sizes in bytes)."""

    base: str
    total: int
    # free on the device just before the engine starts (the trainer's base loaded, or parked where it is shared)
    free: int
    trainer_peak: int  # the trainer's measured need above what it holds now; the largest over bases served so far
    budget_tokens: int  # tokens per trainer pass the peak was measured at
    margin: int
    utilization: float  # what vLLM gets, as its gpu_memory_utilization

    @property
    def engine_bytes(self) -> int:
        return int(self.utilization * self.total)

    def describe(self) -> str:
        return (f"vLLM memory share for {self.base}: {self.utilization:.4f} of {self.total / GIB:.1f} GiB = "
                f"{self.engine_bytes / GIB:.2f} GiB (free {self.free / GIB:.2f} GiB - trainer peak "
                f"{self.trainer_peak / GIB:.2f} GiB for {self.budget_tokens} tokens a pass - margin "
                f"{self.margin / GIB:.2f} GiB)")


def plan_share(base: str, total: int, free: int, trainer_peak: int, margin: int, budget_tokens: int) -> MemoryPlan:
    """The share of `total` vLLM may take so that the trainer's peak and the margin stay free. Rounded down to 1e-4
    (vLLM asks for ceil(share x total) and refuses to start if that is more than is free), at most MAX_SHARE.
    NoRoomForEngine where nothing would be left."""
    if total <= 0:
        raise ValueError(f"total memory must be positive, not {total}")
    room = free - trainer_peak - margin
    utilization = min(MAX_SHARE, math.floor(room / total * 1e4) / 1e4)
    if utilization <= 0:
        raise NoRoomForEngine(
            f"vLLM would get no memory for {base}: {free / GIB:.2f} GiB free of {total / GIB:.1f} GiB, the trainer "
            f"needs {trainer_peak / GIB:.2f} GiB for {budget_tokens} tokens a pass and the margin is "
            f"{margin / GIB:.2f} GiB; lower TINKERQ_TRAIN_MICRO_BATCH_TOKENS or TINKERQ_VLLM_MEMORY_MARGIN_GIB, or "
            "set TINKERQ_VLLM_GPU_MEMORY_UTILIZATION")
    return MemoryPlan(base, total, free, trainer_peak, budget_tokens, margin, utilization)


def measured_share(base: str, measure: Callable[[], tuple[int, int]], mem_info: Callable[[], tuple[int, int]],
                   margin: int, reserved: int = 0) -> MemoryPlan:
    """Measure the trainer (`measure`: its peak bytes above what it holds now, and the tokens a pass it ran), then
    read the device (`mem_info`: free and total bytes, after the measure let its memory go) and plan the share.
    `reserved`: the largest trainer peak reserved for engines started before (the trainer runs one model at a time,
    so the room it needs is the largest peak, not their sum). Logs the plan in one line."""
    peak, tokens = measure()
    free, total = mem_info()
    plan = plan_share(base, total, free, max(peak, reserved), margin, tokens)
    log.info("%s", plan.describe())
    return plan


def after_start(plan: MemoryPlan, free: int) -> tuple[int, str]:
    """The log level and line for what the trainer has once the engine of `plan.base` started: `free` bytes
    against its measured peak. vLLM can take more than its share (vLLM 0.26 leaves its CUDA graphs' memory out of
    it); the margin absorbs that, and this says where it did not."""
    line = (f"after vLLM's start for {plan.base}: {free / GIB:.2f} GiB free for the trainer's peak of "
            f"{plan.trainer_peak / GIB:.2f} GiB")
    if free >= plan.trainer_peak:
        return logging.INFO, line
    return logging.WARNING, (
        f"{line}, {(plan.trainer_peak - free) / GIB:.2f} GiB short: vLLM took more than its share, and a pass of "
        f"{plan.budget_tokens} tokens may run out of memory; raise TINKERQ_VLLM_MEMORY_MARGIN_GIB or lower "
        "TINKERQ_TRAIN_MICRO_BATCH_TOKENS")


def cuda_mem_info(device: "torch.device") -> tuple[int, int]:
    """Free and total bytes of the device, after torch hands back the blocks it caches but does not use."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)
