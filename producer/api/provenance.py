"""stable_reinforce datums name the sampled sequence behind each target position (provenance spans); this
resolves them, against what the sampler recorded, into the two per-token inputs the loss reads: which targets
were sampled, and the sampler's own logprob of each. The queued datum is then self-contained."""

import json

from redis.asyncio import Redis
from tinker.proto import tinker_public_pb2 as pb

from producer.api.errors import ApiError
from schemas import Datum, RecordedSequence
from schemas.requests import STABLE_LOGPROBS, STABLE_MASK
from tinkerq import keys


def _bad(index: int, message: str) -> ApiError:
    return ApiError(400, f"data[{index}]: {message}", "invalid_provenance")


async def resolve(redis: Redis, message: pb.ForwardBackwardRequest, data: list[Datum], ttl_s: int) -> list[Datum]:
    """`data` with STABLE_MASK and STABLE_LOGPROBS filled from each datum's `loss_fn_input_spans`; each record
    read is kept `ttl_s` more ("each training request that uses a sequence restarts that day")."""
    session = message.model_id.split(":", 1)[0]
    spans = [list(d.loss_fn_input_spans) for d in message.data]
    for index, datum_spans in enumerate(spans):
        if not datum_spans:
            raise _bad(index, "stable_reinforce needs loss_fn_input_spans naming the sampled sequence behind every "
                       "target (Datum.with_provenance), sampled with record_stability_info")
    records = await _records(redis, {_run(span)[0] for datum_spans in spans for span in datum_spans}, ttl_s)
    return [_resolved(index, datum, datum_spans, records, session)
            for index, (datum, datum_spans) in enumerate(zip(data, spans, strict=True))]


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


def _resolved(index: int, datum: Datum, spans: list, records: dict, session: str) -> Datum:
    targets = [int(t) for t in datum.loss_fn_inputs.get("target_tokens", [])]
    mask, sampler = [0.0] * len(targets), [0.0] * len(targets)
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
        if offset < 0 or length < 0 or offset + length > len(source) or position + length > len(targets):
            raise _bad(index, f"span {kind}({sequence_id!r}, offset={offset}, length={length}) runs past the "
                       f"sequence ({len(source)}) or the targets ({len(targets)})")
        if source[offset:offset + length] != targets[position:position + length]:
            raise _bad(index, f"targets {position}..{position + length} are not the tokens of {kind} "
                       f"{offset}..{offset + length} of {sequence_id!r}")
        if kind == "sampled_tokens":
            mask[position:position + length] = [1.0] * length
            sampler[position:position + length] = sequence.logprobs[offset:offset + length]
        position += length
    if position != len(targets):
        raise _bad(index, f"loss_fn_input_spans cover {position} of {len(targets)} targets; they must tile them")
    inputs = {**datum.loss_fn_inputs, STABLE_MASK: mask, STABLE_LOGPROBS: sampler}
    return Datum(model_input=datum.model_input, loss_fn_inputs=inputs)
