"""The Trainer the Runtime sees: data-parallel trainer ranks (Ray actors) acting as one.

Every rank holds every model (same initialisation, same steps); a forward_backward is split over them along
the in-process trainer's micro-batches, and its gradients are summed over the ranks once every rank's share
succeeded (data_parallel.py says why the result is the in-process one exactly). Exported weights stay in Ray's
object store: what export_weights returns is a reference, handed to the engine replicas without passing through
this process.

A rank that dies is restarted by Ray; the call that met its death waits for the others, re-forms the group with
the new incarnation and copies every model into it from a surviving rank (`_regroup`). A forward_backward (nothing
was added to any gradient yet) and a call that changes nothing run again, so their caller gets the result; an op
that changed the survivors (optim_step, load_state, ...) stands as they answered it, the new rank holding the state
they reached. With no survivor the models are gone here, and the call fails: the consumer's durable restore
rebuilds them on their next use."""

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from schemas import (
    CreateModelOutput,
    CreateModelRequest,
    CustomLoss,
    ForwardBackwardOutput,
    ForwardRequest,
    LoadStateOutput,
    LoadStateRequest,
    OptimStepOutput,
    OptimStepRequest,
)
from tinkerq.config import WeightTransport
from worker.ray_runtime.boundary import Failed, unwrap
from worker.ray_runtime.data_parallel import assignment, merged, part
from worker.ray_runtime.weight_group import OnTrainer
from worker.runtime.base import DomainError, Trainer

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 1800.0  # one training call; longer is an infrastructure fault (the consumer's RQ job fails)
RESTART_TIMEOUT_S = 300.0  # how long a dead rank may take to come back
# How a sync's weights reach the engine replicas (config.ray_weight_transport): "object_store", rank 0's export as a
# task return value, kept once by Ray (in its shared-memory object store; one under 100 KiB travels inline in the
# reply instead) and read by every replica; "group", by CUDA IPC to the replica on rank 0's GPU and over a gloo group
# of rank 0 and the other replicas (weight_group.py, weight_sync.py). No NCCL yet.
TRANSPORTS: tuple[str, ...] = get_args(WeightTransport)


def _all(refs: list[ray.ObjectRef]) -> list[Any]:
    return ray.get(refs, timeout=CALL_TIMEOUT_S)


def _first_failure(values: list[Any]) -> None:
    for value in values:
        unwrap(value)


class RanksLost(RuntimeError):
    """Every trainer rank died at once: the models they held are gone from this worker."""


class RayTrainer(Trainer):
    def __init__(self, ranks: list[ActorHandle], checkpoint_root: Path,
                 transport: WeightTransport = "object_store", sharded: bool = False) -> None:
        self.ranks = ranks
        self.transport = transport
        self.sharded = sharded  # bases sharded over the ranks (sharding.py): they run every pass in lockstep
        self.root = checkpoint_root.resolve()
        self._bases: dict[str, str] = {}
        # the ranks' pass budget: a request is split along the micro-batches the in-process trainer would make
        self.micro_batch_tokens: int = _all([ranks[0].micro_batch_tokens.remote()])[0]
        self.incarnations: list[str] = [hello[0] for hello in _all([rank.hello.remote() for rank in ranks])]

    # -- every rank, surviving a dead one ---------------------------------------------------------

    def _on_ranks(self, call: Callable[[int, ActorHandle], ray.ObjectRef], rerun: bool,
                  ranks: list[int] | None = None) -> list[Any]:
        """call(i, rank) on these ranks (all by default), their answers in order. If one died, the group is re-formed
        with its restart (`_regroup`); then the call runs again where `rerun` (it changed nothing yet), else the
        survivors' answers stand (their op happened; the restarted rank holds what they reached)."""
        which = list(range(len(self.ranks))) if ranks is None else ranks
        values, dead = self._answers([call(i, self.ranks[i]) for i in which])
        if not dead:
            return _raising(values)
        survivors = self._regroup()
        if rerun:
            return _raising(self._answers([call(i, self.ranks[i]) for i in which])[0])
        kept = [v for i, v in zip(which, values) if i in survivors]
        if not kept or any(isinstance(v, BaseException) for v in kept):
            raise DomainError(503, "trainer_restarted", "a trainer rank died during this call and was restarted; "
                              "its effect is unknown: send it again", retryable=True)
        return kept

    @staticmethod
    def _answers(refs: list[ray.ObjectRef]) -> tuple[list[Any], bool]:
        """Every call's answer (an exception where it raised), once all ended; and whether a rank died in one."""
        ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S)
        values, dead = [], False
        for ref in refs:
            try:
                values.append(ray.get(ref, timeout=CALL_TIMEOUT_S))
            except (RayActorError, ActorUnavailableError) as exc:
                values.append(exc)
                dead = True
            except Exception as exc:  # noqa: BLE001 - raised by _raising, unless a rank died (then a consequence)
                values.append(exc)
        return values, dead

    def _regroup(self) -> set[int]:
        """Bring every rank back, re-form the group and hand the restarted ranks a survivor's models; the survivors'
        indices. With none, the models are gone: RanksLost."""
        hellos = [self._hello(i) for i in range(len(self.ranks))]
        survivors = {i for i, (incarnation, _) in enumerate(hellos) if incarnation == self.incarnations[i]}
        restarted = [i for i in range(len(self.ranks)) if i not in survivors]
        log.warning("trainer ranks %s were restarted; re-forming the group%s", restarted,
                    f" from rank {min(survivors)}'s models" if survivors else ", with no survivor")
        # taken before the group goes: a sharded rank leaving it drops its models with the bases sharded over it
        state = self.ranks[min(survivors)].models_state.remote() if survivors else None
        _all([rank.leave.remote() for rank in self.ranks])
        host, port = _all([self.ranks[0].address.remote()])[0]
        _all([rank.join.remote(host, port) for rank in self.ranks])
        self.incarnations = [incarnation for incarnation, _ in hellos]
        if not survivors:
            self._bases.clear()
            raise RanksLost("every trainer rank died: the models they held are gone from this worker")
        adopting = range(len(self.ranks)) if self.sharded else restarted
        _all([self.ranks[i].adopt.remote(state) for i in adopting])
        return survivors

    def _hello(self, i: int) -> tuple[str, int]:
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            try:
                return ray.get(self.ranks[i].hello.remote(), timeout=CALL_TIMEOUT_S)
            except (ActorUnavailableError, GetTimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # Ray is restarting it
            except ActorDiedError:
                raise RanksLost(f"trainer rank {i} is gone for good (out of restarts)") from None

    # -- the Trainer ------------------------------------------------------------------------------

    def has_model(self, model_id: str) -> bool:
        return model_id in self._bases

    def base_model(self, model_id: str) -> str:
        return self._bases[model_id]

    def warm(self, base_model: str) -> None:
        _first_failure(self._on_ranks(lambda i, rank: rank.warm.remote(base_model), rerun=True))

    def create_model(self, request: CreateModelRequest) -> CreateModelOutput:
        def create(i: int, rank: ActorHandle) -> ray.ObjectRef:
            return rank.create_model.remote(request)

        try:
            outputs = self._on_ranks(create, rerun=False)
        except DomainError as exc:
            if exc.code != "trainer_restarted":
                raise
            self._on_ranks(lambda i, rank: rank.remove_model.remote(request.model_id), rerun=True)
            outputs = self._on_ranks(create, rerun=False)  # anew, from rank 0's initialisation
        _first_failure(outputs)
        self._bases[request.model_id] = outputs[0].base_model
        return outputs[0]

    def forward(self, request: ForwardRequest, backward: bool) -> ForwardBackwardOutput:
        runs = assignment(request, self.micro_batch_tokens, len(self.ranks))
        passes = max(len(run) for run in runs) if self.sharded else 0

        def share(i: int, rank: ActorHandle) -> ray.ObjectRef:
            parts = [part(request, span) for span in runs[i]]
            return rank.forward.remote(request.model_id, parts, backward, max(passes - len(parts), 0))

        # a rank lost mid-forward: the others' shares are dropped with the group (`leave`), and it runs again
        started = time.perf_counter()
        outputs = self._on_ranks(share, rerun=True)
        answered = time.perf_counter()
        if any(isinstance(out, Failed) for out in outputs):
            if backward:  # nothing was added to any rank's gradients yet: drop what the others computed
                self._on_ranks(lambda i, rank: rank.discard.remote(request.model_id), rerun=True)
            _first_failure(outputs)
        if backward:
            # a rank lost while committing: every rank's gradients are as before the call (commit adds them only
            # after its gather), so the whole forward_backward runs again
            counts = [len(run) for run in runs]
            try:
                self._on_ranks(lambda i, rank: rank.commit.remote(request.model_id, counts), rerun=False)
            except DomainError as exc:
                if exc.code != "trainer_restarted":
                    raise
                return self.forward(request, backward)
            log.info("forward_backward on %d rank(s): %.1f ms to their answers, %.1f ms to commit the gradients",
                     len(self.ranks), 1000 * (answered - started), 1000 * (time.perf_counter() - answered))
        return merged([out for rank_outputs in outputs for out in rank_outputs],
                      [b - a for run in runs for a, b in run])

    def optim_step(self, request: OptimStepRequest) -> OptimStepOutput:
        outputs = self._on_ranks(lambda i, rank: rank.optim_step.remote(request), rerun=False)
        _first_failure(outputs)
        return outputs[0]

    def remove_model(self, model_id: str) -> None:
        """Drop the model's adapter, optimizer and gradients on every rank (durable restore rebuilds it)."""
        self._on_ranks(lambda i, rank: rank.remove_model.remote(model_id), rerun=True)
        self._bases.pop(model_id, None)

    def export_weights(self, model_id: str) -> ray.ObjectRef | OnTrainer:
        if self.transport == "group":
            return OnTrainer(model_id)  # the engine facade has rank 0 broadcast them
        return self.ranks[0].export_weights.remote(model_id)  # a reference, owned by this process

    def _on_rank0(self, call: Callable[[ActorHandle], ray.ObjectRef]) -> Any:
        return unwrap(self._on_ranks(lambda i, rank: call(rank), rerun=True, ranks=[0])[0])

    def save_sampler_weights(self, model_id: str, name: str) -> str:
        if not self.sharded:
            return self._on_rank0(lambda rank: rank.save_sampler_weights.remote(model_id, name))
        # rank 0 writes; the others take part in gathering the base's shards
        return unwrap(self._on_ranks(lambda i, rank: rank.save_sampler_weights.remote(model_id, name), rerun=True)[0])

    def save_state(self, model_id: str, name: str, include_optimizer: bool) -> str:
        return self._on_rank0(lambda rank: rank.save_state.remote(model_id, name, include_optimizer))

    def load_state(self, request: LoadStateRequest) -> LoadStateOutput:
        outputs = self._on_ranks(lambda i, rank: rank.load_state.remote(request), rerun=False)
        _first_failure(outputs)
        self._bases[request.model_id] = outputs[0].base_model
        return outputs[0]

    def check_custom_loss(self, loss: CustomLoss) -> None:
        self._on_rank0(lambda rank: rank.check_custom_loss.remote(loss))

    # -- durable state: written by rank 0 (every rank holds the same), read back by every rank --

    def save_durable(self, model_id: str, name: str, snapshots: dict[int, Any]) -> str:
        return self.durable_writer(model_id, snapshots)(name)

    def durable_writer(self, model_id: str, snapshots: dict[int, Any]) -> Callable[[str], str]:
        """Rank 0 copies the state aside now; the returned function has it written (on the checkpointer's side
        thread here, in rank 0's "io" thread there) while training goes on."""
        rank = self.ranks[0]
        token = ray.get(rank.durable_copy.remote(model_id, snapshots), timeout=CALL_TIMEOUT_S)
        return lambda name: unwrap(ray.get(rank.durable_write.remote(token, name), timeout=CALL_TIMEOUT_S))

    def load_durable(self, model_id: str, path: str) -> dict[int, Any]:
        outputs = self._on_ranks(lambda i, rank: rank.load_durable.remote(model_id, path), rerun=True)
        _first_failure(outputs)
        base, snapshots = outputs[0]
        self._bases[model_id] = base
        return snapshots

    def read_sampler_weights(self, path: str) -> Any:
        return self._on_rank0(lambda rank: rank.read_sampler_weights.remote(path))


def _raising(values: list[Any]) -> list[Any]:
    """The answers, or the first exception among them raised here."""
    for value in values:
        if isinstance(value, BaseException):
            raise value
    return values
