"""Assemble the torch runtime from settings."""

from pathlib import Path

from tinkerq.config import RuntimeConfig
from worker.runtime.runtime import Runtime
from worker.torch_runtime.bases import BaseModels
from worker.torch_runtime.engine import TorchEngine
from worker.torch_runtime.trainer import TorchTrainer


def make_runtime(config: RuntimeConfig) -> Runtime:
    bases = BaseModels(config.device, config.dtype)
    return Runtime(TorchTrainer(bases, Path(config.checkpoint_root)), TorchEngine(bases, config.max_snapshots))
