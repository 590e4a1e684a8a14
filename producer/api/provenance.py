"""stable_reinforce datums name the sampled sequence behind each target position (provenance spans); this
resolves them, against what the sampler recorded, into the two per-token inputs the loss reads: which targets
were sampled, and the sampler's own logprob of each. The queued datum is then self-contained."""

import json
from collections.abc import Iterator
from dataclasses import dataclass

from redis.asyncio import Redis
from tinker.proto import tinker_public_pb2 as pb

from producer.api.http_errors import ApiError
from schemas import Datum, RecordedSequence
from schemas.requests import STABLE_LOGPROBS, STABLE_MASK
from tinkerq import keys


def _bad(index: int, message: str) -> ApiError:
    return ApiError(400, f"data[{index}]: {message}", "invalid_provenance")


async def resolve(redis: Redis, message: pb.ForwardBackwardRequest, data: list[Datum], ttl_s: int) -> list[Datum]:
    """`data` with STABLE_MASK and STABLE_LOGPROBS filled from each datum's `loss_fn_input_spans`; each record
    read is kept `ttl_s` more ("each training request that uses a sequence restarts that day")."""
    session = message.model_id.split(":", 1)[0]
    spans = [(list(d.model_input_spans), list(d.loss_fn_input_spans)) for d in message.data]
    for index, (_, target_spans) in enumerate(spans):
        if not target_spans:
            raise _bad(index, "stable_reinforce needs loss_fn_input_spans naming the sampled sequence behind every "
                       "target (Datum.with_provenance), sampled with record_stability_info")
    named = {_run(span)[0] for input_spans, target_spans in spans for span in (*input_spans, *target_spans)}
    records = await _records(redis, named, ttl_s)
    return [_resolved(index, datum, input_spans, target_spans, records, session)
            for index, (datum, (input_spans, target_spans)) in enumerate(zip(data, spans, strict=True))]


def _run(span: pb.ProvenanceSpan) -> tuple[str, str, int, int]:
    kind = span.WhichOneof("span")
    run = getattr(span, kind)
    return run.sequence_id, kind, run.offset, run.length


async def _records(redis: Redis, sequence_ids: set[str], ttl_s: int) -> dict[str, tuple[list[int], dict]]:
    """sequence id -> (its request's prompt, its recorded fields)."""
    groups = sorted({keys.stability_key(sid)[0] for sid in sequence_ids})
    async with redis.pipeline(transaction=False) as pipe:
        for group in groups:
            pipe.hgetall(group)
            pipe.expire(group, ttl_s)
        replies = (await pipe.execute())[::2]
    found = {group: reply for group, reply in zip(groups, replies) if reply}
    out = {}
    for sid in sequence_ids:
        group, field = keys.stability_key(sid)
        fields = found.get(group)
        if fields and field.encode() in fields:
            out[sid] = (json.loads(fields[b"prompt"]), json.loads(fields[field.encode()]))
    return out


@dataclass(frozen=True)
class _Span:
    kind: str  # "prompt_tokens" | "sampled_tokens"
    sequence_id: str
    sequence: RecordedSequence
    tokens: list[int]  # what the span says it covers: its run of the request's prompt or of the sampled tokens
    offset: int  # where that run starts in the prompt or the sampled tokens
    position: int  # where it starts in the field the spans tile


def _runs(index: int, spans: list, records: dict, session: str, width: int, field: str) -> Iterator[_Span]:
    """The spans tiling a field of `width` positions, each checked to name a recorded sequence of this session
    and to lie within it."""
    position = 0
    for span in spans:
        sequence_id, kind, offset, length = _run(span)
        if sequence_id.split(":", 1)[0] != session:
            raise _bad(index, f"sequence {sequence_id!r} was sampled in another session; provenance works "
                       "only within one session")
        if sequence_id not in records:
            raise _bad(index, f"no recorded sequence {sequence_id!r}: unknown, expired (kept a day) or not "
                       "sampled with record_stability_info")
        prompt, recorded = records[sequence_id]
        sequence = RecordedSequence.model_validate(recorded)
        source = sequence.tokens if kind == "sampled_tokens" else prompt
        if offset < 0 or length < 0 or offset + length > len(source) or position + length > width:
            raise _bad(index, f"{field} span {kind}({sequence_id!r}, offset={offset}, length={length}) runs past "
                       f"the sequence ({len(source)}) or the {field} ({width})")
        yield _Span(kind, sequence_id, sequence, source[offset:offset + length], offset, position)
        position += length
    if position != width:
        raise _bad(index, f"{field}_spans cover {position} of {width} positions; they must tile them")


def _check(index: int, run: _Span, actual: list[int], field: str) -> None:
    if run.tokens != actual:
        raise _bad(index, f"{field} {run.position}..{run.position + len(actual)} are not the tokens of {run.kind} "
                   f"of {run.sequence_id!r}")


def _resolved(index: int, datum: Datum, input_spans: list, target_spans: list, records: dict,
              session: str) -> Datum:
    tokens = datum.model_input.tolist()
    for run in _runs(index, input_spans, records, session, len(tokens), "model_input"):
        _check(index, run, tokens[run.position:run.position + len(run.tokens)], "model_input")
    targets = [int(t) for t in datum.loss_fn_inputs.get("target_tokens", [])]
    mask, sampler = [0.0] * len(targets), [0.0] * len(targets)
    for run in _runs(index, target_spans, records, session, len(targets), "loss_fn_input"):
        end = run.position + len(run.tokens)
        # Prompt runs of the targets are not compared: no prompt position is trained (its mask stays 0), and
        # tinker-cookbook's rl_loop sends 0 there, as Tinker accepts. The model_input spans cover the prompt.
        if run.kind == "sampled_tokens":
            _check(index, run, targets[run.position:end], "targets")
            mask[run.position:end] = [1.0] * len(run.tokens)
            sampler[run.position:end] = run.sequence.logprobs[run.offset:run.offset + len(run.tokens)]
    inputs = {**datum.loss_fn_inputs, STABLE_MASK: mask, STABLE_LOGPROBS: sampler}
    return Datum(model_input=datum.model_input, loss_fn_inputs=inputs)
