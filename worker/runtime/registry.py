"""Every runtime a worker can serve, by name, in one place: the one module that composes a runtime from settings.

Each runtime package assembles its own parts (`worker/torch_runtime/assembly.py`: the torch trainer beside a vLLM
or PyTorch engine; `worker/ray_runtime/assembly.py`: engine replicas and trainer ranks placed on Ray); this module
picks one and imports only that one, so a worker without torch or Ray never loads them. A user's own runtime is
named `module:factory` (a callable taking the RuntimeConfig).
"""

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from tinkerq.config import RuntimeConfig
from worker.runtime import cuda_allocator
from worker.runtime.versioned import Runtime

RUNTIMES = ("auto", "torch", "reference", "ray")
TORCH_PACKAGES = ("torch", "transformers", "peft")


def runtime_name(config: RuntimeConfig) -> str:
    """`auto` is the torch runtime (on Ray where devices or a cluster were asked for); without its packages that is
    an error, not a silent stand-in model."""
    on_ray = config.ray_gpus > 0 or bool(config.ray_address)
    if config.runtime in ("torch", "reference") and on_ray:
        # not silently in process: a worker asked for N GPUs would serve on one
        raise ValueError(f"runtime {config.runtime!r} runs in process; ray_gpus={config.ray_gpus} and "
                         f"ray_address={config.ray_address!r} ask for the Ray runtime (--runtime ray or auto)")
    if config.runtime != "auto":
        return config.runtime
    if on_ray:
        return "ray"
    missing = [name for name in TORCH_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(f"the torch runtime needs {', '.join(missing)} (pip install 'tinkerq[torch]'); "
                           "for the test stand-in model, ask for it: --runtime reference")
    return "torch"


def build_runtime(config: RuntimeConfig | None = None) -> Runtime:
    config = config or RuntimeConfig()
    cuda_allocator.configure()  # before any runtime touches CUDA
    return _builder(runtime_name(config))(config)


def _builder(name: str) -> Callable[[RuntimeConfig], Runtime]:
    if name == "reference":
        return _reference
    if name == "torch":
        from worker.torch_runtime.assembly import make_runtime

        return make_runtime
    if name == "ray":
        from worker.ray_runtime.assembly import make_runtime

        return make_runtime
    if ":" in name:
        module, _, factory = name.partition(":")
        return getattr(importlib.import_module(module), factory)
    raise ValueError(f"unknown runtime {name!r}: use one of {RUNTIMES} or 'module:factory'")


def _reference(config: RuntimeConfig) -> Runtime:
    from worker.runtime.reference import ReferenceEngine, ReferenceTrainer

    engine = ReferenceEngine(config.max_snapshots, config.reference_delay_per_token_s)
    return Runtime(ReferenceTrainer(Path(config.checkpoint_root)), engine)
