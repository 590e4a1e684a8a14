#!/usr/bin/env bash
# Builds .devcarry/ (git-ignored) for bench/h200_vllm.sh: vllm 0.26.0 (the release pinned to the H200 host's
# torch 2.11), the dependencies it imports that the host lacks, ours (rq, redis-py, pydantic-settings), and
# Debian's redis-server with the libraries the host's image lacks; one tar split into 60 MiB chunks, one
# folder per device command (.devcarry/p00 holds the checksums). ../shared/reference/vllm-on-h200.md says why.
# Run here, where PyPI and Debian's packages are reachable. RAY=1 adds Ray and the dependencies the host lacks, for
# the Ray runtime's worker (gpu_rl_step.py --runtimes torch,ray): one or two chunks more.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_SET="vllm==0.26.0 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
cbor2==6.3.0 pyzmq==27.3.0 msgspec==0.23.0 pybase64==1.5.1 cachetools==8.0.2 openai==3.57.0 openai-harmony==0.0.8
httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 llguidance==1.7.6 xgrammar==0.2.7
apache-tvm-ffi==0.1.10 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7 blake3==1.0.11
setproctitle==1.3.8 depyf==0.20.0 astor==0.8.1 dill==0.4.1 liger-kernel==0.8.5"
OURS="rq redis croniter pydantic-settings python-dotenv"
[ "${RAY:-0}" = 1 ] && OURS="$OURS ray jsonschema jsonschema-specifications referencing rpds-py"
pins=()
for pkg in $OURS; do
  pins+=("$pkg==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$pkg'))")")
done
rm -rf .devcarry && mkdir -p .devcarry/stage/whl .devcarry/stage/redis
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .devcarry/stage/whl $VLLM_SET "${pins[@]}"
# FlashAttention 2 serves only ALiBi models on Hopper (FA3 serves the rest): 123 MiB less to carry
zip -q -d .devcarry/stage/whl/vllm-0.26.0-*.whl 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so'
cp "$(command -v redis-server)" .devcarry/stage/redis/
for lib in liblzf.so.1 libjemalloc.so.2 libatomic.so.1; do
  cp "$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')" .devcarry/stage/redis/
done
(cd .devcarry/stage && tar cf - whl redis) | split -b 60M -d -a 2 - .devcarry/vllm.tar.
for f in .devcarry/vllm.tar.*; do mkdir -p ".devcarry/p${f##*.}" && mv "$f" ".devcarry/p${f##*.}/"; done
(cd .devcarry && sha256sum p*/vllm.tar.* | sed 's# p[0-9]*/# #' > p00/vllm.sha256)
rm -rf .devcarry/stage
ls -d .devcarry/p*
