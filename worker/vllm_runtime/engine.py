"""The vLLM sampling engine: one in-process `vllm.LLM` per base model, weight snapshots by version.

Two ways to make a sync servable (`RuntimeConfig.vllm_sync`):

* lora (default): each synced version is a LoRA adapter of its own (a fresh adapter id), so samples of
  many models and of older snapshots share one engine and even one batch. At most `max_snapshots` per
  model stay live; an older one is removed from vLLM and answers `snapshot_evicted`.
* merged: the adapter is merged into the base weights, which are reloaded in place (`reload_weights`)
  and the prefix cache is reset, so no cached KV of the old weights survives. The engine then serves
  one model per base and only its latest version.

Continuous batching: samples run on vLLM's engine loop (`add_request`, `step`), and requests the worker
admits between steps join the running batch; each result is handed back as soon as its samples finish.
Drain, then apply: the loop runs until no request is left before it returns, and the worker applies a
sync only between runs (it stops admitting once a sync is queued), so no sample is ever in flight while
weights change.
"""

import importlib.util
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from schemas import CreateModelRequest, ErrorResponse, SampleOutput, SampleRequest, SamplingParams
from schemas.ids import base_model_id
from tinkerq.catalog import BaseModelCatalog
from tinkerq.config import RuntimeConfig
from worker.runtime.base import Admit, DomainError, Done, Engine, Keyed, check_fits, in_order, servable
from worker.runtime.process_activity import Activity
from worker.torch_runtime.base_models import base_path, resolve_device, resolve_dtype
from worker.torch_runtime.lora_io import LoraWeights, save_adapter
from worker.vllm_runtime import inplace, inplace_merged, memory_share, merge, translate
from worker.vllm_runtime.shared_base import SharedBase

log = logging.getLogger(__name__)


def configure_environment(config: RuntimeConfig) -> None:
    """vLLM reads these when an engine is built; an operator's own settings win."""
    # In-process engine: tensors pass straight into collective_rpc, and the worker supervises one process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{config.vllm_cpu_kv_cache_gib:g}")
    # On CPU vLLM would pin torch to one core and cut torch's threads, starving the trainer beside it.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


class VllmEngine(Engine):
    def __init__(self, config: RuntimeConfig, catalog: BaseModelCatalog | None = None,
                 trainer_need: memory_share.TrainerNeed | None = None,
                 trainer_model: Callable[[str], torch.nn.Module] | None = None) -> None:
        """`trainer_need`: the trainer's measured need for a base, beside the engine on its GPU (memory_share.py).
        `trainer_model`: the trainer's model of a base (loaded if need be), in this process: its base weights become
        views of the engine's (shared_base.py, TINKERQ_VLLM_SHARE_BASE)."""
        configure_environment(config)
        self.catalog = catalog or BaseModelCatalog.from_env()
        from worker.vllm_runtime import patches

        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.merged = config.vllm_sync == "merged"
        # in place writes the engine's tensors from this process: a tensor-parallel engine's live in its workers'
        self.inplace = config.vllm_inplace_sync and config.vllm_tensor_parallel_size == 1
        if self.device.type == "cuda" and self.dtype == torch.float32 and not self.merged:
            raise ValueError("vLLM's GPU LoRA kernels take float16 or bfloat16 weights only: set TINKERQ_DTYPE="
                             "bfloat16 (or auto), or TINKERQ_VLLM_SYNC=merged to serve float32 without LoRA")
        patches.apply(on_cpu=self.device.type == "cpu")
        self.config = config
        self.llms: dict[str, Any] = {}
        self.base_of: dict[str, str] = {}
        # model -> version -> its vllm LoRARequest, or None where the base weights serve it (merged, untrained)
        self.snapshots: dict[str, OrderedDict[int, Any | None]] = {}
        # model -> version -> the weights each live snapshot was made from, for durable checkpoints
        self.weights: dict[str, dict[int, LoraWeights]] = {}
        self._request_ids = itertools.count()
        self.owner: dict[str, str] = {}  # merged mode: base -> the one model it serves
        self.base_weights: dict[str, dict[str, torch.Tensor]] = {}
        self._lora_ids = itertools.count(1)  # never reused: vLLM caches adapters and prefixes by id
        self._adapters = tempfile.TemporaryDirectory(prefix="tinkerq-vllm-", dir=_fast_tmp())
        # base -> its in-place writer, or None where the engine's layout is not understood (file / reload path)
        self.slots: dict[str, inplace.LoraSlots | None] = {}
        self.writers: dict[str, inplace_merged.MergedWriter | None] = {}
        # merged mode: base -> how many times its engine's weights changed. Requests carry it as vLLM's cache_salt
        # (part of every prefix-cache key), so KV cached on older weights is never hit again, with no reset
        # (vLLM's reset_prefix_cache walks every KV block in Python: a cost that grows with the cache, at every sync).
        self.epochs: dict[str, int] = {}
        # TINKERQ_VLLM_GPU_MEMORY_UTILIZATION=auto measures the trainer beside it (memory_share.py)
        self.trainer_need = trainer_need
        self.memory_plans: dict[str, memory_share.MemoryPlan] = {}
        # sleep mode (GPU only): asleep from a trainer's forward pass (make_room) to the engine's next call
        self.sleep_mode = config.vllm_sleep_during_training and self.device.type == "cuda"
        self.asleep = False
        self.trainer_model = trainer_model

    # -- models and snapshots -------------------------------------------------------------------

    def check_create(self, request: CreateModelRequest) -> None:
        self._check_new_base(request.base_model)
        lora = request.lora
        if lora is None:
            return
        if not self.merged and lora.rank > self.config.vllm_max_lora_rank:
            raise DomainError(400, "lora_rank_too_large", f"LoRA rank {lora.rank} exceeds the vLLM engine's "
                              f"max_lora_rank {self.config.vllm_max_lora_rank} (TINKERQ_VLLM_MAX_LORA_RANK)")
        if self.merged and request.base_model in self.owner:
            raise DomainError(409, "base_in_use", f"the vLLM engine merges weights into {request.base_model!r}, "
                              f"which already serves {self.owner[request.base_model]!r}; use vllm_sync=lora "
                              "to serve several models on one base")
        if self.merged and lora.train_unembed and merge.ties_embeddings(self._path(request.base_model)):
            raise DomainError(400, "unsupported", f"{request.base_model!r} ties its embeddings, so a merged "
                              "lm_head adapter cannot be served; use train_unembed=false or vllm_sync=lora")

    def add_model(self, model_id: str, base_model: str, weights: LoraWeights, version: int = 0) -> None:
        self._wake()
        self.remove_model(model_id)
        self._llm(base_model)
        self.base_of[model_id] = base_model
        self.snapshots[model_id] = OrderedDict()
        self.weights[model_id] = {}
        if self.merged:
            self.owner[base_model] = model_id
        self.apply_weights(model_id, version, weights)

    def apply_weights(self, model_id: str, version: int, weights: LoraWeights) -> None:
        self._wake()
        held = self.snapshots[model_id]
        if self.merged:
            self._reload(self.base_of[model_id], weights)
            held.clear()  # the old weights are gone from the engine: older versions answer snapshot_evicted
            held[version] = None
            self.weights[model_id] = {version: weights}
            return
        self.restore_snapshot(model_id, version, weights)
        while len(held) > self.config.max_snapshots:
            evicted, lora = held.popitem(last=False)
            self.weights[model_id].pop(evicted, None)
            self._drop(model_id, lora)

    def restore_snapshot(self, model_id: str, version: int, weights: LoraWeights) -> bool:
        if self.merged:
            return False  # the engine holds one model's latest merged weights only
        self._wake()
        lora = None if _is_identity(weights) else self._add_adapter(model_id, version, weights)
        self.snapshots[model_id][version] = lora  # an untrained adapter is served as the base model itself
        # The in-place path keeps these tensors for vLLM already (a slot's re-activation): holding them costs nothing.
        self.weights[model_id][version] = weights
        return True

    def snapshot_weights(self, model_id: str, version: int) -> LoraWeights | None:
        return self.weights.get(model_id, {}).get(version)

    def live_versions(self, model_id: str) -> list[int]:
        return list(self.snapshots.get(model_id, ()))

    def warm(self, base_model: str) -> None:
        if base_model in self.llms:
            return
        self._llm(base_model)  # vLLM's engine: its weights, KV cache and (on a GPU) memory share and CUDA graphs
        # vLLM's first step after its start sets up what it builds lazily (most of the first sample's time, LoRA's
        # kernels among it): one token of the bare base pays that here, before any model is served
        probe = SampleRequest(model_id=base_model_id(base_model), base_model=base_model, prompt_tokens=[0],
                              weights_version=0, sampling_params=SamplingParams(max_tokens=1))
        result = self.generate([probe])[0]
        if isinstance(result, ErrorResponse):
            raise RuntimeError(f"the first sample of {base_model!r} failed: {result.error}")

    def check_base(self, base_model: str) -> None:
        """The bare base is served with no adapter (batched with adapter samples); in merged mode its engine
        holds a model's merged weights instead, once one exists."""
        if self.merged and base_model in self.owner:
            raise DomainError(409, "base_in_use", f"the vLLM engine of {base_model!r} serves the merged weights of "
                              f"{self.owner[base_model]!r} (vllm_sync=merged), not the bare base; use vllm_sync=lora "
                              "to sample base and trained models side by side")
        self._llm(base_model)

    def remove_model(self, model_id: str) -> None:
        self._wake()  # vLLM zeroes a removed adapter's slot
        base = self.base_of.pop(model_id, None)
        self.weights.pop(model_id, None)
        for lora in self.snapshots.pop(model_id, {}).values():
            self._drop(model_id, lora)
        if base is not None and self.owner.get(base) == model_id:
            del self.owner[base]

    # -- sleep mode: the trainer borrows the engine's memory ---------------------------------------

    @property
    def sleeps_for_training(self) -> bool:  # type: ignore[override]
        return self.sleep_mode

    def make_room(self) -> None:
        """Sleep mode: before a forward pass of the trainer, vLLM (level 1) copies its weights (LoRA slots included:
        they are allocated with them) to host memory and drops its KV cache and prefix cache, handing that device
        memory back. vLLM keeps the same device addresses for all of it, so CUDA graphs and the in-place writers'
        tensors stay valid after `_wake`. Only while no sample runs: the engine loop drains before the worker takes
        a training op."""
        if self.sleep_mode and not self.asleep and self.llms:
            for llm in self.llms.values():
                llm.sleep(level=1)
            self.asleep = True

    def _wake(self) -> None:
        """Before any call that touches the engine's memory (a sample, a sync, a new or removed model)."""
        if self.asleep:
            torch.cuda.empty_cache()  # the trainer's cached blocks back to the device, for vLLM to map again
            for llm in self.llms.values():
                llm.wake_up()
            self.asleep = False

    def _check_new_base(self, base_model: str) -> None:
        if self.sleep_mode and self.llms and base_model not in self.llms:
            raise DomainError(400, "unsupported", f"this worker runs vLLM in sleep mode (TINKERQ_VLLM_SLEEP_DURING_"
                              f"TRAINING), whose allocator serves one engine a process, and it serves "
                              f"{next(iter(self.llms))!r}: {base_model!r} needs another worker")

    def close(self) -> None:
        for llm in self.llms.values():
            _shutdown(llm)
        self.llms.clear()
        self._adapters.cleanup()

    def _add_adapter(self, model_id: str, version: int, weights: LoraWeights) -> Any:
        from vllm.lora.request import LoRARequest

        base = self.base_of[model_id]
        lora_id = next(self._lora_ids)
        # A fresh name per snapshot too: vLLM keys cached prefixes by the adapter's name and path.
        name = f"{model_id}@{version}#{lora_id}"
        slots = self._slots(base)
        if slots is not None and slots.load(lora_id, weights):
            # Registered in memory; vLLM never reads this path (a lost registration fails loudly on it).
            return LoRARequest(name, lora_id, f"{self._adapters.name}/inplace-{lora_id}")
        directory = Path(self._adapters.name) / f"{lora_id}"
        directory.mkdir()
        save_adapter(weights, directory, self._path(base))
        request = LoRARequest(name, lora_id, str(directory))
        self.llms[base].llm_engine.add_lora(request)  # load now: a bad adapter fails the sync, not a sample
        return request

    def _slots(self, base_model: str) -> inplace.LoraSlots | None:
        if base_model not in self.slots:
            self.slots[base_model] = inplace.LoraSlots.attach(self.llms[base_model]) if self.inplace else None
        return self.slots[base_model]

    def _drop(self, model_id: str, lora: Any | None) -> None:
        if lora is not None:
            llm = self.llms.get(self.base_of.get(model_id, ""))
            if llm is not None:
                llm.llm_engine.remove_lora(lora.lora_int_id)
            shutil.rmtree(lora.lora_path, ignore_errors=True)

    def _reload(self, base_model: str, weights: LoraWeights) -> None:
        llm = self.llms[base_model]
        if base_model not in self.writers:
            # vLLM 0.26's CUDA linear layers read `layer.weight` itself (UnquantizedLinearMethod.apply), so the
            # in-place write is what they serve. A logprob that barely moves after a sync is no sign of stale
            # weights: one optimizer step's change can be close to the noise of merging in bf16.
            self.writers[base_model] = (inplace_merged.MergedWriter.attach(llm, self._base_weights(base_model))
                                        if self.inplace else None)
        writer = self.writers[base_model]
        if writer is None or not writer.write(weights):
            full = merge.merged(self._base_weights(base_model), weights)
            with self._plain_linear():  # the reload re-runs CPU weight packing: keep the weights plain
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(full.items())})
            if writer is not None:
                writer.forget()  # the reload wrote every weight: the writer's record of them is stale
        self.epochs[base_model] = self.epochs.get(base_model, 0) + 1  # cached prefixes hold the old weights' KV

    def _plain_linear(self, shared: bool = False) -> Any:
        """CPU vLLM packs linear weights into kernel-private copies; merged mode writes them in place, and a trainer
        sharing the base reads them."""
        from worker.vllm_runtime import patches

        return patches.cpu_plain_linear(((self.merged and self.inplace) or shared) and self.device.type == "cpu")

    def _base_weights(self, base_model: str) -> dict[str, torch.Tensor]:
        if base_model not in self.base_weights:
            weights = merge.load_base(self._path(base_model))
            # in the engine's dtype: the in-place writer merges into its parameters without a cast
            self.base_weights[base_model] = {k: v.to(self.device, self.dtype) for k, v in weights.items()}
        return self.base_weights[base_model]

    def _llm(self, base_model: str) -> Any:
        if base_model not in self.llms:
            self._check_new_base(base_model)
            self._wake()
            self.llms[base_model] = self._build(base_model)
        return self.llms[base_model]

    def _build(self, base_model: str) -> Any:
        shared = self._shared_base(base_model)
        try:
            llm = self._start(base_model, shared)
        except BaseException:
            if shared is not None:
                shared.restore()  # the trainer's copy back on the device, as it was
            raise
        if shared is not None:
            self._lend(base_model, shared, llm)
        if base_model in self.memory_plans:
            free, _ = memory_share.cuda_mem_info(self.device)
            log.log(*memory_share.after_start(self.memory_plans[base_model], free))
        return llm

    def _start(self, base_model: str, shared: SharedBase | None) -> Any:
        from vllm import LLM

        path = self._path(base_model)
        kwargs: dict[str, Any] = dict(model=str(path), dtype=str(self.dtype).removeprefix("torch."), seed=0,
                                      enforce_eager=self._eager(), enable_prefix_caching=True)
        if self.device.type == "cuda":
            kwargs["gpu_memory_utilization"] = self._share(base_model, shared)
            if self.sleep_mode:
                kwargs["enable_sleep_mode"] = True
        if self.config.vllm_tensor_parallel_size > 1:
            # the workers run in processes of their own (syncs take vLLM's own paths), where patches.py is applied too
            kwargs.update(tensor_parallel_size=self.config.vllm_tensor_parallel_size, distributed_executor_backend="mp",
                          worker_extension_cls="worker.vllm_runtime.worker_patches.PatchedWorker")
        if not self.merged:
            # max_cpu_loras: snapshots registered beyond the slots stay servable (re-activated on demand)
            kwargs.update(enable_lora=True, max_loras=self.config.vllm_max_loras,
                          max_lora_rank=self.config.vllm_max_lora_rank,
                          max_cpu_loras=max(1024, self.config.vllm_max_loras))
        if shared is not None:
            shared.park()  # (done already where the share was measured) its memory is the engine's to plan with
        with self._plain_linear(shared=shared is not None):
            return LLM(**kwargs)

    def _lend(self, base_model: str, shared: SharedBase, llm: Any) -> None:
        try:
            shared.lend(llm)
        except (AttributeError, KeyError, ValueError) as exc:
            _shutdown(llm)
            shared.restore()
            raise RuntimeError(f"the trainer cannot read {base_model!r} from the vLLM engine's weights ({exc}): "
                               "set TINKERQ_VLLM_SHARE_BASE=false to give each its own copy") from exc
        log.info("the trainer reads %s from the vLLM engine's weights: %.3g GiB held once, not twice", base_model,
                 shared.nbytes / memory_share.GIB)

    def _shared_base(self, base_model: str) -> SharedBase | None:
        """The trainer's base parameters where they can be the engine's (shared_base.py), else None."""
        refusal = self.share_refusal()
        if refusal is not None:
            log.info("the trainer keeps its own copy of %s: %s", base_model, refusal)
            return None
        return SharedBase(self.trainer_model(base_model), self.device)

    def share_refusal(self) -> str | None:
        """Why the trainer's base cannot be the engine's here; None where it can."""
        if not self.config.vllm_share_base:
            return "TINKERQ_VLLM_SHARE_BASE=false"
        if self.trainer_model is None:
            return "no trainer in this process"
        if self.merged:
            return "merged sync writes the engine's base"
        if self.sleep_mode:
            return "sleep mode moves the engine's weights to host memory while the trainer runs"
        if self.config.vllm_tensor_parallel_size > 1:
            return "tensor parallelism holds the engine's weights in other processes"
        return None

    def _share(self, base_model: str, shared: SharedBase | None = None) -> float:
        """vLLM's gpu_memory_utilization for the engine of `base_model` (memory_share.py). `shared`: the trainer's
        copy of the base, which leaves the device once the trainer's peak is measured."""
        setting = self.config.vllm_gpu_memory_utilization
        if setting != "auto":
            return setting
        if self.trainer_need is None:
            log.info("vLLM memory share for %s: %g (auto, with no trainer beside it to measure)", base_model,
                     memory_share.NO_TRAINER_SHARE)
            return memory_share.NO_TRAINER_SHARE
        reserved = max((plan.trainer_peak for plan in self.memory_plans.values()), default=0)

        def mem_info() -> tuple[int, int]:
            if shared is not None:
                shared.park()  # after the measure: the memory the engine's copy will serve both from
            return memory_share.cuda_mem_info(self.device)

        plan = memory_share.measured_share(base_model, lambda: self.trainer_need(base_model), mem_info,
                                           int(self.config.vllm_memory_margin_gib * memory_share.GIB), reserved)
        self.memory_plans[base_model] = plan
        return plan.utilization

    def _path(self, base_model: str) -> Path:
        return base_path(self.catalog, base_model)

    def _eager(self) -> bool:
        if self.config.vllm_enforce_eager is not None:
            return self.config.vllm_enforce_eager
        return self.device.type != "cuda"  # CUDA graphs, checked to serve each sync's weights: vllm_sync_check.py

    # -- sampling -------------------------------------------------------------------------------

    def generate(self, requests: list[SampleRequest]) -> list[SampleOutput | ErrorResponse]:
        return in_order(self.generate_stream, requests)

    def generate_stream(self, items: Keyed, done: Done, admit: Admit | None = None) -> None:
        """One engine loop per call key; requests `admit` finds for the same key join it between steps."""
        self._wake()
        calls: dict[tuple, Keyed] = defaultdict(list)
        for key, request in items:
            calls[self._call_key(request)].append((key, request))
        for call_key, group in calls.items():
            self._run(call_key, group, done, admit)

    def _run(self, call_key: tuple, items: Keyed, done: Done, admit: Admit | None) -> None:
        from vllm.sampling_params import RequestOutputKind

        engine = self.llms[call_key[0]].llm_engine
        waiting: dict[str, tuple[SampleRequest, list[Any]]] = {}  # key -> request, its finished outputs
        owners: dict[str, tuple[str, int]] = {}  # vLLM request id -> (key, sample index)
        in_vllm, outside = _Stopwatch(), _Stopwatch()  # where a run's time goes, logged at its end
        run_requests = 0  # vLLM requests, for that log line

        def add(admitted: Keyed) -> None:
            nonlocal run_requests
            for key, request, samples in servable(admitted, done, self._checked_params):
                lora = None if request.base_model else self.snapshots[request.model_id][request.weights_version]
                added = []
                try:
                    for k, params in enumerate(samples):
                        params.output_kind = RequestOutputKind.FINAL_ONLY
                        added.append(f"tq-{next(self._request_ids)}")
                        owners[added[-1]] = (key, k)
                        engine.add_request(added[-1], self._prompt(call_key[0], request), params,
                                           lora_request=lora)
                except (ValueError, _client_error()) as exc:
                    engine.abort_request(added)
                    for vllm_id in added:
                        del owners[vllm_id]
                    done(key, DomainError(400, "unsupported_request", f"the vLLM engine refuses it: {exc}").response())
                    continue
                waiting[key] = (request, [None] * len(samples))
                run_requests += len(samples)

        def same_call(request: SampleRequest) -> bool:
            known = request.base_model is not None or request.model_id in self.base_of
            return known and self._call_key(request) == call_key

        with outside:
            add(items)
        try:  # what else the process did meanwhile tells a run slowed here from one slowed outside the worker
            with Activity() as activity:
                while engine.has_unfinished_requests():
                    with in_vllm:
                        outputs = engine.step()
                    with outside:
                        for output in outputs:
                            if output.finished:
                                self._collect(owners.pop(output.request_id), output, waiting, done)
                        if admit is not None:
                            add(admit(same_call))
        except BaseException:
            engine.abort_request(list(owners))  # nothing of this run may outlive it
            raise
        log.info("engine run: %d vLLM requests in %d steps, %.1f ms in vLLM's steps, %.1f ms outside them (adding "
                 "requests, results, admission); meanwhile %s", run_requests, in_vllm.count, in_vllm.ms, outside.ms,
                 activity.describe())

    def _prompt(self, base_model: str, request: SampleRequest) -> dict[str, Any]:
        prompt: dict[str, Any] = {"prompt_token_ids": request.prompt_tokens}
        epoch = self.epochs.get(base_model, 0)
        if epoch:  # merged weights of sync `epoch`: prefixes cached before it are not theirs
            prompt["cache_salt"] = f"tinkerq-weights-{epoch}"
        return prompt

    @staticmethod
    def _collect(owner: tuple[str, int], output: Any, waiting: dict, done: Done) -> None:
        key, k = owner
        request, outputs = waiting[key]
        outputs[k] = output
        if all(o is not None for o in outputs):
            del waiting[key]
            done(key, translate.output(request, outputs))

    def _checked_params(self, request: SampleRequest) -> list[Any]:
        self._check(request)
        return self._params(request)

    @staticmethod
    def _params(request: SampleRequest) -> list[Any]:
        """vLLM's SamplingParams, one per sample; what vLLM refuses (temperature > 2, ...) is a 400."""
        from vllm import SamplingParams

        try:
            return [SamplingParams(**translate.sampling_params(request, k)) for k in range(request.num_samples)]
        except (ValueError, _client_error()) as exc:
            raise DomainError(400, "unsupported_sampling_params", f"the vLLM engine refuses this request: {exc}") \
                from exc

    def _call_key(self, request: SampleRequest) -> tuple:
        """One engine call per base; prompt-logprob requests of an adapter get a call of their own, since
        vLLM maps an lm_head adapter per request, not per prompt row (see patches._prompt_logits_lora)."""
        base = self._base_name(request)
        if translate.wants_prompt_scores(request) and not self.merged:
            return base, request.model_id, request.weights_version
        return (base,)

    def _base_name(self, request: SampleRequest) -> str:
        return request.base_model or self.base_of[request.model_id]

    def _check(self, request: SampleRequest) -> None:
        model_config = self.llms[self._base_name(request)].llm_engine.model_config
        check_fits(request, model_config.max_model_len, model_config.get_vocab_size())


def _shutdown(llm: Any) -> None:
    # LLM.shutdown exists in some releases only; the engine core's is in all of them.
    (getattr(llm, "shutdown", None) or llm.llm_engine.engine_core.shutdown)()


def _client_error() -> type[Exception]:
    """vLLM's class for "the request is wrong" (newer releases; older ones raise ValueError)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return ValueError
    return VLLMClientError


class _Stopwatch:
    """Time spent inside `with` blocks, summed, and how many there were."""

    def __init__(self) -> None:
        self.ms, self.count, self._start = 0.0, 0, 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *_: object) -> None:
        self.ms += (time.perf_counter() - self._start) * 1000
        self.count += 1


def _is_identity(weights: LoraWeights) -> bool:
    """A fresh adapter (every B zero) changes nothing; serving the base skips the LoRA cost per token."""
    return all(not bool(t.any()) for key, t in weights.tensors.items() if ".lora_B." in key)


def _fast_tmp() -> str | None:
    """Adapters go through files (vLLM loads LoRA from a path): keep them in memory where possible."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
