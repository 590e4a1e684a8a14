"""Serve requests against a trainer and an engine, enforcing snapshot and version semantics."""

from collections.abc import Callable
from contextlib import nullcontext
from typing import TypeVar

from schemas import (
    CreateCustomLossOutput,
    CreateCustomLossRequest,
    CreateModelOutput,
    CreateModelRequest,
    DeleteCheckpointOutput,
    DeleteCheckpointRequest,
    ErrorResponse,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateOutput,
    LoadStateRequest,
    OptimStepRequest,
    Request,
    Result,
    SampleOutput,
    SampleRequest,
    SaveStateOutput,
    SaveStateRequest,
    WeightSyncOutput,
    WeightSyncRequest,
)
from worker.runtime import paths
from worker.runtime.base import (
    Admit,
    DomainError,
    Done,
    DurableCheckpoint,
    Engine,
    Keyed,
    PendingCheckpoint,
    Trainer,
    in_order,
    servable,
    unknown_model,
)
from worker.runtime.engine_gate import EngineGate

# The requests that name a model this worker must hold (`_known`), returned as they came.
ModelOp = TypeVar("ModelOp", ForwardRequest, OptimStepRequest, SaveStateRequest, WeightSyncRequest)


class Runtime:
    """A trainer and an engine, called from two threads: the training lane's (`execute` and the model changes) and
    the sampling lane's (`sample_stream`). Every change to the engine's models and every run of generation holds
    the engine's `gate`; the trainer is the training lane's alone."""

    def __init__(self, trainer: Trainer, engine: Engine) -> None:
        self.trainer = trainer
        self.engine = engine
        self.gate = EngineGate()
        self._applied: dict[str, int] = {}
        self._paths: dict[tuple[str, int], str] = {}

    def execute(self, request: Request) -> Result:
        """Run one non-sample request. Raises DomainError for anything the caller got wrong."""
        match request:
            case WeightSyncRequest():
                return self.sync_weights(request)
            case CreateModelRequest():
                return self._create(request)
            case ForwardBackwardRequest() | ForwardRequest():
                self._known(request)
                # an engine that lends the trainer its memory must not generate until the pass is over
                with self.gate.hold() if self.engine.sleeps_for_training else nullcontext():
                    self.engine.make_room()
                    return self.trainer.forward(request, backward=isinstance(request, ForwardBackwardRequest))
            case OptimStepRequest():
                return self.trainer.optim_step(self._known(request))
            case SaveStateRequest():
                path = self.trainer.save_state(self._known(request).model_id, request.name, request.include_optimizer)
                return SaveStateOutput(path=path, include_optimizer=request.include_optimizer)
            case LoadStateRequest():
                return self._load(request)
            case DeleteCheckpointRequest():
                return self._delete(request)
            case CreateCustomLossRequest():
                self.trainer.check_custom_loss(request.loss)
                return CreateCustomLossOutput(loss_id=request.loss.loss_id)
        raise DomainError(400, "unsupported_request", f"requests of kind {request.kind!r} are not supported")

    def _delete(self, request: DeleteCheckpointRequest) -> DeleteCheckpointOutput:
        """Files only: the model need not be in this worker's memory."""
        kind, name = request.checkpoint_id.split("/", 1)
        path = paths.checkpoint_file(self.trainer.root, request.model_id, kind, name, self.trainer.checkpoint_suffix)
        try:
            path.unlink()
        except FileNotFoundError:
            return DeleteCheckpointOutput(checkpoint_id=request.checkpoint_id, deleted=False)
        return DeleteCheckpointOutput(checkpoint_id=request.checkpoint_id, deleted=True)

    def _known(self, request: ModelOp) -> ModelOp:
        if not self.trainer.has_model(request.model_id):
            raise unknown_model(request.model_id)
        return request

    def _create(self, request: CreateModelRequest) -> CreateModelOutput:
        if self.trainer.has_model(request.model_id):
            raise DomainError(409, "model_exists", f"model {request.model_id!r} already exists")
        with self.gate.hold():
            self.engine.check_create(request)
        output = self.trainer.create_model(request)
        self._register(request.model_id)
        return output

    def _load(self, request: LoadStateRequest) -> LoadStateOutput:
        output = self.trainer.load_state(request)
        with self.gate.hold():
            self.engine.remove_model(request.model_id)
        self._register(request.model_id)
        return output

    def _register(self, model_id: str) -> None:
        weights = self.trainer.export_weights(model_id)
        with self.gate.hold():
            self.engine.add_model(model_id, self.trainer.base_model(model_id), weights)
        self._applied[model_id] = 0

    def warm(self, base_model: str) -> None:
        """Load the base into the trainer and start its engine before any model of it is served here, so a shard
        taken over later pays neither (worker/shards/preload.py). DomainError for a base this deployment does
        not serve."""
        self.trainer.warm(base_model)
        with self.gate.hold():
            self.engine.warm(base_model)

    def forget(self, model_id: str) -> None:
        """Drop the model from this worker's memory (a stale copy, about to be rebuilt from its journal)."""
        self.trainer.remove_model(model_id)
        with self.gate.hold():
            self.engine.remove_model(model_id)
        self._applied.pop(model_id, None)
        self._paths = {key: path for key, path in self._paths.items() if key[0] != model_id}

    def replay(self, request: Request, snapshots: dict[int, str]) -> None:
        """Run a journaled op again to rebuild the model (worker/durability/restore.py); its output is dropped. A
        persisted sync is not saved again: its archive is recorded already (`snapshots`: version -> path)."""
        if isinstance(request, WeightSyncRequest) and request.persist and request.version in snapshots:
            self.sync_weights(request, saved=snapshots[request.version])
        elif isinstance(request, CreateModelRequest):
            self._create(request)
        else:
            self.execute(request)

    def checkpoint(self, model_id: str, name: str) -> DurableCheckpoint | None:
        """Write the model's whole state, live snapshots included (worker/durability/checkpointer.py). None when this
        runtime cannot: its trainer writes no durable state, or its engine cannot give a live snapshot back."""
        pending = self.capture(model_id)
        return None if pending is None else pending.write(name)

    def capture(self, model_id: str) -> PendingCheckpoint | None:
        """The model's whole state as it is now, to be written later (PendingCheckpoint.write, on a side thread
        where `off_thread`); None as for checkpoint()."""
        snapshots = {}
        with self.gate.hold():
            for version in self.engine.live_versions(model_id):
                weights = self.engine.snapshot_weights(model_id, version)
                if weights is None:
                    return None
                snapshots[version] = weights
        persisted = {version: path for (model, version), path in self._paths.items() if model == model_id}
        applied = self._applied.get(model_id, 0)
        writer = self.trainer.durable_writer(model_id, snapshots)
        if writer is not None:
            return PendingCheckpoint(writer, applied, persisted, off_thread=True)
        trainer = self.trainer  # no copy aside: written where the step runs (NotImplementedError: never written)
        return PendingCheckpoint(lambda name: trainer.save_durable(model_id, name, snapshots), applied, persisted,
                                 off_thread=False)

    def restore(self, model_id: str, checkpoint: DurableCheckpoint) -> None:
        """Rebuild the model from a durable checkpoint: the trainer's state, then each live snapshot under its own
        version. DomainError if the checkpoint cannot be read."""
        self.forget(model_id)
        snapshots = self.trainer.load_durable(model_id, checkpoint.path)
        versions = sorted(snapshots)
        base = self.trainer.base_model(model_id)
        first = snapshots[versions[0]] if versions else self.trainer.export_weights(model_id)
        with self.gate.hold():
            self.engine.add_model(model_id, base, first, version=versions[0] if versions else 0)
            for version in versions[1:]:
                self.engine.apply_weights(model_id, version, snapshots[version])
        self._applied[model_id] = checkpoint.applied
        self._paths.update({(model_id, version): path for version, path in checkpoint.persisted.items()})

    def sync_weights(self, request: WeightSyncRequest, saved: str | None = None) -> WeightSyncOutput:
        """Make the trainer's current weights servable as `request.version`. Replays are no-ops."""
        model_id, version = self._known(request).model_id, request.version
        if version is None:
            raise DomainError(400, "missing_version", "a weight sync needs the version its producer assigned")
        if version <= self._applied.get(model_id, -1):
            path = self._paths.get((model_id, version))
            return WeightSyncOutput(model_id=model_id, version=version, persisted=path is not None, path=path,
                                    applied=False)
        path = saved or (self.trainer.save_sampler_weights(model_id, request.name) if request.persist else None)
        weights = self.trainer.export_weights(model_id)
        with self.gate.hold():
            self.engine.apply_weights(model_id, version, weights)
        self._applied[model_id] = version
        if path is not None:
            self._paths[(model_id, version)] = path
        return WeightSyncOutput(model_id=model_id, version=version, persisted=path is not None, path=path)

    def sample(self, requests: list[SampleRequest]) -> list[SampleOutput | ErrorResponse]:
        """Serve a batch; each request gets its own output or its own error, in order."""
        return in_order(self.sample_stream, requests)

    def sample_stream(self, items: Keyed, done: Done, admit: Admit | None = None) -> None:
        """Serve `items` and what `admit` returns while they run; each request's output or error goes to
        `done` as soon as it is ready."""
        def pinned(admitted: Keyed, reload: bool) -> Keyed:
            return [(key, request) for key, _, request in servable(admitted, done, lambda r: self._pin(r, reload))]

        def more(accept: Callable[[SampleRequest], bool]) -> Keyed:
            return [] if admit is None or self.gate.wanted() else pinned(admit(accept), False)

        with self.gate.hold():
            first = pinned(items, reload=True)  # nothing runs yet: an evicted persisted snapshot may be read back
            if first:
                self.engine.generate_stream(first, done, more)

    def needs_reload(self, request: SampleRequest) -> bool:
        """Whether serving the request first reads a persisted snapshot back from its archive (so it must not join
        a running batch: it waits to start the next one)."""
        if request.base_model is not None or request.weights_version is None:
            return False
        return (request.model_id, request.weights_version) in self._paths and \
            request.weights_version not in self.engine.live_versions(request.model_id)

    def _reload(self, request: SampleRequest) -> bool:
        """Serve an evicted persisted version again from its archive; False if this engine cannot."""
        path = self._paths[(request.model_id, request.weights_version)]
        try:
            weights = self.trainer.read_sampler_weights(path)
        except DomainError as exc:
            raise DomainError(410, "snapshot_evicted", (
                f"weights version {request.weights_version} of model {request.model_id!r} is no longer held and "
                f"its archive {path!r} cannot be read back: {exc}")) from exc
        return self.engine.restore_snapshot(request.model_id, request.weights_version, weights)

    def _pin(self, request: SampleRequest, reload: bool = False) -> SampleRequest:
        """The request with the snapshot it will be served from (read back from its archive when it is a persisted
        one the engine evicted, if `reload`), or DomainError if it is not held."""
        if reload and self.needs_reload(request) and self.trainer.has_model(request.model_id):
            self._reload(request)
        if request.base_model is not None:
            self.engine.check_base(request.base_model)
            return request.model_copy(update={"weights_version": 0})
        live = self.engine.live_versions(request.model_id)
        wanted = request.weights_version
        if not live:
            raise unknown_model(request.model_id)
        if wanted is None:
            return request.model_copy(update={"weights_version": max(live)})
        if wanted in live:
            return request
        if wanted > max(live):
            raise DomainError(
                409, "weights_not_ready",
                f"model {request.model_id!r} has no weights version {wanted} yet (latest applied: {max(live)})",
                retryable=True,
            )
        raise DomainError(
            410, "snapshot_evicted",
            f"weights version {wanted} of model {request.model_id!r} is no longer held "
            f"(live versions: {live}); create a new sampling client from a newer sync",
        )
