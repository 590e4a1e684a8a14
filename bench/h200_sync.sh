#!/usr/bin/env bash
# Weight-sync benchmarks on the H200 (issue 14): bench/gpu_sync.py with CUDA graphs off and on, then
# bench/vllm_sync_check.py (each sync's weights served, eager and graphs). vLLM travels as for h200_vllm.sh:
#   bash bench/h200_vllm_carry.sh          # here: build .devcarry/p00 … pNN (one device command per chunk)
#   bash bench/h200_vllm.sh install        # there: verify, unpack, pip install into /tmp/site
#   bash bench/h200_sync.sh [gpu_sync args...]   # there: tables on stdout; JSON, PNG and logs under $OUT
# GRAPHS="off on" (default) picks the CUDA-graph settings, CHECK=0 skips vllm_sync_check.py: one device command
# is limited to 10 minutes, so a run of both model sizes splits over two commands on the same warm machine.
set -euo pipefail
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 TVM_FFI_DISABLE_TORCH_C_DLPACK=1  # no flashinfer; no JIT build at import
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
status=0
for setting in ${GRAPHS:-off on}; do
  graphs=$([ "$setting" = on ] && echo --graphs || true)
  tag=h200${graphs:+-graphs}
  python3 bench/gpu_sync.py --device cuda --dtype bfloat16 --tag "$tag" $graphs "$@" >"$OUT/$tag.log" 2>&1 \
    || { status=1; tail -40 "$OUT/$tag.log"; }
  sed -n '/^model /,$p' "$OUT/$tag.log"
  cp bench/results/gpu_sync-"$tag".* "$OUT"/ 2>/dev/null || true
done
[ "${CHECK:-1}" = 0 ] && exit $status
python3 bench/vllm_sync_check.py --device cuda --dtype bfloat16 --model randq-0.5b \
  --out "$OUT/vllm_sync_check.json" >"$OUT/vllm_sync_check.log" 2>&1 || status=1
sed -n '/^sync /,$p' "$OUT/vllm_sync_check.log"
exit $status
