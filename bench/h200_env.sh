#!/usr/bin/env bash
# Sourced on the H200 (or H100) test machine before a benchmark that needs what that machine lacks: the wheels and
# Debian's redis-server that bench/h200_carry.sh put in the ignored folder .apicarry (carry it). Installs the wheels
# under /tmp/site, starts redis-server on one core of its own (port 6390; a second start just fails to bind) and
# exports PYTHONPATH, PATH and REDIS_URL.   Usage:  source bench/h200_env.sh && python3 bench/queue_fb.py ...
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .apicarry/whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TINKER_TELEMETRY=0
export PATH=$PWD/.apicarry/redis:$PATH LD_LIBRARY_PATH=$PWD/.apicarry/redis:${LD_LIBRARY_PATH:-}
chmod +x .apicarry/redis/redis-server
taskset -c 15 redis-server --port 6390 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
  --logfile /tmp/redis.log >/dev/null || true
export REDIS_URL=redis://127.0.0.1:6390/0
