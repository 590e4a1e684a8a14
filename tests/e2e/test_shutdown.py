"""SIGTERM stops a live `tinkerq worker` within seconds whatever its Redis is doing (up under a steady stream,
frozen as in a network partition, killed, restarting), with status 0, dropping nothing acknowledged: what it had
in hand stays in Redis, and the next owner answers it. A live `tinkerq api` with a long poll pending stops within
seconds too, and the poll gets an answer the SDK retries."""

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from producer import Producer
from schemas import ErrorResponse
from support.load import CONFIG, Load, connect, loaded_worker
from support.redis_proc import RedisProc
from support.stack import DEADLINE_S, ApiProc, WorkerProc, stop_within
from tinkerq import keys

pytestmark = pytest.mark.slow

GRACE_S = 3.0


@pytest.fixture
def server(tmp_path: Path):
    proc = RedisProc(tmp_path / "redis", "always").start()
    yield proc
    proc.kill()


@pytest.fixture
def worker(server: RedisProc, tmp_path: Path):
    # a steady stream would keep one batch open for TINKERQ_BATCH_ADMIT_S: make that long
    proc = loaded_worker(server.url, tmp_path, TINKERQ_STOP_GRACE_S=str(GRACE_S), TINKERQ_BATCH_ADMIT_S="60")
    yield proc
    proc.kill(signal.SIGKILL)


def standby_settles(server: RedisProc, tmp_path: Path, load: Load) -> None:
    """Another worker takes the shards once the stopped one's leases lapse and answers every acknowledged request
    exactly once; none is failed in RQ. (The reference runtime keeps models in memory, so what needs the stopped
    worker's state gets its explicit model_state_lost; tests/e2e/test_durable.py covers state that survives.)"""
    standby = WorkerProc(server.url, {
        "TINKERQ_RUNTIME": "reference", "TINKERQ_NUM_SHARDS": str(CONFIG.num_shards),
        "TINKERQ_LEASE_TTL_MS": str(CONFIG.lease_ttl_ms), "TINKERQ_CHECKPOINT_ROOT": str(tmp_path)})
    sent = load.finish()
    r = connect(server.url)
    producer = Producer(r, CONFIG)
    try:
        for item in sent:
            out = producer.wait(item.rid, 60)
            assert out is not None, f"{item.request.kind} {item.rid} was never answered\n{standby.output()[-3000:]}"
            if isinstance(out, ErrorResponse):
                assert out.code == "model_state_lost", out
        for shard in range(CONFIG.num_shards):
            assert r.zcard(f"rq:failed:{keys.queue_name(shard)}") == 0, "a job was failed instead of retried"
        assert standby.alive(), standby.output()[-3000:]
    finally:
        producer.close()
        standby.kill()


def test_sigterm_under_a_steady_stream_stops_without_waiting_for_the_batch_to_close(server, worker, tmp_path):
    load = Load(server.url, 400, pace_s=0.01)
    load.start()
    time.sleep(1.5)
    took = stop_within(worker)
    assert took < GRACE_S, f"the worker took {took:.1f} s: it kept admitting samples instead of draining"
    standby_settles(server, tmp_path, load)


def test_sigterm_with_redis_frozen_stops_within_seconds(server, worker, tmp_path):
    load = Load(server.url, 200)
    load.start()
    time.sleep(1.0)
    server.freeze()
    try:
        time.sleep(0.5)
        stop_within(worker)
    finally:
        server.thaw()
    standby_settles(server, tmp_path, load)


def test_sigterm_with_redis_killed_stops_within_seconds(server, worker, tmp_path):
    load = Load(server.url, 200)
    load.start()
    time.sleep(1.0)
    server.kill()
    time.sleep(0.5)
    stop_within(worker)
    server.start()
    standby_settles(server, tmp_path, load)


def test_sigterm_while_redis_restarts_stops_within_seconds(server, worker, tmp_path):
    """The worker is mid-reconnect (waiting for Redis to answer) when the signal comes."""
    load = Load(server.url, 100)
    load.start()
    time.sleep(1.0)
    server.kill()
    time.sleep(4.0)  # past redis-py's own retries: the worker is in its outage wait
    stop_within(worker)
    server.start()
    standby_settles(server, tmp_path, load)


def test_sigterm_on_an_idle_worker_with_redis_up_stops_at_once(server, worker):
    assert stop_within(worker) < GRACE_S, "an idle worker stops on its own, before the grace runs out"
    r = connect(server.url)
    held = [s for s in range(CONFIG.num_shards) if r.exists(keys.lease_key(s))]
    assert held == [], f"a clean stop releases its leases at once; still held: {held}"


@pytest.mark.parametrize("outage", ["frozen", "down"])
def test_the_producer_library_stops_within_seconds_whatever_redis_does(server, outage):
    """`Producer.wait` and `Producer.close` are bounded on a caller's client that has no socket timeouts: a frozen
    Redis (SIGSTOPped) held both forever, a read with no deadline."""
    import threading

    from redis import Redis, RedisError

    # a caller's client with no timeouts (redis-py before 8 has none by default)
    producer = Producer(Redis.from_url(server.url, socket_timeout=None, socket_connect_timeout=None), CONFIG)
    assert producer.wait("r-warm", 0.1) is None  # the listener is up
    server.freeze() if outage == "frozen" else server.kill()
    outcome: list[object] = []

    def wait(timeout: float = 2.0) -> None:
        try:
            outcome.append(producer.wait("r-never", timeout))
        except RedisError as exc:
            outcome.append(exc)

    try:
        waiter = threading.Thread(target=wait, daemon=True)
        started = time.monotonic()
        waiter.start()
        waiter.join(timeout=DEADLINE_S)
        assert not waiter.is_alive(), f"Producer.wait(timeout=2) still blocked {DEADLINE_S:g} s later ({outage})"
        assert isinstance(outcome[0], RedisError), outcome  # an unreachable Redis is an error, not "no result yet"
        pending = threading.Thread(target=wait, args=(60.0,), daemon=True)
        pending.start()
        time.sleep(0.2)
        closer = threading.Thread(target=producer.close, daemon=True)
        closer.start()
        closer.join(timeout=DEADLINE_S)
        assert not closer.is_alive(), f"Producer.close() still blocked {DEADLINE_S:g} s later ({outage})"
        pending.join(timeout=DEADLINE_S)
        assert not pending.is_alive(), "a wait pending at close() did not return with it"
        assert time.monotonic() - started < 2 * DEADLINE_S
    finally:
        if outage == "frozen":
            server.thaw()


@pytest.fixture
def api(server: RedisProc, tmp_path: Path):
    # the default long poll (30 s): far longer than the deadline, as the SDK's polls are
    proc = ApiProc(server.url, {"TINKERQ_NUM_SHARDS": str(CONFIG.num_shards), "TINKERQ_CHECKPOINT_ROOT": str(tmp_path)})
    yield proc
    proc.kill(signal.SIGKILL)


def pending_request(api: ApiProc) -> str:
    """A request id that no worker will answer (there is none): its long poll waits the whole TINKERQ_LONG_POLL_S."""
    session = httpx.post(f"{api.url}/api/v1/create_session", json={"tags": []}, timeout=10).json()["session_id"]
    created = httpx.post(f"{api.url}/api/v1/create_model", timeout=10, json={
        "session_id": session, "model_seq_id": 0, "base_model": "tinyq-micro", "lora_config": {"rank": 4}})
    return created.json()["request_id"]


@pytest.mark.parametrize("outage", ["up", "frozen", "down"])
def test_sigterm_stops_the_api_within_seconds_with_a_long_poll_pending(server, api, outage):
    """uvicorn waits for open requests before it runs the app's shutdown: a pending retrieve_future held SIGTERM
    for the whole long poll (longer against a frozen Redis). The poll is answered try_again (or a 503 when Redis
    is gone), which the SDK retries, not a dropped connection."""
    request_id = pending_request(api)
    answers: list[httpx.Response | Exception] = []

    def poll() -> None:
        try:
            answers.append(httpx.post(f"{api.url}/api/v1/retrieve_future", json={"request_id": request_id},
                                      timeout=60))
        except httpx.HTTPError as exc:
            answers.append(exc)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.5)  # the poll is waiting in the API
    if outage == "frozen":
        server.freeze()
    elif outage == "down":
        server.kill()
    try:
        time.sleep(0.5)
        stop_within(api)
    finally:
        if outage == "frozen":
            server.thaw()
    poller.join(timeout=DEADLINE_S)
    assert answers, "the long poll got no answer"
    answer = answers[0]
    assert isinstance(answer, httpx.Response), f"the long poll was dropped: {answer!r}\n{api.output()[-3000:]}"
    if outage == "down" and answer.status_code == 503:
        assert answer.json()["code"] == "queue_unavailable"
    else:
        assert answer.status_code == 200 and answer.json()["type"] == "try_again", answer.text
