"""Deployment settings shared by producers and workers (TINKERQ_* environment variables)."""

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import Limits

# How the Ray runtime's syncs reach its engine replicas (RuntimeConfig.ray_weight_transport).
WeightTransport = Literal["group", "object_store"]


class QueueConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TINKERQ_", frozen=True)

    # K is fixed for a deployment: model -> shard must never move. Recorded in Redis on first use.
    num_shards: int = Field(8, ge=1, le=1024)
    result_ttl_s: int = Field(3600, ge=1)
    request_ttl_s: int = Field(86400, ge=1)
    # RQ's own job records only feed the dashboard; keep them short-lived.
    rq_result_ttl_s: int = Field(600, ge=1)
    rq_failure_ttl_s: int = Field(86400, ge=1)
    # Backstop only; real limits are enforced inside the engine.
    job_timeout_s: int = Field(1800, ge=1)
    lease_ttl_ms: int = Field(15000, ge=1000)
    # An early training op waits this long for its seq_id gap to fill.
    seq_gap_timeout_s: float = Field(120.0, gt=0)
    max_batch_requests: int = Field(256, ge=1)
    # Samples that arrive while a batch runs join it (continuous batching) for this long; then the batch
    # drains, and the next job in the shard queue gets its turn.
    batch_admit_s: float = Field(30.0, ge=0)
    tick_s: int = Field(1, ge=1, description="worker idle loop period (seconds)")
    # A worker waits this long for an unreachable Redis (killed, restarting, frozen) before it gives up and exits.
    redis_outage_s: float = Field(300.0, gt=0)
    # A worker's Redis calls fail (and count as an outage) after this long without a reply, so a frozen Redis never
    # blocks it forever; above tick_s, which its blocking waits (BLPOP) last.
    redis_socket_timeout_s: float = Field(10.0, gt=0)
    # After SIGTERM/SIGINT the worker finishes the job in hand for at most this long, then exits anyway (status 0):
    # what it had in hand stays in Redis for the next owner (worker/shutdown.py).
    stop_grace_s: float = Field(5.0, gt=0)
    # Sequences sampled with record_stability_info can be trained on (stable_reinforce) this long after their
    # sampling or their last use in training (Tinker: one day).
    stability_ttl_s: int = Field(86400, ge=1)
    # Each state-changing training op is journaled in Redis with its result, so any worker can rebuild the model
    # after its owner dies (worker/durability/journal.py). Off: a model lives only in its owner's memory
    # (model_state_lost).
    durable: bool = True
    # Every this many optim_steps of a model, its owner writes a durable checkpoint of its whole state to the
    # checkpoint root and trims the journal before it (worker/durability/checkpointer.py), so a takeover replays at most
    # this many steps and Redis holds no more of their data. 0: never (the journal grows with the run).
    durable_every: int = Field(10, ge=0)
    # Write those checkpoints on a side thread: the step copies the tensors to host memory (pinned on a GPU) and
    # returns; the journal is trimmed once the file is whole (worker/durability/checkpointer.py). False: the step
    # writes it.
    durable_async: bool = True
    # Base models a worker loads (trainer and engine) while it owns no shard, so that a takeover pays no engine
    # start (worker/shards/preload.py): comma-separated names, `auto` for the bases of the models created or loaded on
    # the shards it may take (re-read each standby tick), `none` for nothing.
    preload_bases: str = "auto"

    @model_validator(mode="after")
    def _blocking_waits_fit_the_socket_timeout(self) -> "QueueConfig":
        if self.redis_socket_timeout_s <= self.tick_s:
            raise ValueError(f"redis_socket_timeout_s ({self.redis_socket_timeout_s:g}) must exceed tick_s "
                             f"({self.tick_s}), the worker's blocking wait")
        return self


class RuntimeConfig(BaseSettings):
    """What a worker loads: which runtime, where checkpoints go, how many snapshots it keeps."""

    model_config = SettingsConfigDict(env_prefix="TINKERQ_", frozen=True)

    # auto: the torch runtime (a real model). The reference runtime is a stand-in for tests: ask for it.
    runtime: str = Field("auto", description="auto | torch | reference | module:factory")
    checkpoint_root: str = "./checkpoints"
    # Live weight snapshots per model: a sampling session pinned to an older one gets an explicit error.
    max_snapshots: int = Field(4, ge=1)
    device: str = Field("auto", description="torch runtime: auto | cpu | cuda | cuda:N")
    # auto: bfloat16 on a GPU (vLLM's GPU LoRA kernels take nothing wider), float32 on the CPU.
    dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$", description="torch runtime's dtype")
    # The sampling engine beside the torch trainer. auto: vLLM where it imports, else PyTorch.
    engine: str = Field("auto", pattern="^(auto|vllm|torch)$", description="the torch runtime's sampling engine")
    # vLLM: LoRA snapshots as adapters (many models and versions per base), or full weights merged and
    # reloaded in place (one model per base, only its latest version servable, no LoRA cost per token).
    vllm_sync: str = Field("lora", pattern="^(lora|merged)$")
    # Sync by writing tensors straight into the engine (LoRA slots or merged weights) rather than through
    # files and vLLM's loaders; layouts it does not understand fall back to those. False: always fall back.
    vllm_inplace_sync: bool = True
    vllm_max_loras: int = Field(8, ge=1, description="adapters one engine step may mix")
    vllm_max_lora_rank: int = Field(64, ge=1)
    # The share of the GPU's memory each vLLM engine takes (vLLM's gpu_memory_utilization). auto: on a GPU, what is
    # free when the engine starts less the trainer's measured peak for a full micro-batch (a dry forward_backward and
    # optim_step on a throwaway adapter) less vllm_memory_margin_gib, logged at start (worker/vllm_runtime/
    # memory_share.py); 0.5 where no trainer shares the process (the Ray runtime's engine replicas). A number: that.
    vllm_gpu_memory_utilization: float | Literal["auto"] = "auto"
    # auto's allowance beyond the measured peak: the allocator's fragmentation, other models' adapters and optimizer
    # states, what vLLM's own estimate of its share misses.
    vllm_memory_margin_gib: float = Field(2.0, ge=0.0)
    # vLLM's sleep mode around training: before a forward / forward_backward the engine gives back its KV cache and
    # its weights (to host memory, level 1), and takes them back before its next sample or sync. One base per worker
    # (vLLM's allocator serves one engine a process); GPU only; costs a copy of the weights each way.
    vllm_sleep_during_training: bool = False
    # One copy of a base on the device: the in-process trainer's base weights are views of the vLLM engine's (LoRA
    # sync never changes them; worker/vllm_runtime/shared_base.py). Off, or where the engine writes or moves its base
    # (merged sync, sleep mode, tensor parallelism) or lives in other processes (Ray replicas), each holds its own.
    vllm_share_base: bool = True
    vllm_cpu_kv_cache_gib: float = Field(1.0, gt=0.0)
    # vLLM's tensor parallelism: each engine spreads its base over this many devices (workers of vLLM's own
    # multiprocessing executor), for a base whose weights and KV cache do not fit one GPU. The in-process worker's
    # engines take GPUs 0..k-1 beside its trainer on GPU 0; a Ray replica takes the GPUs of k bundles of one node; on
    # the CPU the workers split the cores.
    vllm_tensor_parallel_size: int = Field(1, ge=1)
    # None: CUDA graphs on a GPU (3.7-9x the tokens/s of eager on the H200; capturing them slows start-up),
    # eager on the CPU.
    vllm_enforce_eager: bool | None = None
    # Tokens per pass through the trainer's model (gradients accumulate over passes); 0: the trainer's default
    # (16384). The Ray runtime's data-parallel ranks split a forward_backward along these same passes.
    train_micro_batch_tokens: int = Field(0, ge=0)
    # Activation memory a trainer pass keeps whole, in GiB; the layers past it are checkpointed (run again in the
    # backward). 0: the trainer's default (15% of a GPU, at most 20 GiB; no checkpointing on the CPU). More buys
    # speed (fewer layers recomputed) at the memory the engine would have had.
    train_activation_gib: float = Field(0.0, ge=0.0)
    # torch's intra-op CPU threads in each process of the runtime (the in-process worker, each Ray actor); 0: as
    # torch (or Ray, 1 per actor) sets them. CPU kernels split their sums over threads, so equal counts give
    # bitwise-equal results across runtimes (tests/test_ray_runtime.py compares them).
    torch_threads: int = Field(0, ge=0)
    # One worker across many devices, on Ray (worker/ray_runtime): the bundles of its placement group (one GPU
    # each where the cluster has GPUs, else one CPU each); 0, with no ray_address, is the in-process runtime.
    ray_gpus: int = Field(0, ge=0)
    # Join this Ray cluster ("auto": the one this host is a node of; "head:6379"); empty: start a local one. Not
    # Ray Client (ray://): it cannot stream results from actors.
    ray_address: str = ""
    # The Ray namespace of this worker's actors, named engine-<i> and trainer-<i> in it (ray.get_actor finds
    # them: operators, the fault tests); empty: tinkerq-<host>-<pid>, one per worker process.
    ray_namespace: str = ""
    ray_engine_replicas: int = Field(0, ge=0, description="0: one per bundle")
    ray_trainer_ranks: int = Field(0, ge=0, description="0: one per bundle")
    ray_max_restarts: int = Field(16, ge=0, description="times Ray restarts a dead engine replica or trainer rank")
    ray_num_cpus: int = Field(0, ge=0, description="CPUs of a local Ray cluster; 0: the host's (at least the bundles)")
    # How a sync reaches the engine replicas: "group", broadcast from trainer rank 0 over a gloo group of their own
    # (worker/ray_runtime/weight_group.py); "object_store", a copy through Ray's object store that each replica reads.
    ray_weight_transport: WeightTransport = "group"
    # How trainer ranks hold a base: "none", whole on each rank (data parallel); "fsdp", each decoder layer's weights
    # sharded over the ranks (torch FSDP2), for a base that does not fit one device (worker/ray_runtime/sharding.py).
    ray_trainer_sharding: Literal["none", "fsdp"] = "none"
    # Test aid for the reference engine: simulated generation time per token.
    reference_delay_per_token_s: float = Field(0.0, ge=0.0)

    @field_validator("vllm_gpu_memory_utilization")
    @classmethod
    def _a_share(cls, value: float | str) -> float | str:
        if value != "auto" and not 0.0 < value <= 1.0:
            raise ValueError(f"vllm_gpu_memory_utilization must be auto or in (0, 1], not {value!r}")
        return value


class LimitsConfig(BaseSettings, Limits):
    """The deployment's `Limits`, from TINKERQ_MAX_* environment variables (schemas/ reads no environment)."""

    model_config = SettingsConfigDict(env_prefix="TINKERQ_", frozen=True)
