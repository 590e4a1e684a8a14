"""The PyTorch sampling engine: LoRA snapshots by version, batched generation across models."""

import secrets
from collections import OrderedDict, defaultdict

from schemas import ErrorResponse, GeneratedSequence, SampleOutput, SampleRequest, TopkLogprobs
from worker.runtime.base import Admit, Done, Engine, Keyed, check_fits, in_order, servable
from worker.torch_runtime.base_models import BASE_ADAPTER, BaseModels, LoadedBase, adapter_name
from worker.torch_runtime.lora_io import LoraWeights, export_adapter, import_adapter
from worker.torch_runtime.sampler import Row, Sampler


class TorchEngine(Engine):
    def __init__(self, bases: BaseModels, max_snapshots: int = 4) -> None:
        self.bases = bases
        self.max_snapshots = max_snapshots
        self.snapshots: dict[str, OrderedDict[int, str]] = {}
        self.base_of: dict[str, LoadedBase] = {}
        # model -> version -> the weights each live snapshot was made from (never changed after: the trainer exports
        # a copy), handed to a durable checkpoint as they are instead of read back out of peft's adapter each time
        self.weights: dict[str, dict[int, LoraWeights]] = {}

    def add_model(self, model_id: str, base_model: str, weights: LoraWeights, version: int = 0) -> None:
        self.remove_model(model_id)
        self.base_of[model_id] = self.bases.get(base_model)
        self.snapshots[model_id] = OrderedDict()
        self.weights[model_id] = {}
        self.apply_weights(model_id, version, weights)

    def apply_weights(self, model_id: str, version: int, weights: LoraWeights) -> None:
        self.restore_snapshot(model_id, version, weights)
        base, held = self.base_of[model_id], self.snapshots[model_id]
        while len(held) > self.max_snapshots:
            version_out, evicted = held.popitem(last=False)
            self.weights[model_id].pop(version_out, None)
            base.delete_adapter(evicted)

    def restore_snapshot(self, model_id: str, version: int, weights: LoraWeights) -> bool:
        name = adapter_name(model_id, version)
        import_adapter(self.base_of[model_id], name, weights)  # a copy: later training steps do not reach it
        self.snapshots[model_id][version] = name
        self.weights[model_id][version] = weights
        return True

    def snapshot_weights(self, model_id: str, version: int) -> LoraWeights:
        kept = self.weights.get(model_id, {}).get(version)
        return kept if kept is not None else export_adapter(self.base_of[model_id], self.snapshots[model_id][version])

    def live_versions(self, model_id: str) -> list[int]:
        return list(self.snapshots.get(model_id, ()))

    def remove_model(self, model_id: str) -> None:
        base = self.base_of.pop(model_id, None)
        self.weights.pop(model_id, None)
        for name in self.snapshots.pop(model_id, {}).values():
            base.delete_adapter(name)

    def warm(self, base_model: str) -> None:
        self.bases.get(base_model)  # the trainer's base is this engine's too

    def check_base(self, base_model: str) -> None:
        self.bases.get(base_model)  # loads it; DomainError for a base this deployment does not serve

    def _base(self, request: SampleRequest, load: bool = True) -> LoadedBase | None:
        """The base a request samples: its model's, or the bare base it names (loaded unless `load` is off)."""
        if request.base_model is None:
            return self.base_of.get(request.model_id)
        return self.bases.get(request.base_model) if load else self.bases.loaded(request.base_model)

    def generate(self, requests: list[SampleRequest]) -> list[SampleOutput | ErrorResponse]:
        return in_order(self.generate_stream, requests)

    def generate_stream(self, items: Keyed, done: Done, admit: Admit | None = None) -> None:
        """One continuous batch per base model: requests for that base that `admit` finds while it decodes
        join it between steps, and each request's output goes to `done` as soon as its rows are finished."""
        groups: dict[str, Keyed] = defaultdict(list)
        for key, request in items:
            groups[self._base(request).name].append((key, request))
        for group in groups.values():
            self._run(self._base(group[0][1]), group, done, admit)

    def _run(self, base: LoadedBase, items: Keyed, done: Done, admit: Admit | None) -> None:
        running: dict[str, tuple[SampleRequest, list[Row]]] = {}

        def rows_of(admitted: Keyed) -> list[Row]:
            rows = []
            for key, request, _ in servable(admitted, done, self._check):
                mine = self._rows(key, request)
                running[key] = (request, mine)
                rows += mine
            return rows

        def finished(rows: list[Row]) -> None:
            for key in dict.fromkeys(row.owner for row in rows):
                request, mine = running[key]
                if all(row.stop_reason is not None for row in mine):
                    del running[key]
                    done(key, self._output(request, mine))

        def more() -> list[Row]:
            return rows_of(admit(lambda request: self._base(request, load=False) is base)) if admit else []

        rows = rows_of(items)
        if rows:
            Sampler(base.model, base.tokenizer, base.device).run(rows, more, finished)

    def _check(self, request: SampleRequest) -> None:
        base = self._base(request)
        check_fits(request, base.model.config.max_position_embeddings, base.vocab_size)

    def _rows(self, key: str, request: SampleRequest) -> list[Row]:
        seed = request.sampling_params.seed
        if seed is None:
            seed = secrets.randbits(62)
        adapter = BASE_ADAPTER if request.base_model else self.snapshots[request.model_id][request.weights_version]
        want_scores = request.prompt_logprobs or request.topk_prompt_logprobs > 0
        # sample k of a seeded request always gets seed + k; the prompt is scored once, on the first
        return [Row(request.prompt_tokens, adapter, request.sampling_params, seed + k, owner=key,
                    want_prompt_scores=want_scores and k == 0, topk=request.topk_prompt_logprobs)
                for k in range(request.num_samples)]

    @staticmethod
    def _output(request: SampleRequest, rows: list[Row]) -> SampleOutput:
        scores = rows[0].scores
        sequences = [GeneratedSequence(tokens=r.tokens, logprobs=r.logprobs, stop_reason=r.stop_reason) for r in rows]
        topk = None
        if scores is not None and request.topk_prompt_logprobs:
            k = request.topk_prompt_logprobs
            topk = TopkLogprobs(token_ids=[ids[:k] for ids in scores.topk_ids],
                                logprobs=[lps[:k] for lps in scores.topk_logprobs])
        return SampleOutput(
            sequences=sequences,
            prompt_logprobs=scores.logprobs if scores is not None and request.prompt_logprobs else None,
            topk_prompt_logprobs=topk,
            weights_version=request.weights_version,
        )
