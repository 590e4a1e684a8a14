"""`tinkerq worker --shards auto`: workers split the shards evenly and rebalance as they join, die and leave,
with real worker processes on a real Redis, while a training program and its samples keep being served."""

import signal
import threading
import time
from collections import Counter

from producer import Producer
from schemas import ErrorResponse, SampleOutput, SampleRequest, SamplingParams
from support.stack import wait_until
from support.training import answered, training
from tinkerq import keys
from worker.shards.membership import fair_share


def owners(r, config) -> dict[int, str | None]:
    """Each shard's lease holder (a lease's token is `<worker name>:<epoch>`)."""
    tokens = {s: r.get(keys.lease_key(s)) for s in range(config.num_shards)}
    return {s: t.decode().rsplit(":", 1)[0] if t else None for s, t in tokens.items()}


def split(r, config) -> list[int]:
    """How many shards each worker holds, largest first; [] while any shard is unowned."""
    held = owners(r, config)
    return [] if None in held.values() else sorted(Counter(held.values()).values(), reverse=True)


def settle(r, config, expected: list[int], what: str, workers: list) -> None:
    try:
        wait_until(lambda: split(r, config) == expected, 60, what)
    except AssertionError as exc:  # say where it stood, and what the workers logged
        members = [m.decode() for m in r.zrange(keys.WORKERS_KEY, 0, -1)]
        logs = "\n".join(w.output()[-4000:] for w in workers)
        raise AssertionError(f"{exc}: owners {owners(r, config)}, members {members}\n{logs}") from None


def feed(producer: Producer, models: list[str], stop: threading.Event, tickets: list) -> None:
    while not stop.is_set():
        for model in models:
            request = SampleRequest(model_id=model, prompt_tokens=[1, 2], sampling_params=SamplingParams(max_tokens=4))
            tickets.append((request, producer.submit(request)))
        stop.wait(0.05)


def test_fair_shares_add_up_to_every_shard_and_differ_by_at_most_one():
    for shards in (1, 4, 7, 16):
        for n in range(1, 6):
            members = [f"w{i}" for i in range(n)]
            shares = [fair_share(shards, members, m) for m in members]
            assert sum(shares) == shards and max(shares) - min(shares) <= 1, (shards, n, shares)
    assert fair_share(4, ["a", "b"], "c") == 2  # not yet listed: as if last


def test_auto_workers_split_the_shards_and_rebalance_as_they_join_die_and_leave(r, config, start_worker):
    producer = Producer(r, config)
    slow = {"TINKERQ_REFERENCE_DELAY_PER_TOKEN_S": "0.05"}  # 0.2 s a batch: the kill lands mid-batch
    first = start_worker("--shards", "auto", "--log-level", "INFO", **slow)
    settle(r, config, [4], "the first worker holding every shard", [first])
    programs = {f"bal{i}:train:0": training(f"bal{i}:train:0", 4) for i in range(4)}
    tickets = [(op, producer.submit(op)) for ops in programs.values() for op in ops[:6]]

    second = start_worker("--shards", "auto", "--log-level", "INFO", **slow)
    settle(r, config, [2, 2], "two workers holding two shards each", [first, second])
    third = start_worker("--shards", "auto", "--log-level", "INFO", **slow)
    settle(r, config, [2, 1, 1], "three workers holding 2, 1 and 1 shards", [first, second, third])
    tickets += [(op, producer.submit(op)) for ops in programs.values() for op in ops[6:12]]

    # samples of every model stream in while the first worker is SIGKILLed mid-batch; its leases and its heartbeat
    # lapse together, and the other two share its shards
    stream: list = []
    stop = threading.Event()
    feeder = threading.Thread(target=feed, args=(producer, list(programs), stop, stream), daemon=True)
    feeder.start()
    wait_until(lambda: len(stream) >= 40, 30, "samples streaming")
    first.kill(signal.SIGKILL)
    settle(r, config, [2, 2], "the two survivors holding two shards each", [second, third])
    stop.set()
    feeder.join(10)
    served = answered(producer, stream, 120)
    # every sample of the stream answered once, from the very snapshot it was pinned to (the reference runtime's
    # tokens are the version that served them)
    wrong = [(ticket.request_id, ticket.version, out) for (_, ticket), out in zip(stream, served)
             if not (isinstance(out, SampleOutput) and out.weights_version == ticket.version
                     and {t for s in out.sequences for t in s.tokens} == {ticket.version})]
    assert not wrong, (f"{len(wrong)} of {len(served)} samples not served on their pinned version "
                       f"(request, pinned, result): {wrong[:5]}\n"
                       + "\n".join(w.output()[-3000:] for w in (second, third)))
    second.kill(signal.SIGTERM)  # a clean stop releases its shards at once
    assert second.proc.returncode == 0, second.output()
    settle(r, config, [4], "the last worker holding every shard", [third])
    tickets += [(op, producer.submit(op)) for ops in programs.values() for op in ops[12:]]

    outs = answered(producer, tickets, 120)
    assert not [out for out in outs if isinstance(out, ErrorResponse)], outs
    assert third.alive(), third.output()
    assert set(owners(r, config).values()) == {r.zrange(keys.WORKERS_KEY, 0, -1)[0].decode()}
    # the worker that took every freed shard stops cleanly too, and at once (it used to exit 1 or keep running)
    started = time.monotonic()
    third.kill(signal.SIGTERM, timeout_s=10)
    assert third.proc.returncode == 0 and time.monotonic() - started < 10, third.output()
