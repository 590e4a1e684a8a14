"""Warm the base models a worker may have to serve while it owns no shard (TINKERQ_PRELOAD_BASES).

A standby that takes over a dead owner's shard serves its models at once, so whatever it would start lazily on the
first request (the trainer's base model, vLLM's engine for it: seconds on a CPU, longer with CUDA graphs on a GPU)
lands in the takeover's latency. Warming them while it waits moves that cost to before the owner dies.

Which bases: the names the setting lists, and with `auto` (the default) the bases of the models that were created
or loaded on the shards the worker may take (keys.shard_bases_key, written with each model's info), read again at
each standby tick so a model created after the standby started is covered too.
"""

import logging
import time

from redis import Redis

from tinkerq import keys
from worker.runtime import DomainError, Runtime

log = logging.getLogger(__name__)

AUTO, NONE = "auto", "none"


def parse_setting(setting: str) -> tuple[list[str], bool]:
    """The named bases, and whether `auto` asks for those of the shards' models too."""
    names = [name.strip() for name in setting.split(",") if name.strip()]
    return [n for n in dict.fromkeys(names) if n not in (AUTO, NONE)], AUTO in names


class Preloader:
    def __init__(self, connection: Redis, runtime: Runtime, setting: str, shards: list[int]) -> None:
        self.connection = connection
        self.runtime = runtime
        self.named, self.auto = parse_setting(setting)
        self.shards = shards
        self.warmed: set[str] = set()
        self.refused: set[str] = set()  # failed once: not tried at every tick again (its first use will say why)

    def wanted(self) -> list[str]:
        """The bases to warm that are not warm yet, named ones first."""
        bases = list(self.named)
        if self.auto and self.shards:
            with self.connection.pipeline(transaction=False) as pipe:
                for shard in self.shards:
                    pipe.hkeys(keys.shard_bases_key(shard))
                for names in pipe.execute():
                    bases += sorted(n.decode() if isinstance(n, bytes) else n for n in names)
        return [b for b in dict.fromkeys(bases) if b not in self.warmed and b not in self.refused]

    def warm(self) -> list[str]:
        """Warm every wanted base not warm yet; the ones warmed now. A named base this deployment does not serve is
        a configuration error (DomainError); one found in Redis that fails is logged and skipped."""
        done = []
        for base in self.wanted():
            started = time.monotonic()
            try:
                self.runtime.warm(base)
            except Exception as exc:  # the standby stays one: a base that fails here fails on use too
                if base in self.named and isinstance(exc, DomainError):
                    raise  # a name the deployment does not serve: the setting is wrong
                log.exception("could not warm base model %s; it starts on first use", base)
                self.refused.add(base)
                continue
            self.warmed.add(base)
            done.append(base)
            log.info("warmed base model %s in %.2f s (trainer and engine), before owning its shards", base,
                     time.monotonic() - started)
        return done
