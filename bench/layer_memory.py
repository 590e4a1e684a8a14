"""What one decoder layer keeps for the backward, per token, in the trainer's forward: counted on any device.

    python bench/layer_memory.py [--model randq-0.5b] [--tokens 512] [--device cpu] [--dtype bfloat16]

Random weights in the model's shape (tinkerq.local_models), a LoRA rank-32 adapter on attention, MLP and
unembedding, one packed pass of --tokens tokens through the decoder with autograd recording, as
`packed_forward` runs it (packed attention, lean LoRA, the gated MLP; Liger's kernels where --fused and CUDA).
Every tensor of the tokens' length that autograd keeps is counted once by its storage (a saved-tensors hook; the
remade product's recipe keeps no tensor of its own, and the few small tensors down_proj keeps beside it are then
not seen), with the SwiGLU product remade or kept, beside the shape-based estimate
(`layer_bytes_per_token`) the trainer used before it measured. On CUDA the trainer's own measurement
(`measured_bytes_per_token`, the allocator's) is printed too. Prints a table, writes <out>/layer_memory-<model>.json.
"""

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.gpu_trainer import config_of  # noqa: E402
from schemas import LoraConfig  # noqa: E402
from worker.torch_runtime.activation_checkpointing import layer_bytes_per_token, measured_bytes_per_token  # noqa: E402
from worker.torch_runtime.fused_kernels import fused_kernels  # noqa: E402
from worker.torch_runtime.gated_mlp import gated_mlp, products_remade  # noqa: E402
from worker.torch_runtime.lora_compute import lean_lora  # noqa: E402
from worker.torch_runtime.packed_attention import packed  # noqa: E402
from worker.torch_runtime.packed_forward import _decode  # noqa: E402
from worker.torch_runtime.trainer import peft_config  # noqa: E402


def build(name: str, device: torch.device, dtype: torch.dtype):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = AutoModelForCausalLM.from_config(config_of(name))
    finally:
        torch.set_default_dtype(previous)
    model = get_peft_model(model, peft_config(LoraConfig(rank=32)), adapter_name="bench").eval()
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model


def kept_bytes(forward, tokens: int, model: torch.nn.Module) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of `forward()` that grow with the tokens (a
    dimension of `tokens`): activations, not the weights (nor their per-pass casts) that it keeps too."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if tokens in t.shape and storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = forward()
    del output
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="randq-0.5b")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--fused", action="store_true", help="Liger's kernels (CUDA with liger-kernel only)")
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build(args.model, device, dtype)
    causal = model.get_base_model()
    decoder = causal.get_decoder()
    layers = list(decoder.layers)
    tokens = torch.randint(0, causal.config.vocab_size, (args.tokens,), device=device)
    rows = {"estimate (shapes)": layer_bytes_per_token(causal.config, dtype)}
    with (torch.enable_grad(), packed(causal.config), lean_lora(), fused_kernels(causal, args.fused),
          gated_mlp(causal, args.fused)):
        def forward() -> torch.Tensor:
            return _decode(decoder, tokens)

        for remake in (False, True):
            label = "remade" if remake else "kept"
            with products_remade(layers, remake):
                rows[f"counted, SwiGLU product {label}"] = kept_bytes(forward, args.tokens, model) // (
                    args.tokens * len(layers))
                if device.type == "cuda":
                    rows[f"allocator, SwiGLU product {label}"] = measured_bytes_per_token(
                        forward, device, args.tokens, len(layers))
    c = causal.config
    print(f"{args.model} ({c.num_hidden_layers} layers, hidden {c.hidden_size}, MLP {c.intermediate_size}), "
          f"{args.dtype} on {args.device}, {args.tokens} tokens, fused kernels {args.fused}\n")
    print("| what a layer keeps | bytes per token |\n| --- | --- |")
    for k, v in rows.items():
        print(f"| {k} | {v:,} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"layer_memory-{args.model}-{args.device.split(':')[0]}.json").write_text(json.dumps(
        {"model": args.model, "tokens": args.tokens, "device": args.device, "dtype": args.dtype,
         "fused": args.fused, "bytes_per_token_per_layer": rows}, indent=2))


if __name__ == "__main__":
    main()
