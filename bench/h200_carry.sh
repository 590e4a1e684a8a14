#!/usr/bin/env bash
# Builds .apicarry/ (git-ignored) for bench/h200_env.sh (h200_api.sh, queue_fb.py, gpu_trainer.py): what the H200
# host lacks for the API and trainer benchmarks, for its Python 3.12 and with no network there. Run here, where PyPI
# and Debian's packages are reachable.
#   .apicarry/whl/    wheels of the packages below, exactly the versions this venv holds
#   .apicarry/redis/  Debian's redis-server and the libraries it needs that the H200 image lacks
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="tinker pyqwest orjson zstandard distro fastapi starlette annotated-doc typing-inspection pydantic
pydantic-core annotated-types pydantic-settings python-dotenv uvicorn httptools redis hiredis rq croniter sniffio
typer h2 hpack hyperframe httpcore2 httpx2 opentelemetry-api truststore tzdata pybase64"
pins=()
for pkg in $PKGS; do
  pins+=("$pkg==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$pkg'))")")
done
mkdir -p .apicarry/whl .apicarry/redis
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .apicarry/whl "${pins[@]}"
# the gpu extra, for the trainer's fused kernels (pyproject.toml pins it; the CPU venv does not hold it)
liger=$(sed -n 's/.*"\(liger-kernel==[^"]*\)".*/\1/p' pyproject.toml)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  -d .apicarry/whl "$liger"
cp "$(command -v redis-server)" .apicarry/redis/
for lib in liblzf.so.1 libjemalloc.so.2 libatomic.so.1; do
  cp "$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')" .apicarry/redis/
done
du -sh .apicarry
