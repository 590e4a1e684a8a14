"""The fixes of patches.py in the worker processes of an engine that runs its model apart from the worker's own
process (tensor parallelism: vLLM's multiprocessing executor). vLLM imports a `worker_extension_cls` in each of
them before they build the model; naming this module's class there applies the same patches the engine's own
process applied (without them such a worker refuses an lm_head adapter, and its CPU LoRA kernels give a base row
the last slot's adapter)."""

from vllm.platforms import current_platform

from worker.vllm_runtime import patches

patches.apply(on_cpu=current_platform.is_cpu())


class PatchedWorker:
    """Adds nothing to vLLM's worker: naming it (`worker_extension_cls`) is what loads this module there."""
