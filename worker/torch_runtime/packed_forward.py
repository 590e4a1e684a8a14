"""forward / forward_backward of one request on one adapter, lean on memory and free of per-token Python.

The datums are packed without padding into micro-batches up to a token budget (`packing`); each micro-batch
goes through the decoder (attention per sequence: `packed_attention`; LoRA updates fused, in the base's
dtype: `lora_compute`; as many layers checkpointed as the activation budget asks: `activation_checkpointing`;
in the layers kept whole, the MLP's SwiGLU product remade in the backward instead of kept: `gated_mlp`),
then through the unembedding in chunks to per-token target logprobs (`unembedding`), then through the loss
(`losses.elementwise_loss`: once over the micro-batch's tokens where it is per token and its datums share their
inputs, else datum by datum), and backward. Gradients accumulate over
micro-batches, and are committed only when the whole call succeeds, so a request that fails halfway leaves the
adapter's gradients as they were.
"""

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from schemas import ForwardRequest
from worker.runtime.base import DomainError
from worker.torch_runtime import losses
from worker.torch_runtime.activation_checkpointing import (
    checkpointed,
    layer_bytes_per_token,
    layers_to_checkpoint,
    measured_bytes_per_token,
)
from worker.torch_runtime.base_models import LoadedBase
from worker.torch_runtime.fused_kernels import available as fused_kernels_available, fused_kernels
from worker.torch_runtime.gated_mlp import gated_mlp, products_remade
from worker.torch_runtime.lora_compute import ComputeCopies, copied_layers, lean_lora
from worker.torch_runtime.packed_attention import packed
from worker.torch_runtime.packing import Flat, MicroBatch, flatten, micro_batches
from worker.torch_runtime.unembedding import Head, chunk_tokens, head_of, target_logprobs

PROBE_TOKENS = 1024  # tokens of the pass that measures what a layer keeps (CUDA)

# The loss of datum i from its target logprobs and inputs: per token (a built-in loss), or 0-dim (a custom one).
DatumLoss = Callable[[int, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class BuiltinLoss:
    """The request's built-in loss function, per token; a missing input or config value is a DomainError 400.
    A DatumLoss; where each token's loss depends on that token alone (`losses.PER_TOKEN`), also callable once over
    the tokens of many datums."""

    name: str
    config: dict[str, float]

    @property
    def per_token(self) -> bool:
        return self.name in losses.PER_TOKEN

    def __call__(self, index: int, p: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        try:
            return losses.elementwise_loss(self.name, p, inputs, self.config)
        except KeyError as exc:
            raise DomainError(400, "invalid_request", f"{self.name}: {exc.args[0]}") from exc


def builtin_loss(request: ForwardRequest) -> BuiltinLoss:
    return BuiltinLoss(request.loss_fn, request.loss_fn_config)


@dataclass(frozen=True)
class TrainOptions:
    micro_batch_tokens: int = 16384  # tokens per pass through the model; gradients accumulate over passes
    logits_chunk_elements: int = 1 << 27  # logits values alive at once in the unembedding (x 8 bytes at peak)
    activation_budget_bytes: float = math.inf  # activations kept whole per micro-batch; the rest is recomputed
    fused_kernels: bool = False  # Liger's RMSNorm / SwiGLU / rotary kernels (fused_kernels.py; CUDA only)
    remake_swiglu: bool = True  # whole layers remake the MLP's SwiGLU product in the backward (gated_mlp.py)
    softmax_kernels: bool = True  # the unembedding's softmax passes in Triton where usable (softmax_kernels.py)
    lora_copies: bool = True  # the adapter's A and B cast to the compute dtype once a pass (lora_compute.py)
    lora_function: bool = True  # a LoRA layer is one autograd function, its backward written out (lora_compute.py)

    @classmethod
    def for_device(cls, device: torch.device) -> "TrainOptions":
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            return cls(activation_budget_bytes=activation_budget(total), fused_kernels=fused_kernels_available(device))
        return cls()


# What a pass keeps whole on a GPU by default: a share of the card, capped. A layer kept whole is not recomputed in
# the backward, so a larger card runs a long pass faster; the cap bounds what one pass holds beside the engine. The
# engine's `auto` memory share measures the trainer's peak with it, so vLLM gets the rest either way.
ACTIVATION_SHARE = 0.15
ACTIVATION_CAP_BYTES = 20 * 2**30


def activation_budget(device_bytes: int) -> float:
    """The default activation budget on a GPU of `device_bytes`."""
    return min(ACTIVATION_CAP_BYTES, ACTIVATION_SHARE * device_bytes)


@dataclass
class _Pass:
    """What one micro-batch leaves behind for the outputs (detached, still on the device)."""

    logprobs: torch.Tensor
    elementwise: list[torch.Tensor]
    total: torch.Tensor


def forward_request(base: LoadedBase, adapter: str, request: ForwardRequest, backward: bool, options: TrainOptions,
                    params: list[torch.nn.Parameter],
                    loss: DatumLoss | None = None) -> tuple[list[dict[str, np.ndarray]], float]:
    """Per-datum {"logprobs", "elementwise_loss"} (the latter for per-token losses) and the loss summed over every
    datum; `loss` is the request's built-in loss unless given."""
    loss = loss or builtin_loss(request)
    causal = base.model.get_base_model()
    decoder = causal.get_decoder()
    head = head_of(causal.get_output_embeddings(), adapter)
    flat = flatten(request.data, base.vocab_size, base.device)
    tokens, targets = flat.tokens.to(base.device), flat.targets.to(base.device)
    passes = []
    layers = list(getattr(decoder, "layers", []))
    dtype = decoder.get_input_embeddings().weight.dtype
    with (torch.set_grad_enabled(backward), packed(causal.config), lean_lora(options.lora_function),
          fused_kernels(causal, options.fused_kernels), gated_mlp(causal, options.fused_kernels),
          _committed_on_success(params, backward)):
        for batch in micro_batches(flat, options.micro_batch_tokens, base.device):
            count = _checkpoint_count(base, adapter, tokens, batch, options) if backward else 0
            copies = ComputeCopies(_copied_layers(base, adapter, dtype) if options.lora_copies else [], adapter,
                                   dtype)
            with checkpointed(layers, count), products_remade(layers[count:], options.remake_swiglu), copies:
                passes.append(_run(decoder, head, tokens, targets, flat, batch, loss, backward, options))
                copies.flush()
    return _outputs(flat, passes)


def _run(decoder: torch.nn.Module, head: Head, tokens: torch.Tensor, targets: torch.Tensor, flat: Flat,
         batch: MicroBatch, loss: DatumLoss, backward: bool, options: TrainOptions) -> _Pass:
    span = slice(batch.start, batch.end)
    hidden = decoder(input_ids=tokens[None, span], position_ids=batch.positions[None], use_cache=False,
                     cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens, max_length_q=batch.max_len,
                     max_length_k=batch.max_len).last_hidden_state[0]
    chunk = chunk_tokens(head.weight.shape[0], options.logits_chunk_elements)
    logprobs = target_logprobs(hidden, head, targets[span], chunk, options.softmax_kernels)
    elementwise, total = _losses(loss, flat, batch, logprobs)
    if backward:
        total.backward()
    return _Pass(logprobs.detach(), [e.detach() for e in elementwise], total.detach())


def _losses(loss: DatumLoss, flat: Flat, batch: MicroBatch, logprobs: torch.Tensor) -> tuple[list, torch.Tensor]:
    """Each datum's loss (per token, or 0-dim) and their sum. A per-token built-in loss over datums that all have
    the same inputs is one call over the micro-batch's tokens (no per-datum ops in the forward or the backward,
    the same numbers); anything else is called datum by datum."""
    inputs = _shared_inputs(flat, batch) if isinstance(loss, BuiltinLoss) and loss.per_token else None
    if inputs is not None:
        whole = loss(batch.first, logprobs, inputs)
        return list(whole.split(flat.lengths[batch.first: batch.stop])), whole.sum()
    elementwise = []
    for i in range(batch.first, batch.stop):
        start = flat.starts[i] - batch.start
        elementwise.append(loss(i, logprobs[start: start + flat.lengths[i]], flat.inputs_of(i)))
    return elementwise, torch.cat([e.reshape(-1) for e in elementwise]).sum()


def _shared_inputs(flat: Flat, batch: MicroBatch) -> dict[str, torch.Tensor] | None:
    """Every input over the micro-batch's tokens, where each of its datums has each input; else None."""
    out = {}
    for key, values in flat.inputs.items():
        if any(i not in values.starts for i in range(batch.first, batch.stop)):
            return None
        start = values.starts[batch.first]
        out[key] = values.values[start: start + batch.tokens]
    return out


def _checkpoint_count(base: LoadedBase, adapter: str, tokens: torch.Tensor, batch: MicroBatch,
                      options: TrainOptions) -> int:
    if math.isinf(options.activation_budget_bytes):
        return 0
    decoder = base.model.get_base_model().get_decoder()
    layers = list(getattr(decoder, "layers", []))
    if base.device.type == "cuda":
        per_token = _measured_layer_bytes(base, adapter, decoder, layers, tokens[batch.start: batch.end], options)
    else:
        per_token = layer_bytes_per_token(decoder.config, decoder.get_input_embeddings().weight.dtype)
    return layers_to_checkpoint(len(layers), batch.tokens, per_token, options.activation_budget_bytes)


def _copied_layers(base: LoadedBase, adapter: str, dtype: torch.dtype) -> list:
    """`lora_compute.copied_layers`, walked once per adapter and dtype (the walk visits every module of the model
    in Python, before the call's first kernel can start)."""
    key = (adapter, dtype)
    if key not in base.copied_layers:
        causal = base.model.get_base_model()
        base.copied_layers[key] = copied_layers(causal, adapter, dtype, causal.get_output_embeddings())
    return base.copied_layers[key]


def layer_bytes_key(adapter: str, options: TrainOptions) -> tuple[str, bool, bool, bool]:
    """What a layer's measured bytes depend on: the adapter (its targets), the kernels, the remade product, the
    LoRA function (what it saves)."""
    return adapter, options.fused_kernels, options.remake_swiglu, options.lora_function


def _measured_layer_bytes(base: LoadedBase, adapter: str, decoder: torch.nn.Module, layers: list, tokens: torch.Tensor,
                          options: TrainOptions) -> int:
    """What one whole layer keeps per token with this adapter and these kernels, measured on a pass over the first
    PROBE_TOKENS tokens at the adapter's first call (a few ms, once) instead of estimated from the shapes."""
    key = layer_bytes_key(adapter, options)
    if key not in base.layer_bytes:
        probe = tokens[:PROBE_TOKENS]
        with products_remade(layers, options.remake_swiglu):
            base.layer_bytes[key] = measured_bytes_per_token(lambda: _decode(decoder, probe), base.device,
                                                             probe.shape[0], len(layers))
    return base.layer_bytes[key]


def _decode(decoder: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states over `tokens` as one sequence."""
    n = tokens.shape[0]
    cu = torch.tensor([0, n], dtype=torch.int32, device=tokens.device)
    return decoder(input_ids=tokens[None], position_ids=torch.arange(n, device=tokens.device)[None], use_cache=False,
                   cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=n, max_length_k=n).last_hidden_state[0]


def _outputs(flat: Flat, passes: list[_Pass]) -> tuple[list[dict[str, np.ndarray]], float]:
    """Each datum's per-token outputs, as read-only views of one host array (schemas/arrays.py), and the loss."""
    per_token = all(e.dim() > 0 for p in passes for e in p.elementwise)  # a custom loss is one value per datum
    elementwise = [e.reshape(-1) for p in passes for e in p.elementwise]
    logprobs = torch.cat([p.logprobs for p in passes])
    total = torch.stack([p.total for p in passes]).sum()
    values = torch.cat([logprobs, *elementwise, total[None]]).cpu()  # one copy to the host
    values = (values if values.dtype in (torch.float32, torch.float64) else values.float()).numpy()
    values.flags.writeable = False  # the views below go into a frozen result as they are
    lp, el = values[: len(logprobs)], values[len(logprobs): -1]
    outputs, offset = [], 0
    for start, n, e in zip(flat.starts, flat.lengths, elementwise):
        outputs.append({"logprobs": lp[start: start + n]})
        if per_token:
            outputs[-1]["elementwise_loss"] = el[offset: offset + e.numel()]
        offset += e.numel()
    return outputs, float(values[-1])


@contextmanager
def _committed_on_success(params: list[torch.nn.Parameter], backward: bool) -> Iterator[None]:
    """Gradients of earlier calls (accumulating until optim_step) are set aside; this call's are added to them
    only if it finishes, so a failure in a later micro-batch leaves no partial gradient behind."""
    if not backward:
        yield
        return
    earlier = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    except BaseException:
        for p, g in zip(params, earlier):
            p.grad = g
        raise
    for p, g in zip(params, earlier):
        if g is not None:
            p.grad = g if p.grad is None else p.grad.add_(g)
