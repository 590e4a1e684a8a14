"""Build the runtime a worker serves from its name (or a user's `module:factory`)."""

import importlib
from pathlib import Path

from tinkerq.config import RuntimeConfig
from worker.runtime.runtime import Runtime

RUNTIMES = ("reference", "torch")


def build_runtime(config: RuntimeConfig | None = None) -> Runtime:
    config = config or RuntimeConfig()
    root = Path(config.checkpoint_root)
    if config.runtime == "reference":
        from worker.runtime.reference import ReferenceEngine, ReferenceTrainer

        engine = ReferenceEngine(config.max_snapshots, config.reference_delay_per_token_s)
        return Runtime(ReferenceTrainer(root), engine)
    if config.runtime == "torch":
        from worker.torch_runtime.factory import make_runtime

        return make_runtime(config)
    if ":" in config.runtime:
        module, _, factory = config.runtime.partition(":")
        return getattr(importlib.import_module(module), factory)(config)
    raise ValueError(f"unknown runtime {config.runtime!r}: use one of {RUNTIMES} or 'module:factory'")
