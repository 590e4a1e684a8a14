"""A redis-server that a test may SIGKILL, restart on the same port and dir, freeze and thaw: always by its pid."""

import os
import signal
import subprocess
import time
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from commands.redis_server import free_port


class RedisProc:
    """One redis-server with AOF on (`appendfsync` always or everysec), its data in `dir` across restarts."""

    def __init__(self, dir: Path, appendfsync: str = "always") -> None:
        self.dir = dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.appendfsync = appendfsync
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> "RedisProc":
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "yes", "--appendfsync", self.appendfsync,
                "--maxmemory-policy", "noeviction", "--logfile", str(self.dir / "redis.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        probe = Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.dir / 'redis.log'}")
            try:
                if probe.ping():  # answers only once the AOF is loaded (LOADING before)
                    probe.close()
                    return self
            except RedisError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server did not come up on port {self.port}; see {self.dir / 'redis.log'}")

    def kill(self) -> None:
        """SIGKILL, as a crash: whatever the AOF had not written is lost."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen server must be able to die
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
