"""Batched generation with a KV cache over rows that may each use a different LoRA adapter.

Reported logprobs are those of the model's own distribution (temperature 1, no top-k/top-p), i.e.
exactly what the trainer's `forward` computes for the same tokens; temperature, top-k and top-p
only shape the distribution tokens are drawn from.
"""

from dataclasses import dataclass, field

import torch

from schemas import SamplingParams


@dataclass
class Row:
    prompt: list[int]
    adapter: str
    params: SamplingParams
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None


@dataclass
class PromptScores:
    logprobs: list[float | None]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]


def _stop_ids(params: SamplingParams, eos_id: int | None) -> set[int]:
    if params.stop == []:
        return set()  # [] means never stop early, not even at EOS
    ids = {eos_id} if eos_id is not None else set()
    if params.stop and isinstance(params.stop[0], int):
        ids |= set(params.stop)
    return ids


def draw(logits: torch.Tensor, rows: list["Row"], generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, all rows at once: temperature, top-k and top-p per row, then the Gumbel-max
    trick with noise from each row's own generator (so a seeded row draws the same tokens in any batch)."""
    width = logits.shape[-1]
    temperature = torch.tensor([r.params.temperature for r in rows], device=logits.device)
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):  # the sort is the costly part
        scaled = scaled.masked_fill(~_nucleus(scaled, rows), float("-inf"))
    noise = torch.stack([torch.rand(width, generator=g, device=logits.device) for g in generators])
    gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
    sampled = torch.argmax(scaled + gumbel, dim=-1)
    return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)


def _nucleus(scaled: torch.Tensor, rows: list["Row"]) -> torch.Tensor:
    """Which tokens each row may draw under its top-k and top-p."""
    width = scaled.shape[-1]
    ranked, order = torch.sort(scaled, dim=-1, descending=True)
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else width for r in rows], device=scaled.device)
    keep_sorted = ranked >= ranked.gather(-1, (top_k.clamp(max=width) - 1)[:, None])
    top_p = torch.tensor([r.params.top_p for r in rows], device=scaled.device)
    probs = torch.softmax(ranked.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    keep_sorted &= probs.cumsum(-1) - probs < top_p[:, None]  # keep the token that crosses p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


class Sampler:
    def __init__(self, model: torch.nn.Module, tokenizer, device: torch.device) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @torch.inference_mode()
    def generate(self, rows: list[Row], topk: int = 0, want_prompt_scores: bool = False) -> list[PromptScores | None]:
        """Fill each row's tokens/logprobs/stop_reason in place; return prompt scores if asked."""
        width = max(len(r.prompt) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row.prompt):] = torch.tensor(row.prompt)  # left padding
            mask[i, width - len(row.prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        adapters = [r.adapter for r in rows]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, adapter_names=adapters,
                         use_cache=True, logits_to_keep=0 if want_prompt_scores else 1)
        scores = self._prompt_scores(rows, out.logits, width, topk) if want_prompt_scores else [None] * len(rows)
        logits = out.logits[:, -1].float()
        cache, last_pos = out.past_key_values, positions[:, -1]
        generators = [torch.Generator(device=self.device).manual_seed(r.seed) for r in rows]
        stops = [_stop_ids(r.params, self.eos_id) for r in rows]
        for step in range(max(r.params.max_tokens for r in rows)):
            next_ids = draw(logits, rows, generators)
            chosen = torch.log_softmax(logits, dim=-1).gather(-1, next_ids[:, None])[:, 0]
            for row, token, logprob, stop_ids in zip(rows, next_ids.tolist(), chosen.tolist(), stops):
                if row.stop_reason is None:
                    self._append(row, token, logprob, stop_ids)
            if all(r.stop_reason is not None for r in rows):
                break
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long, device=self.device)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=next_ids[:, None], attention_mask=mask,
                             position_ids=last_pos[:, None], past_key_values=cache, adapter_names=adapters,
                             use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1].float()
        return scores

    def _append(self, row: Row, token: int, logprob: float, stop_ids: set[int]) -> None:
        row.tokens.append(token)
        row.logprobs.append(logprob)
        if token in stop_ids:
            row.stop_reason = "stop"
        elif row.params.stop and isinstance(row.params.stop[0], str):
            text = self.tokenizer.decode(row.tokens)
            if any(s in text for s in row.params.stop):
                row.stop_reason = "stop"
        if row.stop_reason is None and len(row.tokens) >= row.params.max_tokens:
            row.stop_reason = "length"

    @staticmethod
    def _prompt_scores(rows: list[Row], logits: torch.Tensor, width: int, topk: int) -> list[PromptScores]:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        scores = []
        for i, row in enumerate(rows):
            start = width - len(row.prompt)
            # position j of the prompt is predicted by the logits at j - 1; position 0 has no context
            predicting = logprobs[i, start: width - 1]
            targets = torch.tensor(row.prompt[1:], device=logprobs.device)
            values: list[float | None] = [None] + predicting.gather(-1, targets[:, None])[:, 0].tolist()
            ids, lps = [[]], [[]]
            if topk > 0:
                top = torch.topk(predicting, topk, dim=-1)
                ids += top.indices.tolist()
                lps += top.values.tolist()
            scores.append(PromptScores(values, ids, lps))
        return scores
