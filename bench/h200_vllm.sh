#!/usr/bin/env bash
# vLLM benchmarks on the H200 test machine, which has torch 2.11 but no vLLM, no Redis and no network.
# vllm 0.26.0 (the release pinned to that torch), its missing dependencies, our own (rq, redis-py,
# pydantic-settings) and Debian's redis-server with its two uncommon libraries travel as one tar split
# into 60 MiB chunks, one per command, into /tmp/vparts (../shared/reference/vllm-on-h200.md). Then:
#   bash bench/h200_vllm_carry.sh                        # here: build .devcarry/p00 … pNN
#   bash bench/h200_vllm.sh install                      # there: verify, unpack, pip install into /tmp/site
#   TAG=name bash bench/h200_vllm.sh run MODEL [bench args...]   # bench/sampling_throughput.py on the GPU
#   TAG=name bash bench/h200_vllm.sh rl_step [bench args...]     # bench/gpu_rl_step.py: an RL step through the queue
#     (defaults: randq-0.5b, 256 prompts x 256 tokens, 5 steps after 3 warm-up ones; --sleep: vLLM's sleep mode during
#     forward passes). About 5-7 minutes each on a fresh machine: run one per device command.
#     randq-14b (issue 14 item 4): build it in the background in the first device call, beside the carry (85 s on a
#     16-core host: python3 -c "from tinkerq.local_models import resolve; resolve('randq-14b')"); where the device time
#     left is short, --no-baseline --eager skips the second engine start and the graphs (bench/RESULTS.md, session 4).
set -euo pipefail
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 TVM_FFI_DISABLE_TORCH_C_DLPACK=1  # no flashinfer; no JIT build at import
export PATH=/tmp/vw/redis:$PATH LD_LIBRARY_PATH=/tmp/vw/redis:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

start_redis() {
  # a daemon outlives the command (the machine keeps it while warm); a second start just fails to bind
  redis-server --port 6390 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
    --logfile /tmp/redis.log >/dev/null || true
}

case "$1" in
install)
  (cd /tmp/vparts && sha256sum -c --quiet vllm.sha256)
  mkdir -p /tmp/vw && cat /tmp/vparts/vllm.tar.* | tar x -C /tmp/vw
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/vw/whl/*.whl
  rm -rf /tmp/vw/whl /tmp/vparts
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  redis-server --version
  ;;
run)
  shift
  model=$1
  shift
  start_redis
  tag=${TAG:-$model}
  REDIS_URL=redis://127.0.0.1:6390/0 python3 bench/sampling_throughput.py --model "$model" --device cuda \
    --dtype bfloat16 --out "$OUT/$tag.json" "$@" >"$OUT/$tag.log" 2>&1 || { tail -40 "$OUT/$tag.log"; exit 1; }
  sed -n '/^path /,$p' "$OUT/$tag.log"
  ;;
rl_step)
  shift
  start_redis
  tag=${TAG:-rl_step}
  # the files name the card they ran on (h200, h100, ...): a device call may get either
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h[0-9]+' | head -1 | tr 'A-Z' 'a-z' || true)
  card=${card:-gpu}
  status=0
  REDIS_URL=redis://127.0.0.1:6390/0 python3 bench/gpu_rl_step.py --device cuda --tag "$card-$tag" "$@" \
    >"$OUT/$tag.log" 2>&1 || { status=1; tail -60 "$OUT/$tag.log"; }
  sed -n '/^RL step through/,$p' "$OUT/$tag.log"
  cp bench/results/gpu_rl_step-"$card-$tag".* "$OUT"/ 2>/dev/null || true
  # the worker's and the baseline's own logs (memory share, KV cache size, sleep/wake times)
  logs=$(sed -n 's/.*logs in \(.*\)$/\1/p' "$OUT/$tag.log" | head -1)
  [ -n "$logs" ] && for f in worker-torch.log worker-ray.log baseline.log; do
    cp "$logs/$f" "$OUT/$tag-$f" 2>/dev/null || true
  done
  exit $status
  ;;
esac
