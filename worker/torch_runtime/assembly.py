"""Assemble the torch runtime from settings (`worker/runtime/registry.py` picks it): the torch trainer beside a vLLM or
a PyTorch engine; the Ray runtime's actors build their parts here too."""

import dataclasses
import importlib.util
from pathlib import Path

from tinkerq.catalog import BaseModelCatalog
from tinkerq.config import RuntimeConfig
from worker.runtime.base import Engine
from worker.runtime.versioned import Runtime
from worker.torch_runtime.base_models import BaseModels
from worker.torch_runtime.engine import TorchEngine
from worker.torch_runtime.packed_forward import TrainOptions
from worker.torch_runtime.trainer import TorchTrainer
from worker.vllm_runtime.memory_share import TrainerNeed


def engine_name(config: RuntimeConfig) -> str:
    if config.engine != "auto":
        return config.engine
    return "vllm" if importlib.util.find_spec("vllm") is not None else "torch"


def make_engine(config: RuntimeConfig, bases: BaseModels, need: TrainerNeed | None = None,
                trainer: TorchTrainer | None = None) -> Engine:
    """`need`: the trainer's measured need for a base (bytes above what it holds, tokens a pass), from the trainer
    that shares the engine's GPU; it sizes vLLM's share of it (TINKERQ_VLLM_GPU_MEMORY_UTILIZATION=auto).
    `trainer`: the trainer in this process: vLLM serves both from one copy of a base (shared_base.py)."""
    if engine_name(config) == "vllm":
        from worker.vllm_runtime.engine import VllmEngine

        trainer_model = None if trainer is None else (lambda base: trainer.bases.get(base).model)
        return VllmEngine(config, bases.catalog, need, trainer_model)
    # Its own copy of each base, not the trainer's: the engine samples while the trainer trains (the lanes), and
    # peft keeps a model's active adapter and its set of adapters on the module itself.
    return TorchEngine(BaseModels(config.device, config.dtype, bases.catalog), config.max_snapshots)


def trainer_need(trainer: TorchTrainer, config: RuntimeConfig) -> TrainerNeed:
    """What the trainer needs for a base: measured with the widest adapter the engine serves, on every target (the
    most a model may ask of it)."""
    return lambda base_model: trainer.peak_training_bytes(base_model, config.vllm_max_lora_rank)


def set_threads(config: RuntimeConfig) -> None:
    """torch's intra-op threads for this process, where the settings name a count.

    Through torch._C: a vLLM CPU engine started earlier in this process replaces `torch.set_num_threads` with a
    no-op (vllm/v1/worker/cpu_worker.py, after it binds its threads), which would leave MKL on every core, so
    that the float32 sums of this runtime differed from a process that honoured the count."""
    if config.torch_threads:
        import torch

        torch._C.set_num_threads(config.torch_threads)


def make_trainer(config: RuntimeConfig, bases: BaseModels) -> TorchTrainer:
    """The torch trainer (in process, or one data-parallel rank of the Ray runtime)."""
    options = TrainOptions.for_device(bases.device)
    if config.train_micro_batch_tokens:
        options = dataclasses.replace(options, micro_batch_tokens=config.train_micro_batch_tokens)
    if config.train_activation_gib:
        options = dataclasses.replace(options, activation_budget_bytes=config.train_activation_gib * 2**30)
    return TorchTrainer(bases, Path(config.checkpoint_root), options)


def make_runtime(config: RuntimeConfig) -> Runtime:
    set_threads(config)
    bases = BaseModels(config.device, config.dtype, BaseModelCatalog.from_env())
    trainer = make_trainer(config, bases)
    return Runtime(trainer, make_engine(config, bases, trainer_need(trainer, config), trainer))
