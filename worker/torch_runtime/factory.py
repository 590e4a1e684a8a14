"""Assemble the torch runtime from settings: the torch trainer beside a vLLM or a PyTorch engine."""

import importlib.util
from pathlib import Path

from tinkerq.catalog import BaseModelCatalog
from tinkerq.config import RuntimeConfig
from worker.runtime.base import Engine
from worker.runtime.runtime import Runtime
from worker.torch_runtime.base_models import BaseModels
from worker.torch_runtime.engine import TorchEngine
from worker.torch_runtime.trainer import TorchTrainer


def engine_name(config: RuntimeConfig) -> str:
    if config.engine != "auto":
        return config.engine
    return "vllm" if importlib.util.find_spec("vllm") is not None else "torch"


def make_engine(config: RuntimeConfig, bases: BaseModels) -> Engine:
    if engine_name(config) == "vllm":
        from worker.vllm_runtime.engine import VllmEngine

        return VllmEngine(config, bases.catalog)
    return TorchEngine(bases, config.max_snapshots)


def make_runtime(config: RuntimeConfig) -> Runtime:
    bases = BaseModels(config.device, config.dtype, BaseModelCatalog.from_env())
    return Runtime(TorchTrainer(bases, Path(config.checkpoint_root)), make_engine(config, bases))
