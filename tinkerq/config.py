"""Deployment settings shared by producers and workers (TINKERQ_* environment variables).

Each setting's `description` is its documentation: docs/configuration.md is rendered from these classes
(`python -m commands.config_docs`), and a test fails when the two disagree.
"""

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import Limits

# How the Ray runtime's syncs reach its engine replicas (RuntimeConfig.ray_weight_transport).
WeightTransport = Literal["group", "object_store"]


class QueueConfig(BaseSettings):
    """The queue: shards and leases, how long records live in Redis, batching, durability, and how a worker
    rides out a Redis outage or a stop signal. Producers and workers of one deployment must agree on these."""

    model_config = SettingsConfigDict(env_prefix="TINKERQ_", frozen=True)

    num_shards: int = Field(8, ge=1, le=1024, description=(
        "K, the number of shard queues. Fixed for a deployment, since model -> shard must never move: recorded in "
        "Redis on first use, and a process started with another K refuses to run."))
    result_ttl_s: int = Field(3600, ge=1, description="How long a stored result stays in Redis.")
    request_ttl_s: int = Field(86400, ge=1, description=(
        "How long a request's idempotency record stays, so a resent request finds the first one's result."))
    rq_result_ttl_s: int = Field(600, ge=1, description=(
        "How long RQ keeps its own record of a finished job. These records only feed the dashboard, so they are "
        "short-lived."))
    rq_failure_ttl_s: int = Field(86400, ge=1, description="How long RQ keeps its own record of a failed job.")
    job_timeout_s: int = Field(1800, ge=1, description=(
        "Backstop per job (the worker answers 504 past it); the real limits are enforced inside the engine."))
    lease_ttl_ms: int = Field(15000, ge=1000, description=(
        "A worker's lease on a shard; a dead worker's shards move to another worker after this."))
    seq_gap_timeout_s: float = Field(120.0, gt=0, description=(
        "How long a training op that arrives early waits for the gap in its model's seq_ids to fill; then it fails "
        "with seq_gap_timeout and later ops go on."))
    max_batch_requests: int = Field(256, ge=1, description="Sample requests in one engine run at a time.")
    batch_admit_s: float = Field(30.0, ge=0, description=(
        "How long a running batch takes in samples that arrive meanwhile (continuous batching); then the batch "
        "drains, and the next job in the shard queue (a sync, a training op, another shard's job) gets its turn."))
    lanes: bool = Field(True, description=(
        "Sample while training: the worker's sampling lane serves samples on the engine while its training lane (the "
        "RQ loop) runs training ops, and takes queued samples whose pinned weights the engine holds ahead of the "
        "training ops queued before them. Off: one job at a time, in queue order (the serial schedule)."))
    lane_poll_s: float = Field(0.01, gt=0, description=(
        "While the training lane runs an op, how often the idle sampling lane looks in the shard queues for samples "
        "it may serve (a sample waits about half of this longer than on an idle worker)."))
    tick_s: int = Field(1, ge=1, description=(
        "The worker's idle loop period, and how long its blocking waits (BLPOP) last, in seconds."))
    redis_outage_s: float = Field(300.0, gt=0, description=(
        "How long a worker waits for an unreachable Redis (killed, restarting, frozen) before it gives up and exits "
        "non-zero."))
    redis_socket_timeout_s: float = Field(10.0, gt=0, description=(
        "A worker's or API process's Redis call (connect, read) fails after this long without a reply (for a "
        "worker, an outage it rides out), so a frozen Redis never blocks either forever. Must exceed tick_s, the "
        "worker's blocking wait."))
    stop_grace_s: float = Field(5.0, gt=0, description=(
        "After SIGTERM/SIGINT the worker finishes the job in hand for at most this long, then exits anyway "
        "(status 0); what it had in hand stays in Redis for the next owner (worker/shutdown.py)."))
    stability_ttl_s: int = Field(86400, ge=1, description=(
        "How long sequences sampled with record_stability_info can be trained on (stable_reinforce) after their "
        "sampling or their last use in training (Tinker: one day)."))
    durable: bool = Field(True, description=(
        "Journal each state-changing training op in Redis with its result, so any worker can rebuild the model "
        "after its owner dies (worker/durability/journal.py). False: a model lives only in its owner's memory "
        "(model_state_lost)."))
    durable_every: int = Field(10, ge=0, description=(
        "Every this many optim_steps of a model, its owner writes a durable checkpoint of its whole state to the "
        "checkpoint root and trims the journal before it (worker/durability/checkpointer.py), so a takeover "
        "replays at most this many steps and Redis holds no more of their data. 0: never (the journal grows with "
        "the run)."))
    durable_async: bool = Field(True, description=(
        "Write those checkpoints on a side thread: the step copies the tensors to host memory (pinned on a GPU) "
        "and returns; the journal is trimmed once the file is whole (worker/durability/checkpointer.py). False: "
        "the step writes it."))
    preload_bases: str = Field("auto", description=(
        "Base models a worker loads (trainer and engine) while it owns no shard, so that a takeover pays no engine "
        "start (worker/shards/preload.py): comma-separated names; `auto` for the bases of the models created or "
        "loaded on the shards it may take (re-read each standby tick); `none` for nothing. A named base the "
        "deployment does not serve stops the worker."))

    @model_validator(mode="after")
    def _blocking_waits_fit_the_socket_timeout(self) -> "QueueConfig":
        if self.redis_socket_timeout_s <= self.tick_s:
            raise ValueError(f"redis_socket_timeout_s ({self.redis_socket_timeout_s:g}) must exceed tick_s "
                             f"({self.tick_s}), the worker's blocking wait")
        return self

    def redis_timeouts(self) -> dict[str, float]:
        """A Redis client's bounds (redis-py's keyword arguments, sync or asyncio): every read gives up after
        redis_socket_timeout_s and every connect after at most 5 s of it, so a frozen Redis fails a call instead of
        hanging it, and a close (which waits for its socket within the connect timeout) cannot hold an exit up."""
        return {"socket_timeout": self.redis_socket_timeout_s,
                "socket_connect_timeout": min(5.0, self.redis_socket_timeout_s)}


class RuntimeConfig(BaseSettings):
    """What a worker loads: which runtime, where checkpoints go, how many snapshots it keeps; the torch
    runtime's device, dtype and sampling engine; vLLM's syncs and memory; the trainer's passes; and, for one
    worker across many devices, Ray."""

    model_config = SettingsConfigDict(env_prefix="TINKERQ_", frozen=True)

    runtime: str = Field("auto", description=(
        "Which runtime a worker holds: `auto`, `torch`, `reference` or `module:factory`. `auto` is the torch runtime "
        "(a real model; an error without its packages). The reference runtime is a stand-in for tests: ask for it. "
        "`tinkerq worker --runtime`."))
    checkpoint_root: str = Field("./checkpoints", description=(
        "Where saved states, sampler snapshots and durable checkpoints are written."))
    max_snapshots: int = Field(4, ge=1, description=(
        "Live weight snapshots per model: a sampling session pinned to an older one gets an explicit error."))
    device: str = Field("auto", description=(
        "The torch runtime's device: `auto` (the GPU where there is one), `cpu`, `cuda` or `cuda:N`."))
    dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$", description=(
        "The torch runtime's dtype. auto: bfloat16 on a GPU (vLLM's GPU LoRA kernels take nothing wider), float32 "
        "on the CPU."))
    engine: str = Field("auto", pattern="^(auto|vllm|torch)$", description=(
        "The sampling engine beside the torch trainer. auto: vLLM where it imports, else PyTorch. "
        "`tinkerq worker --engine`."))
    vllm_sync: str = Field("lora", pattern="^(lora|merged)$", description=(
        "vLLM snapshots: `lora`, LoRA adapters (many models and versions per base); `merged`, full weights merged "
        "and reloaded in place (one model per base, only its latest version servable, no LoRA cost per token)."))
    vllm_inplace_sync: bool = Field(True, description=(
        "Sync by writing tensors straight into the engine (LoRA slots or merged weights) rather than through files "
        "and vLLM's loaders; layouts it does not understand fall back to those. False: always fall back."))
    vllm_max_loras: int = Field(8, ge=1, description="Adapters one vLLM engine step may mix.")
    vllm_max_lora_rank: int = Field(64, ge=1, description=(
        "The largest LoRA rank vLLM serves (adapters are padded to it); a larger rank is a 400."))
    vllm_gpu_memory_utilization: float | Literal["auto"] = Field("auto", description=(
        "The share of the GPU's memory each vLLM engine takes (vLLM's gpu_memory_utilization). auto: on a GPU, "
        "what is free when the engine starts less the trainer's measured peak for a full micro-batch (a dry "
        "forward_backward and optim_step on a throwaway adapter) less vllm_memory_margin_gib, logged at start "
        "(worker/vllm_runtime/memory_share.py); 0.5 where no trainer shares the process (the Ray runtime's engine "
        "replicas). A number in (0, 1]: that share. Not used on the CPU."))
    vllm_memory_margin_gib: float = Field(2.0, ge=0.0, description=(
        "auto's allowance beyond the trainer's measured peak: the allocator's fragmentation, other models' "
        "adapters and optimizer states, what vLLM's own estimate of its share misses."))
    vllm_sleep_during_training: bool = Field(False, description=(
        "vLLM's sleep mode around training: before a forward / forward_backward the engine gives back its KV cache "
        "and its weights (to host memory, level 1), and takes them back before its next sample or sync. One base "
        "per worker (vLLM's allocator serves one engine a process); GPU only; costs a copy of the weights each "
        "way, so turn it on only where the trainer does not fit beside the engine."))
    vllm_share_base: bool = Field(True, description=(
        "One copy of a base on the device: the in-process trainer's base weights are views of the vLLM engine's "
        "(LoRA sync never changes them; worker/vllm_runtime/shared_base.py). Off, or where the engine writes or "
        "moves its base (merged sync, sleep mode, tensor parallelism) or lives in other processes (Ray replicas), "
        "each holds its own."))
    vllm_cpu_kv_cache_gib: float = Field(1.0, gt=0.0, description=(
        "vLLM's KV cache on the CPU, in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE, unless that is set)."))
    vllm_tensor_parallel_size: int = Field(1, ge=1, description=(
        "vLLM's tensor parallelism: each engine spreads its base over this many devices (workers of vLLM's own "
        "multiprocessing executor), for a base whose weights and KV cache do not fit one GPU. The in-process "
        "worker's engines take GPUs 0..k-1 beside its trainer on GPU 0; a Ray replica takes the GPUs of k bundles "
        "of one node; on the CPU the workers split the cores."))
    vllm_enforce_eager: bool | None = Field(None, description=(
        "True: vLLM runs eager, without CUDA graphs; false: with them. Unset: CUDA graphs on a GPU (faster "
        "sampling; capturing them slows start-up), eager on the CPU."))
    train_micro_batch_tokens: int = Field(0, ge=0, description=(
        "Tokens per pass through the trainer's model (gradients accumulate over passes); 0: the trainer's default "
        "(16384). The Ray runtime's data-parallel ranks split a forward_backward along these same passes."))
    train_activation_gib: float = Field(0.0, ge=0.0, description=(
        "Activation memory a trainer pass keeps whole, in GiB; the layers past it are checkpointed (run again in "
        "the backward). 0: the trainer's default (15% of a GPU, at most 20 GiB; no checkpointing on the CPU). More "
        "buys speed (fewer layers recomputed) at the memory the engine would have had."))
    torch_threads: int = Field(0, ge=0, description=(
        "torch's intra-op CPU threads in each process of the runtime (the in-process worker, each Ray actor); 0: "
        "as torch (or Ray, 1 per actor) sets them. CPU kernels split their sums over threads, so equal counts give "
        "bitwise-equal results across runtimes."))
    ray_gpus: int = Field(0, ge=0, description=(
        "One worker across many devices, on Ray (worker/ray_runtime): the bundles of its placement group (one GPU "
        "each where the cluster has GPUs, else one CPU each); 0, with no ray_address, is the in-process runtime. "
        "`tinkerq worker --gpus N`."))
    ray_address: str = Field("", description=(
        "Join this Ray cluster (`auto`: the one this host is a node of; `head:6379`); empty: start a local one. "
        "Not Ray Client (ray://): it cannot stream results from actors. `tinkerq worker --ray-address ADDR`."))
    ray_namespace: str = Field("", description=(
        "The Ray namespace of this worker's actors, named engine-<i> and trainer-<i> in it (so ray.get_actor finds "
        "them); empty: tinkerq-<host>-<pid>, one per worker process."))
    ray_engine_replicas: int = Field(0, ge=0, description=(
        "vLLM engine replicas of the Ray runtime; 0: one per bundle (bundles / vllm_tensor_parallel_size)."))
    ray_trainer_ranks: int = Field(0, ge=0, description="Trainer ranks of the Ray runtime; 0: one per bundle.")
    ray_max_restarts: int = Field(16, ge=0, description="Times Ray restarts a dead engine replica or trainer rank.")
    ray_num_cpus: int = Field(0, ge=0, description=(
        "CPUs of a local Ray cluster; 0: the host's (at least the bundles)."))
    ray_weight_transport: WeightTransport = Field("group", description=(
        "How a sync reaches the Ray runtime's engine replicas: `group`, a broadcast from trainer rank 0 over a "
        "group of their own, NCCL where every member has a GPU of its own, else gloo "
        "(worker/ray_runtime/weight_group.py); `object_store`, a copy through Ray's object store that each replica "
        "reads."))
    ray_trainer_sharding: Literal["none", "fsdp"] = Field("none", description=(
        "How the Ray runtime's trainer ranks hold a base: `none`, whole on each rank (data parallel); `fsdp`, each "
        "decoder layer's weights sharded over the ranks (torch FSDP2), for a base that does not fit one device "
        "(worker/ray_runtime/sharding.py)."))
    reference_delay_per_token_s: float = Field(0.0, ge=0.0, description=(
        "Test aid for the reference runtime's engine: simulated generation time per token."))

    @field_validator("vllm_gpu_memory_utilization")
    @classmethod
    def _a_share(cls, value: float | str) -> float | str:
        if value != "auto" and not 0.0 < value <= 1.0:
            raise ValueError(f"vllm_gpu_memory_utilization must be auto or in (0, 1], not {value!r}")
        return value


class LimitsConfig(BaseSettings, Limits):
    """The deployment's `Limits` on what one request may ask for, checked before anything reaches a GPU: a
    request past one is a 400 (limit_exceeded) that names the limit. Read from TINKERQ_MAX_* environment
    variables here, since schemas/ reads no environment; the fields and their descriptions are `schemas.Limits`'."""

    model_config = SettingsConfigDict(env_prefix="TINKERQ_", frozen=True)
