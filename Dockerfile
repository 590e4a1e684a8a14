# One image for every tinkerq process (api, worker). GPU workers add the vllm extra.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY producer ./producer
COPY worker ./worker
COPY tinkerq ./tinkerq
COPY commands ./commands
ARG EXTRAS=torch
RUN pip install --no-cache-dir ".[${EXTRAS}]"
ENV TINKERQ_CHECKPOINT_ROOT=/data/checkpoints HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
ENTRYPOINT ["tinkerq"]
