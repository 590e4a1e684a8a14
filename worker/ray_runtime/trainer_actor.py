"""One data-parallel trainer rank as a Ray actor: the torch trainer on its run of each forward_backward's
micro-batches, in a torch.distributed group with the other ranks (gloo on the CPU, NCCL on GPUs). The gradients
of a forward_backward are summed over the ranks once it succeeded everywhere (`commit`), in a fixed order, so
every rank takes the same step and holds the same adapter as the in-process trainer (data_parallel.py).

A rank Ray restarted holds nothing: the caller re-forms the group with it (`leave`, then `join` on every rank) and
hands it what a survivor holds (`models_state` -> `adopt`): every model's adapter, gradients and optimizer state."""

import logging
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ray
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from schemas import (
    CreateModelOutput,
    CreateModelRequest,
    CustomLoss,
    ForwardBackwardOutput,
    ForwardRequest,
    LoadStateOutput,
    LoadStateRequest,
    LoraConfig,
    OptimStepOutput,
    OptimStepRequest,
)
from tinkerq.config import RuntimeConfig
from worker.ray_runtime import cluster, sharding
from worker.ray_runtime.boundary import Failed, guarded
from worker.ray_runtime.weight_group import GroupMember, WeightsMeta
from worker.torch_runtime.host_copy import tree_to_host
from worker.torch_runtime.lora_io import LoraWeights, merged_state

if TYPE_CHECKING:  # imported where the actor builds it
    from worker.torch_runtime.trainer import TorchTrainer

log = logging.getLogger(__name__)

# A collective that waits longer than this for a rank has lost it (a dead rank would otherwise hold the others in
# its all_gather for torch's default of 30 minutes); the caller then re-forms the group.
GROUP_TIMEOUT_S = 120.0
# What a trainer rank in a process of its own holds on its GPU outside torch's allocator (its CUDA context, cuBLAS
# workspaces, the group's NCCL buffers), which the in-process trainer shares with vLLM: what a rank holds there
# (its device memory in use less what torch reserved), rounded up with room to spare. vLLM's share is sized from the
# trainer's measured need, which leaves this out: without it the replica beside the rank takes the trainer's room and
# the rank's first forward_backward runs out of memory.
OWN_PROCESS_BYTES = 2 * 2**30
# (model id, base model, LoRA config, parameter values, their gradients, optimizer state), all on the host
ModelState = tuple[str, str, LoraConfig, list[torch.Tensor], list[torch.Tensor | None], dict[str, Any]]


def free_address() -> tuple[str, int]:
    """This host's address and a port free on it, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def _host_copy(weights: LoraWeights) -> LoraWeights:
    """The weights in host memory: from a GPU one copy per dtype through pinned memory (host_copy.py), not one
    pageable copy per tensor."""
    tensors, copied = tree_to_host(weights.tensors)
    copied.wait()
    return LoraWeights(weights.config, tensors)


def _on_host(leaf: Any) -> Any:
    return leaf.detach().cpu() if isinstance(leaf, torch.Tensor) else leaf


# A durable checkpoint's write runs in a thread of its own ("io"), so the training calls that follow its copy are not
# held up by the archive's compression and disk (assembly.py declares the group).
CONCURRENCY_GROUPS = {"io": 1}


class TrainerRank:
    def __init__(self, config: RuntimeConfig, rank: int, world: int) -> None:
        cluster.configure_actor()
        from worker.torch_runtime.assembly import set_threads

        set_threads(config)
        self.config = config
        self.rank, self.world = rank, world
        self.sharded = config.ray_trainer_sharding == "fsdp"
        self.mesh = None  # the group's, where bases are sharded over it (sharding.py)
        self.incarnation = uuid.uuid4().hex  # a restart by Ray is a new one, holding no models
        self.trainer = self._new_trainer()
        # per model: each micro-batch's gradients of a forward_backward not yet committed, in order
        self._pending: dict[str, list[list[torch.Tensor | None]]] = {}
        self.weights = GroupMember(self.trainer.bases.device)  # rank 0's place in the weights group (weight_group.py)
        self._writers: dict[str, Any] = {}  # durable checkpoints copied aside, not yet written

    def _new_trainer(self) -> "TorchTrainer":
        from worker.torch_runtime.assembly import make_trainer
        from worker.torch_runtime.base_models import BaseModels

        prepare = (lambda model: sharding.shard_layers(model, self.mesh)) if self.sharded else None
        return make_trainer(self.config, BaseModels(self.config.device, self.config.dtype, prepare=prepare))

    def micro_batch_tokens(self) -> int:
        """The budget its passes are cut at: the driver splits requests along the same micro-batches."""
        return self.trainer.options.micro_batch_tokens

    def address(self) -> tuple[str, int]:
        return free_address()

    def hello(self) -> tuple[str, int]:
        """This incarnation and its process id (the fault test kills that process)."""
        return self.incarnation, os.getpid()

    def join(self, host: str, port: int) -> int:
        """Join the group (every rank calls this at once; it returns when all have)."""
        backend = "nccl" if self.trainer.bases.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        if self.sharded:
            self.mesh = sharding.mesh(self.trainer.bases.device, self.world)
        return os.getpid()

    def leave(self) -> None:
        """Leave the group (one rank of it died), dropping gradients not yet committed; `join` a new one next."""
        self._pending.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
        # its bases are sharded over the group that is gone: start over, the caller hands it the models
        if self.sharded:
            self.trainer = self._new_trainer()
            self.mesh = None

    def models_state(self) -> list[ModelState]:
        """Every model this rank holds, on the host: what a restarted rank adopts to hold the same."""
        out = []
        for model_id, trained in self.trainer.models.items():
            params = self._params(model_id)
            out.append((model_id, trained.base.name, trained.spec, [p.detach().cpu() for p in params],
                        [None if p.grad is None else p.grad.detach().cpu() for p in params],
                        pytree.tree_map(_on_host, trained.optimizer.state_dict())))
        return out

    def adopt(self, states: list[ModelState]) -> None:
        """Hold exactly these models, as the rank they came from holds them."""
        for model_id in list(self.trainer.models):
            self.trainer.remove_model(model_id)
        for model_id, base, spec, values, grads, optimizer in states:
            self.trainer.create_model(CreateModelRequest(model_id=model_id, base_model=base, lora=spec))
            with torch.no_grad():
                for p, value, grad in zip(self._params(model_id), values, grads, strict=True):
                    p.copy_(value)
                    p.grad = None if grad is None else grad.to(p.device)
            self.trainer.models[model_id].optimizer.load_state_dict(optimizer)

    def _params(self, model_id: str) -> list[torch.nn.Parameter]:
        return self.trainer.models[model_id].optimizer.param_groups[0]["params"]

    def trainer_need(self, base_model: str, lora_rank: int) -> tuple[int, int]:
        """The device memory a full pass takes above what this rank holds, and its tokens (memory_share.py): what
        the engine replica on its GPU leaves free for it, with the memory a process of its own holds outside torch's
        allocator (OWN_PROCESS_BYTES). CUDA only."""
        peak, tokens = self.trainer.peak_training_bytes(base_model, lora_rank)
        return peak + OWN_PROCESS_BYTES, tokens

    def warm(self, base_model: str) -> None | Failed:
        return guarded(lambda: self.trainer.warm(base_model))

    def create_model(self, request: CreateModelRequest) -> CreateModelOutput | Failed:
        def create() -> CreateModelOutput:
            output = self.trainer.create_model(request)
            with torch.no_grad():  # rank 0's initialisation everywhere (an unseeded adapter differs per rank)
                for p in self._params(request.model_id):
                    dist.broadcast(p.data, src=0)
            return output
        return guarded(create)

    def forward(self, model_id: str, parts: list[ForwardRequest], backward: bool,
                fill: int = 0) -> list[ForwardBackwardOutput] | Failed:
        """Each part of this rank's run (a micro-batch, or with one rank the whole request), as the in-process
        trainer runs it, then `fill` filler passes (a sharded base's ranks run in lockstep: sharding.py); with
        `backward`, each part's gradients are kept apart (pending) until `commit` sums every rank's in the request's
        order, and the adapter's accumulated gradients are left as they were (a failing rank elsewhere means
        `discard`)."""
        fillers = [sharding.filler(model_id)] * fill
        if not backward:
            return guarded(lambda: [self.trainer.forward(p, False) for p in parts + fillers][:len(parts)])
        params = self._params(model_id) if parts or fillers else []
        earlier = [p.grad for p in params]
        grads: list[list[torch.Tensor | None]] = []

        def run() -> list[ForwardBackwardOutput]:
            outputs = []
            for request in parts + fillers:
                for p in params:
                    p.grad = None
                outputs.append(self.trainer.forward(request, True))
                grads.append([p.grad for p in params])
            del grads[len(parts):]
            return outputs[:len(parts)]

        started = time.perf_counter()
        try:
            outputs = guarded(run)
        finally:
            for p, g in zip(params, earlier):
                p.grad = g
        log.info("rank %d: forward_backward of %d part(s), %d tokens, %.1f ms in the trainer", self.rank, len(parts),
                 sum(len(d.model_input) for p in parts for d in p.data), 1000 * (time.perf_counter() - started))
        if parts and not isinstance(outputs, Failed):
            self._pending[model_id] = grads
        return outputs

    def discard(self, model_id: str) -> None:
        """Drop the pending gradients of a forward_backward that failed on some rank."""
        self._pending.pop(model_id, None)

    def commit(self, model_id: str, counts: list[int]) -> None:
        """Every rank at once: add the forward_backward's gradients to the adapter's, summed micro-batch by
        micro-batch in the request's order (rank 0's first, `counts[r]` from rank r). Every rank gathers all
        of them and sums in that fixed order, so every rank holds the same gradient, equal to the in-process
        trainer's (autograd accumulates its passes the same way; a ring all-reduce would add in another order).
        The price: every rank holds one gradient copy per micro-batch of the request, fine for LoRA adapters;
        full-weight training would want a fixed-order reduce-scatter instead."""
        params = self._params(model_id)
        mine = self._pending.pop(model_id, [])
        if self.world == 1 and len(mine) == 1:  # one rank ran the request whole: its gradients as they are (the
            for p, grad in zip(params, mine[0]):  # copies and gather below would be work for nothing)
                if grad is not None:  # in process: this call's gradient, then the earlier ones added to it
                    p.grad = grad if p.grad is None else grad.add_(p.grad)
            return
        has = torch.tensor([any(g[k] is not None for g in mine) for k in range(len(params))], dtype=torch.int32,
                           device=params[0].device)  # NCCL (the group on a GPU) reduces device tensors only
        dist.all_reduce(has, op=dist.ReduceOp.MAX)  # a parameter with a gradient on any rank has one everywhere
        with_grad = [k for k, h in enumerate(has.tolist()) if h]
        if not with_grad:
            return
        device, numel = params[0].device, sum(params[k].numel() for k in with_grad)
        local = torch.zeros(max(counts), numel, dtype=params[with_grad[0]].dtype, device=device)
        for j, g in enumerate(mine):
            local[j] = torch.cat([(g[k] if g[k] is not None else torch.zeros_like(params[k])).reshape(-1)
                                  for k in with_grad])
        gathered = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local)
        rows = [gathered[r][j] for r in range(self.world) for j in range(counts[r])]
        total = rows[0].clone()
        for row in rows[1:]:
            total += row
        offset = 0
        for k in with_grad:
            p, n = params[k], params[k].numel()
            grad = total[offset: offset + n].view_as(p).clone()
            offset += n
            # in process: this call's gradient, then the earlier ones added to it (packed_forward)
            p.grad = grad if p.grad is None else grad.add_(p.grad)

    def optim_step(self, request: OptimStepRequest) -> OptimStepOutput | Failed:
        """Every rank holds the same gradients (commit), so each takes the same step."""
        return guarded(lambda: self.trainer.optim_step(request))

    def remove_model(self, model_id: str) -> None:
        self._pending.pop(model_id, None)
        self.trainer.remove_model(model_id)

    def export_weights(self, model_id: str) -> LoraWeights:
        """The adapter's tensors on the host: returned into Ray's object store, where the engines read them."""
        return _host_copy(self.trainer.export_weights(model_id))

    # -- the weights group (rank 0 only; weight_group.py) --

    def weights_join(self, host: str, port: int, rank: int, world: int, generation: int, backend: str) -> None:
        self.weights.join(host, port, rank, world, generation, backend)

    def weights_leave(self) -> None:
        self.weights.leave()

    def stage_weights(self, model_id: str) -> WeightsMeta:
        """Export the adapter and hold it for the replicas; what they need to take it."""
        return self.weights.stage(self.trainer.export_weights(model_id))

    def send_staged(self, generation: int) -> None:
        self.weights.send(generation)

    def staged_weights(self) -> LoraWeights:
        """The export just sent, on the host, for the facade's snapshot record (Ray's object store keeps it)."""
        return self.weights.unstage()

    # -- durable state (rank 0 writes it, every rank reads it back) --

    def durable_copy(self, model_id: str, snapshots: dict[int, LoraWeights]) -> str:
        """Copy aside (host memory) everything a durable checkpoint of the model writes, as it is now; a token for
        `durable_write`."""
        token = uuid.uuid4().hex
        self._writers[token] = self.trainer.durable_writer(model_id, snapshots)
        return token

    @ray.method(concurrency_group="io")
    def durable_write(self, token: str, name: str) -> str | Failed:
        """Write the copy `durable_copy` made (beside the training calls, which go on meanwhile); its path."""
        return guarded(lambda: self._writers.pop(token)(name))

    def load_durable(self, model_id: str, path: str) -> tuple[str, dict[int, LoraWeights]] | Failed:
        """Rebuild the model from the file; its base, and (rank 0's answer, on the host) the snapshots' weights."""
        def load() -> tuple[str, dict[int, LoraWeights]]:
            snapshots = self.trainer.load_durable(model_id, path)
            if self.rank != 0:
                snapshots = {}  # the caller takes rank 0's: the others would cross the boundary for nothing
            return self.trainer.base_model(model_id), {version: _host_copy(w) for version, w in snapshots.items()}

        return guarded(load)

    def read_sampler_weights(self, path: str) -> LoraWeights | Failed:
        return guarded(lambda: self.trainer.read_sampler_weights(path))

    def save_sampler_weights(self, model_id: str, name: str) -> str | None | Failed:
        """Rank 0 writes the archive; over a sharded base the other ranks take part in gathering its weights."""
        if self.rank == 0:
            return guarded(lambda: self.trainer.save_sampler_weights(model_id, name))

        def gather() -> None:
            trained = self.trainer.models[model_id]
            merged_state(trained.base, trained.adapter)

        return guarded(gather)

    def save_state(self, model_id: str, name: str, include_optimizer: bool) -> str | Failed:
        return guarded(lambda: self.trainer.save_state(model_id, name, include_optimizer))

    def load_state(self, request: LoadStateRequest) -> LoadStateOutput | Failed:
        return guarded(lambda: self.trainer.load_state(request))

    def check_custom_loss(self, loss: CustomLoss) -> None | Failed:
        return guarded(lambda: self.trainer.check_custom_loss(loss))
