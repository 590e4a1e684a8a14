"""The Engine the Runtime sees: N engine replicas (Ray actors) serving as one.

Syncs go to every replica and return only once all hold the snapshot, so a sample after a sync is served
from it wherever it lands. Samples are spread over the replicas (least outstanding work first); each result
is handed to `done` as soon as its replica yields it. A replica that dies mid-batch fails only its unfinished
requests, each with a retryable error; Ray restarts it, and it is rebuilt from the record of live snapshots
before it serves or takes a sync again."""

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from schemas import CreateModelRequest, ErrorResponse, SampleOutput, SampleRequest
from worker.ray_runtime.boundary import Stale, unwrap
from worker.ray_runtime.snapshots import SnapshotRecord
from worker.ray_runtime.weight_group import OnTrainer
from worker.ray_runtime.weight_sync import GroupSync
from worker.runtime.base import Admit, Done, Engine, Keyed, in_order

log = logging.getLogger(__name__)
POLL_S = 0.02  # how often, while replicas decode, newly queued samples are looked for
CALL_TIMEOUT_S = 600.0  # a sync, a restore or a check that takes longer is an infrastructure fault
RESTART_TIMEOUT_S = 300.0  # how long a dead replica may take to come back before it is left out


def replica_lost(exc: BaseException) -> bool:
    return isinstance(exc, (RayActorError, ActorUnavailableError))


def is_stale(exc: BaseException) -> bool:
    return isinstance(exc, Stale) or (isinstance(exc, RayTaskError) and isinstance(exc.cause, Stale))


def lost_error(replica: int) -> ErrorResponse:
    return ErrorResponse(error=f"engine replica {replica} died while serving this request; it is being restarted "
                               "and re-synced: send the request again", status=503, code="engine_restarted",
                         retryable=True)


def cost(request: SampleRequest) -> int:
    return request.num_samples * (len(request.prompt_tokens) + request.sampling_params.max_tokens)


class RayEngine(Engine):
    def __init__(self, replicas: list[ActorHandle], max_snapshots: int, group: GroupSync,
                 on_close: Callable[[], None] | None = None) -> None:
        if not replicas:
            raise ValueError("a Ray engine needs at least one replica")
        self.replicas = replicas
        self.synced: list[str | None] = [None] * len(replicas)  # the incarnation each was last rebuilt as
        self.dead: set[int] = set()  # replicas Ray gave up restarting
        self.record = SnapshotRecord(max_snapshots)
        self._on_close = on_close
        self.group = group  # how weights left on trainer rank 0 (OnTrainer) are broadcast to the replicas
        for i in range(len(replicas)):
            self._resync(i)

    # -- snapshots: the record first, then every replica ----------------------------------------

    def add_model(self, model_id: str, base_model: str, weights: Any, version: int = 0) -> None:
        if isinstance(weights, OnTrainer):
            kept, failed = self._broadcast(model_id, version, base_model)
            self.record.add_model(model_id, base_model, kept, version)
            self._rebuild(failed)
            return
        self.record.add_model(model_id, base_model, weights, version)
        self._everywhere("add_model", model_id, base_model, weights, version)

    def apply_weights(self, model_id: str, version: int, weights: Any) -> None:
        if isinstance(weights, OnTrainer):
            kept, failed = self._broadcast(model_id, version, None)
            self.record.apply(model_id, version, kept)
            self._rebuild(failed)
            return
        self.record.apply(model_id, version, weights)
        self._everywhere("apply_weights", model_id, version, weights)

    def _broadcast(self, model_id: str, version: int, base_model: str | None) -> tuple[ray.ObjectRef, list[int]]:
        """Trainer rank 0's weights of the model to every serving replica over the weights group: a reference to
        them for the record, and the replicas that did not take them."""
        self._heal()
        serving = {i: (self.replicas[i], self.synced[i]) for i in self._serving()}
        return self.group.deliver(model_id, version, serving, base_model)

    def _rebuild(self, replicas: list[int]) -> None:
        """Replicas that missed a change: rebuilt from the record (which holds it) through the object store."""
        for i in replicas:
            self._resync(i)

    def remove_model(self, model_id: str) -> None:
        self.record.remove(model_id)
        self._everywhere("remove_model", model_id)

    def live_versions(self, model_id: str) -> list[int]:
        return self.record.versions(model_id)

    def snapshot_weights(self, model_id: str, version: int) -> Any:
        """From the record (what rebuilds a restarted replica holds every live snapshot's weights)."""
        weights = self.record.weights(model_id, version)
        return self._get(weights) if isinstance(weights, ray.ObjectRef) else weights

    def restore_snapshot(self, model_id: str, version: int, weights: Any) -> bool:
        self.record.restore(model_id, version, weights)
        if all(self._everywhere("restore_snapshot", model_id, version, weights)):
            return True
        self.record.drop(model_id, version)  # the engines cannot (vLLM's merged weights)
        return False

    def warm(self, base_model: str) -> None:
        """Every live replica starts the base's engine (a standby's preload); one restarted later starts it on first
        use."""
        for ref in [self.replicas[i].warm.remote(base_model) for i in self._alive()]:
            unwrap(self._get(ref))

    def check_base(self, base_model: str) -> None:
        unwrap(self._get(self._any().check_base.remote(base_model)))

    def check_create(self, request: CreateModelRequest) -> None:
        unwrap(self._get(self._any().check_create.remote(request)))

    def _everywhere(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every live replica and wait for all; their answers. One that was restarted is rebuilt
        from the record (which already holds this change) instead, and answers nothing."""
        self._heal()
        calls = {i: getattr(self.replicas[i], method).remote(self.synced[i], *args) for i in self._alive()}
        answers = []
        for i, ref in calls.items():
            try:
                answers.append(self._get(ref))
            except Exception as exc:  # sorted below
                if not (is_stale(exc) or replica_lost(exc)):
                    raise
                self._resync(i)
        return answers

    # -- replicas coming back ---------------------------------------------------------------------

    def _resync(self, i: int) -> bool:
        """Rebuild replica i from the record once Ray has it running again; False if it is gone for good."""
        self.synced[i] = None
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                self.synced[i] = self._get(self.replicas[i].restore.remote(self.record.records()))
                return True
            except ActorDiedError:
                break  # out of restarts
            except (ActorUnavailableError, RayActorError, GetTimeoutError):
                time.sleep(0.2)  # restarting
        log.error("engine replica %d did not come back; serving without it", i)
        self.dead.add(i)
        if len(self.dead) == len(self.replicas):
            raise RuntimeError("every engine replica is gone")
        return False

    def _heal(self) -> None:
        """Rebuild every replica lost since it was last synced."""
        for i in self._alive():
            if self.synced[i] is None:
                self._resync(i)

    def _serving(self) -> list[int]:
        return [i for i in self._alive() if self.synced[i] is not None]

    def _alive(self) -> list[int]:
        return [i for i in range(len(self.replicas)) if i not in self.dead]

    def _any(self) -> ActorHandle:
        return self.replicas[self._alive()[0]]

    @staticmethod
    def _get(ref: ray.ObjectRef) -> Any:
        return ray.get(ref, timeout=CALL_TIMEOUT_S)

    # -- sampling ---------------------------------------------------------------------------------

    def generate(self, requests: list[SampleRequest]) -> list[SampleOutput | ErrorResponse]:
        return in_order(self.generate_stream, requests)

    def generate_stream(self, items: Keyed, done: Done, admit: Admit | None = None) -> None:
        """Spread `items` over the replicas and hand each result to `done` as it arrives; while they run, what
        `admit` returns is spread too. Returns once every request has its result or its error."""
        self._heal()
        running: dict[Any, tuple[int, dict[str, SampleRequest]]] = {}  # stream -> (replica, unfinished)
        load = {i: 0 for i in self._serving()}

        def dispatch(batch: Keyed) -> None:
            if not load:  # every replica was lost during this call: wait for one to come back
                self._heal()
                load.update({i: 0 for i in self._serving()})
            shares: dict[int, Keyed] = {}
            for key, request in sorted(batch, key=lambda item: -cost(item[1])):
                i = min(load, key=load.__getitem__)
                load[i] += cost(request)
                shares.setdefault(i, []).append((key, request))
            for i, share in shares.items():
                stream = self.replicas[i].serve.options(num_returns="streaming").remote(self.synced[i], share)
                running[stream] = (i, dict(share))

        def failed(stream: Any, exc: BaseException) -> None:
            i, unfinished = running.pop(stream)
            for request in unfinished.values():
                load[i] -= cost(request)
            if is_stale(exc):  # restarted before it began: nothing was served; rebuild it and send them again
                if self._resync(i):
                    dispatch(list(unfinished.items()))
                    return
            elif not replica_lost(exc):
                raise exc
            log.warning("engine replica %d was lost with %d requests unfinished", i, len(unfinished))
            self.synced[i] = None  # rebuilt (_heal) before it serves again; the others go on meanwhile
            load.pop(i, None)
            for key in unfinished:
                done(key, lost_error(i))

        dispatch(items)
        while running:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
            for stream in ready:
                i, unfinished = running[stream]
                try:
                    results = ray.get(next(stream))
                except StopIteration:
                    running.pop(stream)
                    for key in unfinished:  # a replica that ends without answering is a fault, not silence
                        done(key, lost_error(i))
                    continue
                except Exception as exc:  # noqa: BLE001 - sorted in failed()
                    failed(stream, exc)
                    continue
                for key, result in results:
                    load[i] -= cost(unfinished.pop(key))
                    done(key, result)
            if admit:
                more = admit(lambda request: True)
                if more:
                    dispatch(more)
        self._heal()

    def close(self) -> None:
        for replica in self.replicas:
            ray.kill(replica, no_restart=True)
        if self._on_close:
            self._on_close()
