"""What a sampler records for stable_reinforce (record_stability_info): per sampled sequence its tokens and
the engine's own logprobs, per request its prompt, kept a day (Tinker: "can be trained on for one day after
sampling"; each training request that uses a sequence restarts that day, which the API does when it reads)."""

import json

from redis import Redis

from schemas import RecordedSequence, SampleOutput, SampleRequest
from tinkerq import keys
from worker.shards.fencing import Fence

# KEYS: (lease), record. ARGV: (token), ttl, then field, value pairs.
_RECORD = """
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""


class StabilityRecords:
    def __init__(self, connection: Redis, fence: Fence, ttl_s: int) -> None:
        self.connection = connection
        self.ttl_s = ttl_s
        self._record = fence.script(_RECORD)

    def record(self, shard: int, request: SampleRequest, output: SampleOutput) -> None:
        """Written before the result is stored, so a client that has the result can always train on it."""
        if not request.record_as:
            return
        key, _ = keys.stability_key(request.record_as[0])
        fields = {"prompt": json.dumps(request.prompt_tokens)}
        for sequence_id, sequence in zip(request.record_as, output.sequences, strict=True):
            fields[keys.stability_key(sequence_id)[1]] = RecordedSequence(
                tokens=sequence.tokens, logprobs=sequence.logprobs).model_dump_json()
        self._record(shard, [key], [self.ttl_s, *(x for pair in fields.items() for x in pair)],
                     f"the stability record {key}")
