"""`tinkerq` subcommands in processes of their own, as users run them: the demo's worker, and the workers and API
servers of the benchmarks and tests, each with its output in a log file."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class TinkerqProc:
    """`tinkerq ARGS...` (as `python -m commands.cli`, so it runs this checkout's code); stdout and stderr go to
    `log_dir/<command>-<ns>.log`. `python_path` adds folders (a test's own runtime modules) to its imports."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str], log_dir: Path,
                 python_path: Sequence[str] = ()) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{args[0]}-{time.time_ns()}.log"
        self.log = open(self.log_path, "w+")
        path = [str(ROOT), *python_path, *filter(None, [env.get("PYTHONPATH")])]  # env may add to it
        self.proc = subprocess.Popen([sys.executable, "-m", "commands.cli", *args],
                                     env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(path)},
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 30) -> None:
        """Signal it and wait for it to exit; one still running after `timeout_s` is SIGKILLed, and the timeout
        raised (a process that ignores its signal is a bug to report, not to leave behind)."""
        if not self.alive():
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise
