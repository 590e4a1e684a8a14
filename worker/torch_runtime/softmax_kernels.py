"""The unembedding's softmax passes per row of logits, as one Triton kernel each on CUDA and torch ops elsewhere.

For logits [c, V] (the model's dtype), targets [c] and, in the backward, the upstream gradient g [c] of each
token's target logprob:
  `target_logprobs_lse(logits, targets)` -> (logits[target] - lse, lse), float32, lse = logsumexp of the row
  `softmax_grad_(logits, targets, lse, g)` -> logits overwritten by g * (onehot(target) - exp(logits - lse)),
      the gradient of the logits, in their dtype
torch's float32 path (log_softmax; then softmax, a multiply, a scatter and a cast back) writes and reads whole
float32 [c, V] tensors: about 28 bytes of memory traffic per logit, the unembedding's largest cost after its
matmuls. The kernels read each logit once per pass and write the gradient in place: 6 bytes per logit, and no
float32 copy to hold. Both compute in float32 from the stored logits, as the torch path does; the CPU (and any
tensor Triton cannot take, or a call with kernels=False) keeps the torch path, the exact reference.
"""

import importlib.util
import logging
from types import ModuleType

import torch

log = logging.getLogger(__name__)
BLOCK = 4096  # logits per step of a row's loop: 8 KB of bf16, 16 B a thread over 8 warps


def _usable(logits: torch.Tensor, kernels: bool) -> bool:
    return (kernels and logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[0] > 0
            and logits.dtype in (torch.bfloat16, torch.float16, torch.float32) and _triton() is not None)


_kernels = None
_failed = False


def _triton() -> ModuleType | None:
    """The compiled kernels, built at first use (Triton imports only where it is installed: never on the CPU
    test machines); None once they failed."""
    global _kernels
    if _kernels is None and not _failed and importlib.util.find_spec("triton") is not None:
        from worker.torch_runtime import softmax_triton

        _kernels = softmax_triton
    return None if _failed else _kernels


def _off(exc: Exception) -> None:
    """A kernel that does not build or run here (an old GPU, a Triton without this backend): torch's path for good."""
    global _failed
    _failed = True
    log.warning("Triton softmax kernels unavailable (%s: %s); the unembedding uses torch's ops", type(exc).__name__,
                exc)


def target_logprobs_lse(logits: torch.Tensor, targets: torch.Tensor,
                        kernels: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    if _usable(logits, kernels):
        try:
            return _triton().target_logprobs_lse(logits, targets, BLOCK)
        except Exception as exc:  # noqa: BLE001 - Triton's compile errors have no common type
            _off(exc)
    lse = torch.logsumexp(logits.float(), -1)
    return logits.gather(1, targets[:, None])[:, 0].float() - lse, lse


def softmax_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                  kernels: bool = True) -> torch.Tensor:
    if _usable(logits, kernels):
        try:
            return _triton().softmax_grad_(logits, targets, lse, g.float().contiguous(), BLOCK)
        except Exception as exc:  # noqa: BLE001 - as above; the logits are written only by a kernel that ran
            _off(exc)
    g = g.float()[:, None]
    dlogits = torch.exp(logits.float() - lse[:, None]).mul_(-g).scatter_add_(1, targets[:, None], g)
    return logits.copy_(dlogits)
