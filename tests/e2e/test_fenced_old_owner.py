"""An owner paused (SIGSTOP) until a standby takes its shards, then resumed (SIGCONT), writes nothing of those shards:
every command its connections send after it wakes is watched with MONITOR (its connections carry the worker's
name), and inside its Lua scripts nothing but the lease check runs. The standby's parked seq-gap op and its claims
stay intact, every acknowledged request gets exactly one result, none is RQ FAILED, and SIGTERM then stops the old
owner with status 0 within 10 s. Ops it parked that fell due while it slept (their gap closed, their deadline passed)
are left to the new owner: its woken sweep takes none of them."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from redis import Redis

from producer import Producer
from schemas import Datum, ErrorResponse, ForwardBackwardRequest
from support.load import CONFIG, MODELS, Load, connect, loaded_worker
from support.redis_proc import RedisProc
from support.stack import WorkerProc, stop_within, wait_until
from tinkerq import keys

pytestmark = pytest.mark.slow

WRITES = {"SET", "SETNX", "SETEX", "PSETEX", "DEL", "UNLINK", "EXPIRE", "PEXPIRE", "EXPIREAT", "PERSIST", "HSET",
          "HMSET", "HSETNX", "HDEL", "HINCRBY", "HINCRBYFLOAT", "LPUSH", "RPUSH", "LREM", "LPOP", "RPOP", "LMOVE",
          "BLMOVE", "RPOPLPUSH", "LTRIM", "LSET", "SADD", "SREM", "SMOVE", "ZADD", "ZREM", "ZINCRBY",
          "ZREMRANGEBYSCORE", "XADD", "XTRIM", "XDEL", "INCR", "INCRBY", "DECR", "RENAME", "COPY"}


def own_record(key: str) -> bool:
    """The worker's own registration in RQ (its hash, its place in the worker sets): not a shard's state."""
    return key.startswith("rq:worker:") or key == "rq:workers" or key.startswith("rq:workers:")


class Monitor(threading.Thread):
    """Every command Redis runs, as (server time, client address or 'lua', words), from a connection of its own."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.connection = Redis.from_url(url, socket_timeout=2)
        self.lines: list[tuple[float, str, list[str]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with self.connection.monitor() as monitor:
            while not self.stop.is_set():
                try:
                    event = monitor.next_command()
                except Exception:  # noqa: BLE001 - the read timed out: look at `stop` again
                    continue
                client = "lua" if event.get("client_type") == "lua" else \
                    f"{event['client_address']}:{event['client_port']}"
                self.lines.append((float(event["time"]), client, event["command"]))


def writes_after(lines, since: float, addresses: set[str]) -> list[str]:
    """The writes to anything but its own worker record that `addresses` made after `since`, Lua included."""
    found, caller = [], None
    for at, client, command in lines:
        if client != "lua":
            caller = client
        if at < since or caller not in addresses:
            continue
        words = command.split(" ")
        name = words[0].upper()
        key = words[1] if len(words) > 1 else ""
        if name in WRITES and not own_record(key):
            found.append(f"{client}: {command[:200]}")
    return found


def redis_addresses(pid: int) -> set[str]:
    """The addresses (as Redis's CLIENT LIST and MONITOR give them) of the process's TCP sockets, from /proc: every
    connection of the process, whatever name its client set or did not set."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    with open(f"/proc/{pid}/net/tcp") as table:
        for row in list(table)[1:]:
            fields = row.split()
            if fields[9] in inodes:
                host, port = fields[1].split(":")
                found.add(f"{'.'.join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0))}:{int(port, 16)}")
    return found


class Addresses(threading.Thread):
    """The process's addresses, sampled every 0.1 s: connections it opens and closes meanwhile are in it too."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.found, self.stop = pid, set(), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                self.found |= redis_addresses(self.pid)
            except OSError:
                return  # it exited


@pytest.fixture
def server(tmp_path: Path):
    proc = RedisProc(tmp_path / "redis", "always").start()
    yield proc
    proc.kill()


def leases(r: Redis) -> dict[int, bytes | None]:
    return {shard: r.get(keys.lease_key(shard)) for shard in range(CONFIG.num_shards)}


def start_standby(url: str, tmp_path: Path, **env: str) -> WorkerProc:
    """A second worker over every shard, busy as the old owner is (~30 ms an engine run); seq gaps of 120 s."""
    return WorkerProc(url, {
        "TINKERQ_RUNTIME": "reference", "TINKERQ_NUM_SHARDS": str(CONFIG.num_shards),
        "TINKERQ_LEASE_TTL_MS": str(CONFIG.lease_ttl_ms), "TINKERQ_CHECKPOINT_ROOT": str(tmp_path),
        "TINKERQ_SEQ_GAP_TIMEOUT_S": "120", "TINKERQ_REFERENCE_DELAY_PER_TOKEN_S": "0.002", **env})


def takes_over(r: Redis, before: dict[int, bytes | None]) -> bool:
    return all(v is not None and v != before[s] for s, v in leases(r).items())


def watch_addresses(r: Redis, pid: int) -> Addresses:
    """The addresses of the process's connections from now on; each carries its worker's name."""
    named = {c["addr"] for c in r.client_list() if f"-{pid}-" in c.get("name", "")}
    addresses = Addresses(pid)
    addresses.found = redis_addresses(pid)
    assert addresses.found and addresses.found <= named, "every connection of the worker carries its name"
    addresses.start()
    return addresses


def writes_of(monitor: Monitor, addresses: Addresses, since: float) -> list[str]:
    """What `addresses` wrote after `since`, once the watching stopped."""
    monitor.stop.set()
    monitor.join(5)
    addresses.stop.set()
    return writes_after(monitor.lines, since, addresses.found)


def test_a_paused_and_resumed_old_owner_writes_nothing_and_stops_cleanly(server, tmp_path):
    old = loaded_worker(server.url, tmp_path, TINKERQ_SEQ_GAP_TIMEOUT_S="120", TINKERQ_STOP_GRACE_S="3")
    standby = None
    monitor = Monitor(server.url)
    try:
        r = connect(server.url)
        producer = Producer(r, CONFIG)
        model = MODELS[0]
        datum = Datum(model_input=[1, 2, 3])
        early = producer.submit(ForwardBackwardRequest(model_id=model, seq_id=2, data=[datum]))  # seq 1 not yet
        wait_until(lambda: r.zscore(keys.held_key(model), early.request_id) is not None, 30, "the early op parked")
        monitor.start()
        load = Load(server.url, 240, pace_s=0.02)
        load.start()
        wait_until(lambda: len(load.acked) >= 40, 30, "the stream to start")
        before = leases(r)
        old.proc.send_signal(signal.SIGSTOP)
        standby = start_standby(server.url, tmp_path)
        wait_until(lambda: takes_over(r, before), 30, "the standby to take every shard")
        time.sleep(2.0)  # the standby works
        addresses = watch_addresses(r, old.proc.pid)
        woke = time.time()
        old.proc.send_signal(signal.SIGCONT)
        time.sleep(4.0)  # it wakes into the middle of whatever it was doing, and finds its leases gone
        assert old.alive(), old.output()[-3000:]
        # the standby's parked op is still parked (a woken sweep would have taken it out, never to answer it)
        assert r.zscore(keys.held_key(model), early.request_id) is not None
        assert r.hexists(keys.held_payload_key(model), early.request_id)
        first = producer.submit(ForwardBackwardRequest(model_id=model, seq_id=1, data=[datum, datum]))
        for ticket in (first, early):
            out = producer.wait(ticket.request_id, 60)
            assert out is not None and not isinstance(out, ErrorResponse), (out, standby.output()[-3000:])
        for item in load.finish():
            out = producer.wait(item.rid, 60)
            assert out is not None, f"{item.request.kind} {item.rid} was never answered\n{standby.output()[-3000:]}"
            assert not isinstance(out, ErrorResponse), out
        for shard in range(CONFIG.num_shards):
            assert r.zcard(f"rq:failed:{keys.queue_name(shard)}") == 0, "a job was failed instead of retried"
        stop_within(old)
        written = writes_of(monitor, addresses, woke)
        assert written == [], "the woken old owner wrote:\n" + "\n".join(written[:30])
        assert standby.alive(), standby.output()[-3000:]
        producer.close()
    finally:
        monitor.stop.set()
        for proc in (old, standby):
            if proc is not None and proc.alive():
                os.kill(proc.proc.pid, signal.SIGCONT)  # a stopped process must be able to die
                proc.kill(signal.SIGKILL)


def test_a_woken_old_owner_takes_no_parked_op_that_fell_due_while_it_slept(server, tmp_path):
    """Two ops it parked fall due while it is paused, before its successor's sweep gets to them: one's seq_id gap is
    closed by a refusal at submit, the other's deadline passes. The woken owner's idle loop ticks, and its sweep may
    run before its lease keeper finds the leases gone: it must take neither. Both stay parked until the new owner runs
    the one and answers the other's timeout; the woken owner writes nothing, and SIGTERM stops it with status 0."""
    gap_s = 12.0
    old = loaded_worker(server.url, tmp_path, TINKERQ_SEQ_GAP_TIMEOUT_S=str(gap_s), TINKERQ_STOP_GRACE_S="3")
    standby = None
    monitor = Monitor(server.url)
    try:
        r = connect(server.url)
        producer = Producer(r, CONFIG)
        datum = Datum(model_input=[1, 2, 3])
        ready, expiring = (producer.submit(ForwardBackwardRequest(model_id=model, seq_id=2, data=[datum]))
                           for model in MODELS[:2])  # seq 1 of neither is ever queued
        parked = {ready.request_id: MODELS[0], expiring.request_id: MODELS[1]}
        for rid, model in parked.items():
            wait_until(lambda model=model, rid=rid: r.zscore(keys.held_key(model), rid) is not None, 30,
                       f"{rid} to park")
        deadlines, member = keys.held_deadlines_key(expiring.shard), f"{expiring.request_id}|{MODELS[1]}"
        deadline = r.zscore(deadlines, member)
        before = leases(r)
        old.proc.send_signal(signal.SIGSTOP)  # idle: it wakes into its idle loop, whose tick sweeps
        # The successor pauses too, before the deadline (its 30 s lease outlives the pause): the ops fall due while
        # no owner is at work, and the old owner wakes first.
        standby = start_standby(server.url, tmp_path, TINKERQ_LEASE_TTL_MS="30000")
        wait_until(lambda: takes_over(r, before), 30, "the standby to take every shard")
        standby.proc.send_signal(signal.SIGSTOP)
        assert time.time() < deadline - 0.5, "the standby was paused after the deadline: the test ran too slowly"
        r.sadd(keys.refused_seqs_key(MODELS[0]), 1)  # as the API records seq 1 refused at submit: seq 2's turn
        time.sleep(deadline - time.time() + 0.5)
        addresses = watch_addresses(r, old.proc.pid)
        monitor.start()
        woke = time.time()
        old.proc.send_signal(signal.SIGCONT)
        time.sleep(3.0)  # its tick and its lease keeper run; it finds its leases gone
        assert old.alive(), old.output()[-3000:]
        for rid, model in parked.items():  # a woken sweep would have taken them out, never to answer them
            assert r.zscore(keys.held_key(model), rid) == 2, f"{rid} is no longer parked\n{old.output()[-3000:]}"
            assert r.hexists(keys.held_payload_key(model), rid)
        assert r.zscore(deadlines, member) == deadline
        standby.proc.send_signal(signal.SIGCONT)
        out = producer.wait(ready.request_id, 60)
        assert out is not None and out.type == "forward_backward", (out, standby.output()[-3000:])
        out = producer.wait(expiring.request_id, 60)
        assert out is not None and out.code == "seq_gap_timeout", (out, standby.output()[-3000:])
        stop_within(old)
        written = writes_of(monitor, addresses, woke)
        assert written == [], "the woken old owner wrote:\n" + "\n".join(written[:30])
        assert standby.alive(), standby.output()[-3000:]
        producer.close()
    finally:
        monitor.stop.set()
        for proc in (old, standby):
            if proc is not None and proc.alive():
                os.kill(proc.proc.pid, signal.SIGCONT)  # a stopped process must be able to die
                proc.kill(signal.SIGKILL)
