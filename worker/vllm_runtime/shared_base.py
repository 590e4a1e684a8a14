"""One copy of a base's weights on the device, read by the trainer and served by the vLLM engine beside it.

With LoRA sync the base never changes: the trainer's adapters are tensors of their own, and vLLM's live in its slots.
So the trainer's base parameters can be views of the engine's (q/k/v rows of qkv_proj, gate/up rows of gate_up_proj,
the rest by name: the map inplace_merged builds), and its own copy freed: the base's bytes once instead of twice
(a 14B base's bf16 weights are about 30 GB).

Order, in the engine's start-up for a base: the trainer's peak is measured on its own copy; that copy then moves to
host memory (`park`), so that the engine's share is planned over the memory it leaves; vLLM loads the base; the
trainer's parameters become views of the engine's (`lend`), and the host copy is dropped. Where any of that fails
the trainer gets its copy back on the device (`restore`).

Not where vLLM writes its base (merged sync), lets it go (sleep mode moves its weights to host memory while the
trainer runs), or holds it in other processes (tensor parallelism; the Ray runtime's replicas): there each keeps
its own copy (`VllmEngine.share_refusal` says which).
"""

from typing import Any

import torch

from worker.vllm_runtime.inplace import worker_of
from worker.vllm_runtime.inplace_merged import hf_views


class SharedBase:
    """The trainer's base parameters by HF name (peft's wrappers see the same Parameter objects)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.params = base_parameters(model)
        self.device = device

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def park(self) -> None:
        """The trainer's copy leaves the device for host memory (a no-op on the CPU and once parked)."""
        for param in self.params.values():
            param.data = param.data.cpu()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore(self) -> None:
        """The trainer's own copy back on the device (a no-op for parameters already there)."""
        for param in self.params.values():
            param.data = param.data.to(self.device)

    def lend(self, llm: Any) -> None:
        """Point each parameter at the engine's tensor of it. Where the engine holds one in another place, shape or
        dtype, or not at all: ValueError, KeyError or AttributeError (hf_views' own), and nothing changed."""
        worker = worker_of(llm)
        if worker is None:
            raise ValueError("the engine's model is not in this process")
        views = hf_views(worker.model_runner.get_model(), {name: p.data for name, p in self.params.items()})
        missing = self.params.keys() - views.keys()
        if missing:
            raise ValueError(f"the engine holds no tensor for {sorted(missing)[:3]}")
        for name, view in views.items():
            param = self.params[name]
            if (view.dtype, view.device.type) != (param.dtype, self.device.type):
                raise ValueError(f"{name}: the engine's is {view.dtype} on {view.device}, the trainer's "
                                 f"{param.dtype} on {self.device}")
        for name, view in views.items():
            self.params[name].data = view


def base_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """HF name -> Parameter of the base weights inside a (peft-wrapped) HF model: the LoRA adapters left out."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {name.replace(".base_layer.", "."): param for name, param in inner.named_parameters()
            if ".lora_" not in name and "modules_to_save" not in name}

