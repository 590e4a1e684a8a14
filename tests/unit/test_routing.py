import subprocess
import sys
from collections import Counter

from tinkerq.keys import shard_of


def test_shard_is_stable_across_processes_with_different_hash_seeds():
    models = [f"session-{i}:train:{i % 3}" for i in range(50)]
    here = [shard_of(m, 16) for m in models]
    code = f"from tinkerq.keys import shard_of; print([shard_of(m, 16) for m in {models!r}])"
    for seed in ("0", "1", "12345"):
        out = subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed, "PATH": ""},
                             capture_output=True, text=True, check=True, cwd=sys.path[0] or ".")
        assert eval(out.stdout) == here  # our own output


def test_shards_spread_models():
    counts = Counter(shard_of(f"m{i}", 8) for i in range(8000))
    assert set(counts) == set(range(8))
    assert min(counts.values()) > 800
