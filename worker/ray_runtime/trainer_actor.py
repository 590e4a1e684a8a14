"""One data-parallel trainer rank as a Ray actor: the torch trainer on its slice of each forward_backward, in a
torch.distributed group with the other ranks (gloo on the CPU, NCCL on GPUs). Gradients are summed over the
ranks once per optim_step (in one flat buffer), so every rank takes the same step and holds the same adapter."""

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from schemas import CreateModelRequest, CustomLoss, ForwardRequest, LoadStateRequest, OptimStepRequest
from tinkerq.config import RuntimeConfig
from worker.ray_runtime.boundary import guarded


def free_address() -> tuple[str, int]:
    """This host's address and a port free on it, for the group's rendezvous."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


class TrainerRank:
    def __init__(self, config: RuntimeConfig, rank: int, world: int) -> None:
        from worker.torch_runtime.bases import BaseModels
        from worker.torch_runtime.trainer import TorchTrainer

        self.rank, self.world = rank, world
        self.trainer = TorchTrainer(BaseModels(config.device, config.dtype), Path(config.checkpoint_root))
        self._earlier: dict[str, list[torch.Tensor | None]] = {}  # gradients before the last forward

    def address(self) -> tuple[str, int]:
        return free_address()

    def join(self, host: str, port: int) -> int:
        """Join the group (every rank calls this at once; it returns when all have)."""
        backend = "nccl" if self.trainer.bases.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world)
        return os.getpid()

    def _params(self, model_id: str) -> list[torch.nn.Parameter]:
        return self.trainer.models[model_id].optimizer.param_groups[0]["params"]

    def create_model(self, request: CreateModelRequest):
        def create():
            output = self.trainer.create_model(request)
            with torch.no_grad():  # rank 0's initialisation everywhere (an unseeded adapter differs per rank)
                for p in self._params(request.model_id):
                    dist.broadcast(p.data, src=0)
            return output
        return guarded(create)

    def forward(self, request: ForwardRequest, backward: bool):
        if backward:
            self._earlier[request.model_id] = [p.grad for p in self._params(request.model_id)]
        return guarded(lambda: self.trainer.forward(request, backward))

    def rollback(self, model_id: str) -> None:
        """Undo the last forward_backward's gradients (another rank's slice of it failed)."""
        for p, g in zip(self._params(model_id), self._earlier.pop(model_id)):
            p.grad = g

    def optim_step(self, request: OptimStepRequest):
        params = self._params(request.model_id)
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        dist.all_reduce(has, op=dist.ReduceOp.MAX)  # a parameter with a gradient on any rank has one everywhere
        with_grad = [p for p, h in zip(params, has.tolist()) if h]
        if with_grad:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in with_grad])
            dist.all_reduce(flat)
            offset = 0
            for p in with_grad:
                p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        return guarded(lambda: self.trainer.optim_step(request))

    def export_weights(self, model_id: str):
        """The adapter's tensors on the host: returned into Ray's object store, where the engines read them."""
        weights = self.trainer.export_weights(model_id)
        return type(weights)(weights.config, {k: v.cpu() for k, v in weights.tensors.items()})

    def save_sampler_weights(self, model_id: str, name: str):
        return guarded(lambda: self.trainer.save_sampler_weights(model_id, name))

    def save_state(self, model_id: str, name: str, include_optimizer: bool):
        return guarded(lambda: self.trainer.save_state(model_id, name, include_optimizer))

    def load_state(self, request: LoadStateRequest):
        return guarded(lambda: self.trainer.load_state(request))

    def check_custom_loss(self, loss: CustomLoss):
        return guarded(lambda: self.trainer.check_custom_loss(loss))
