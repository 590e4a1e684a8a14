"""Base models loaded once per worker and shared by the trainer and the sampler.

Each base is one peft model holding every LoRA adapter built on it: the trainer's adapter of each
model id (trainable), and the engine's frozen snapshot adapters, one per live weights version.
A batch can mix rows of different adapters (peft's `adapter_names`), so one forward pass serves
samples of many models and versions at once.
"""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from tinkerq.catalog import BaseModelCatalog, UnknownBaseModel
from worker.runtime.base import DomainError

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch


def adapter_name(model_id: str, version: int | None = None) -> str:
    # peft adapter names become module keys: no '.', and a hash keeps ids of any shape safe.
    stem = "m" + hashlib.blake2b(model_id.encode(), digest_size=8).hexdigest()
    return stem if version is None else f"{stem}_v{version}"


@dataclass
class LoadedBase:
    name: str
    path: Path
    tokenizer: PreTrainedTokenizerBase
    model: torch.nn.Module  # a PeftModel once the first adapter exists
    device: torch.device
    adapters: set[str] = field(default_factory=set)
    # what one decoder layer keeps per token in the trainer, by (adapter, kernels...): packed_forward measures it
    layer_bytes: dict[tuple, int] = field(default_factory=dict)
    # the LoRA layers whose weights the trainer casts once a pass, by (adapter, dtype): lora_compute.copied_layers
    copied_layers: dict[tuple, list] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def add_adapter(self, name: str, config: LoraConfig) -> None:
        if isinstance(self.model, PeftModel):
            self.model.add_adapter(name, config)
        else:
            self.model = get_peft_model(self.model, config, adapter_name=name)
        self.model.eval()  # dropout is off anyway; peft needs eval mode for mixed-adapter batches
        self.model.to(self.device)
        self.adapters.add(name)
        self.copied_layers.clear()  # the modules changed

    def delete_adapter(self, name: str) -> None:
        if name in self.adapters:
            self.model.delete_adapter(name)
            self.adapters.discard(name)
            self.layer_bytes = {k: v for k, v in self.layer_bytes.items() if k[0] != name}
            self.copied_layers.clear()


def resolve_device(name: str) -> torch.device:
    """`auto` is the GPU where there is one; any other name is torch's."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a GPU (what its kernels, vLLM's LoRA ones among them, are built for) and float32
    on the CPU (where bfloat16 matmuls are slow and the tests compare logprobs to 1e-4)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def base_path(catalog: BaseModelCatalog, name: str) -> Path:
    """The served base's directory, or DomainError 404 for a name the deployment does not serve."""
    try:
        return catalog.path(name)
    except UnknownBaseModel as exc:
        raise DomainError(404, "unknown_base_model", str(exc)) from exc


# Run on a base loaded into host memory, before the rest of it moves to the device: shards it (FSDP), say.
Prepare = Callable[[torch.nn.Module], None]


class BaseModels:
    def __init__(self, device: str = "auto", dtype: str = "auto", catalog: BaseModelCatalog | None = None,
                 prepare: Prepare | None = None) -> None:
        self.catalog = catalog or BaseModelCatalog.from_env()
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.prepare = prepare
        self._loaded: dict[str, LoadedBase] = {}

    def loaded(self, name: str) -> LoadedBase | None:
        return self._loaded.get(name)

    def get(self, name: str) -> LoadedBase:
        if name not in self._loaded:
            path = base_path(self.catalog, name)
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
            if self.prepare is not None:
                self.prepare(model)  # a base too big for one device is whole only here, in host memory
            model = model.to(self.device).eval()
            self._loaded[name] = LoadedBase(name, path, tokenizer, model, self.device)
        return self._loaded[name]
