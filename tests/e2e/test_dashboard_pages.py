"""rq-dashboard against a live stack, looked at in headless Chromium: the queue, jobs, job and worker pages render,
show what a person needs (job descriptions, statuses, readable JSON results) and no pickled values.

The screenshots land in test-artifacts/dashboard/ (gitignored) for a person to look at.
"""

import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from commands.redis_server import free_port
from producer import Producer
from schemas import CreateModelRequest, SampleRequest
from tinkerq import keys

pytestmark = pytest.mark.slow
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
# What a pickled value or a bytes repr looks like once a page prints it.
PICKLED = re.compile(r"\\x80\\x0[2-5]|gASV|b'\\x|\(dp0|c__builtin__|cpickle")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, ("Debian's chromium is needed to look at the dashboard: `make test` installs it "
                   "(apt-get install chromium)")
    return found


def render(url: str, png: Path) -> str:
    """The page as a browser leaves it after its scripts ran (the dashboard fills its tables from JSON), and a
    screenshot of it."""
    base = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,900",
            "--virtual-time-budget=3000"]
    subprocess.run([*base, f"--screenshot={png}", url], capture_output=True, timeout=60, check=True)
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=60, check=True).stdout
    assert png.stat().st_size > 5000, f"{png} is blank"
    return dom


def text_of(dom: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


@pytest.fixture
def dashboard(redis_url: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rq_dashboard", "--json", "-b", "127.0.0.1", "-p", str(port),
                             "-u", redis_url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{base}/0/data/queues.json", timeout=2).read()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "rq-dashboard did not come up"
            time.sleep(0.1)
    yield base
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def test_dashboard_pages_render_readable_jobs_and_workers(r, config, start_worker, dashboard):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    producer = Producer(r, config)
    # Queued first, with no worker: the jobs page shows waiting jobs by description.
    create = producer.submit(CreateModelRequest(model_id="dash", base_model="ref"))
    samples = [producer.submit(SampleRequest(model_id="dash", prompt_tokens=[3, 4, i])) for i in range(3)]
    queue = keys.queue_name(create.shard)

    queues = text_of(render(f"{dashboard}/0/view/queues", ARTIFACTS / "queues.png"))
    assert queue in queues
    queued = text_of(render(f"{dashboard}/0/view/jobs/{queue}/queued/8/asc/1", ARTIFACTS / "jobs-queued.png"))
    assert "create_model dash" in queued and queued.count("sample dash") == 3

    worker = start_worker()
    for ticket in [create, *samples]:
        assert producer.wait(ticket.request_id, 30) is not None
    finished = text_of(render(f"{dashboard}/0/view/jobs/{queue}/finished/8/asc/1", ARTIFACTS / "jobs-finished.png"))
    assert finished.count("sample dash") == 3
    job = text_of(render(f"{dashboard}/0/view/job/{samples[0].request_id}", ARTIFACTS / "job.png"))
    assert "sample dash" in job and "finished" in job
    assert f'"request_id": "{samples[0].request_id}"' in job and '"type": "sample"' in job  # the result, as JSON
    workers = text_of(render(f"{dashboard}/0/view/workers", ARTIFACTS / "workers.png"))
    assert queue in workers

    for page in (queues, queued, finished, job, workers):
        assert not PICKLED.search(page), PICKLED.search(page)
    assert worker.alive()
