"""Build the runtime a worker serves from its name (or a user's `module:factory`)."""

import importlib
import importlib.util
from pathlib import Path

from tinkerq.config import RuntimeConfig
from worker.runtime.runtime import Runtime

RUNTIMES = ("auto", "torch", "reference", "ray")
TORCH_PACKAGES = ("torch", "transformers", "peft")


def runtime_name(config: RuntimeConfig) -> str:
    """`auto` is the torch runtime; without its packages that is an error, not a silent stand-in model."""
    if config.runtime != "auto":
        return config.runtime
    if config.ray_gpus > 0 or config.ray_address:
        return "ray"
    missing = [name for name in TORCH_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(f"the torch runtime needs {', '.join(missing)} (pip install 'tinkerq[torch]'); "
                           "for the test stand-in model, ask for it: --runtime reference")
    return "torch"


def build_runtime(config: RuntimeConfig | None = None) -> Runtime:
    config = config or RuntimeConfig()
    root = Path(config.checkpoint_root)
    name = runtime_name(config)
    if name == "reference":
        from worker.runtime.reference import ReferenceEngine, ReferenceTrainer

        engine = ReferenceEngine(config.max_snapshots, config.reference_delay_per_token_s)
        return Runtime(ReferenceTrainer(root), engine)
    if name == "torch":
        from worker.torch_runtime.factory import make_runtime

        return make_runtime(config)
    if name == "ray":
        from worker.ray_runtime.factory import make_runtime as make_ray_runtime

        return make_ray_runtime(config)
    if ":" in name:
        module, _, factory = name.partition(":")
        return getattr(importlib.import_module(module), factory)(config)
    raise ValueError(f"unknown runtime {name!r}: use one of {RUNTIMES} or 'module:factory'")
