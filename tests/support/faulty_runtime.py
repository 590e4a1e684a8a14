"""A runtime whose engine misbehaves on cue, for failure-path tests (loaded as `support.faulty_runtime:make`)."""

import time
from pathlib import Path

from tinkerq.config import RuntimeConfig
from worker.runtime import Runtime
from worker.runtime.reference import ReferenceEngine, ReferenceTrainer

EXPLODE = 666  # first prompt token that makes generate() raise
STALL = 777  # first prompt token that makes generate() take 3 s
HALF = 555  # a batch holding a request with this first token serves the others, then raises before any admit


class FaultyEngine(ReferenceEngine):
    def generate_stream(self, items, done, admit=None):
        if not any(request.prompt_tokens[0] == HALF for _, request in items):
            return super().generate_stream(items, done, admit)
        for key, request in items:
            if request.prompt_tokens[0] != HALF:
                done(key, super().generate([request])[0])
        raise RuntimeError("engine exploded mid-batch")

    def generate(self, requests):
        firsts = {r.prompt_tokens[0] for r in requests}
        if EXPLODE in firsts:
            raise RuntimeError("engine exploded")
        if STALL in firsts:
            time.sleep(3)
        return super().generate(requests)


BAD_LEARNING_RATE = 0.666  # an optim_step with this learning rate raises


class SlowCreateTrainer(ReferenceTrainer):
    def create_model(self, request):
        if request.base_model == "stall":
            time.sleep(3)
        return super().create_model(request)

    def optim_step(self, request):
        if request.adam_params.learning_rate == BAD_LEARNING_RATE:
            raise RuntimeError("optimizer exploded")
        return super().optim_step(request)


def make(config: RuntimeConfig) -> Runtime:
    return Runtime(SlowCreateTrainer(Path(config.checkpoint_root)), FaultyEngine(config.max_snapshots))


HOLD_WRITES = "TINKERQ_TEST_HOLD_WRITES"  # a folder: durable checkpoint writes wait while it holds a file `hold`


def held_writes(config: RuntimeConfig) -> Runtime:
    """The torch runtime, whose durable checkpoints are captured as usual but whose writes (on the side thread)
    touch `writing` in the HOLD_WRITES folder, then wait while `hold` is there (at most 120 s): a test can kill the
    worker mid-write (loaded as `support.faulty_runtime:held_writes`)."""
    import os

    from worker.torch_runtime.assembly import make_runtime

    runtime = make_runtime(config)
    folder = Path(os.environ[HOLD_WRITES])
    capture = runtime.trainer.durable_writer

    def durable_writer(model_id, snapshots):
        write = capture(model_id, snapshots)

        def held(name: str) -> str:
            (folder / "writing").touch()
            deadline = time.monotonic() + 120
            while (folder / "hold").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return write(name)

        return held

    runtime.trainer.durable_writer = durable_writer
    return runtime
