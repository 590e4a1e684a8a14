"""Build the runtime a worker serves from its name (or a user's `module:factory`)."""

import importlib
from pathlib import Path

from tinkerq.config import RuntimeConfig
from worker.runtime.runtime import Runtime


def build_runtime(config: RuntimeConfig | None = None) -> Runtime:
    config = config or RuntimeConfig()
    root = Path(config.checkpoint_root)
    if config.runtime == "reference":
        from worker.runtime.reference import ReferenceEngine, ReferenceTrainer

        engine = ReferenceEngine(config.max_snapshots, config.reference_delay_per_token_s)
        return Runtime(ReferenceTrainer(root), engine)
    if ":" in config.runtime:
        module, _, factory = config.runtime.partition(":")
        return getattr(importlib.import_module(module), factory)(config)
    raise ValueError(f"unknown runtime {config.runtime!r}: use 'reference' or 'module:factory'")
