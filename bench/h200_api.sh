#!/usr/bin/env bash
# bench/api_overhead.py on the H200 test machine, for its 16 cores: there the worker, the API and the
# clients each get cores of their own, as on separate hosts. That machine has torch and transformers
# but no Redis, no FastAPI/uvicorn, no tinker SDK and no network: Debian's redis-server (with the
# libraries it lacks there) and the wheels travel in the ignored folder .apicarry (carry it):
#   .apicarry/whl/    pip download --no-deps --python-version 3.12 of what KINDS.md does not list
#   .apicarry/redis/  redis-server, liblzf.so.1, libjemalloc.so.2, libatomic.so.1
# Usage: OUT=... bash bench/h200_api.sh TAG [api_overhead.py args...]
set -euo pipefail
source "$(dirname "$0")/h200_env.sh"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
tag=$1
shift
python3 bench/api_overhead.py --out "$OUT/$tag.json" "$@" >"$OUT/$tag.log" 2>&1 \
  || { tail -40 "$OUT/$tag.log"; exit 1; }
sed -n '/^path /,$p' "$OUT/$tag.log"
