"""A private redis-server on a free loopback port: the embedded default when no Redis is configured."""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from redis import Redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """Start with `start()`, stop with `stop()` (by pid); usable as a context manager."""

    def __init__(self, port: int | None = None, persist: bool = False) -> None:
        self.port = port or free_port()
        self.persist = persist
        self.dir = Path(tempfile.mkdtemp(prefix="tinkerq-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed: `apt-get install redis-server` (Debian/Ubuntu), "
                "or point REDIS_URL at a running Redis"
            )
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "yes" if self.persist else "no",
                "--maxmemory-policy", "noeviction", "--logfile", str(self.dir / "redis.log")]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if Redis(port=self.port, socket_connect_timeout=0.2).ping():
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not come up on port {self.port}; see {self.dir / 'redis.log'}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, 9)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
