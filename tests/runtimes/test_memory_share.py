"""vLLM's share of the GPU sized from the trainer's measured need (TINKERQ_VLLM_GPU_MEMORY_UTILIZATION=auto), and the
trainer's dry run that measures it. The measurement itself reads CUDA memory (bench/gpu_rl_step.py runs it on a GPU);
here the arithmetic, the settings, the engine's choice between them, and the dry run's lack of side effects."""

import logging

import pytest
import torch
from pydantic import ValidationError

from schemas import AdamParams, CreateModelRequest, Datum, ForwardBackwardRequest, LoraConfig, OptimStepRequest
from tinkerq.config import RuntimeConfig
from worker.runtime import DomainError
from worker.runtime.reference import ReferenceEngine, ReferenceTrainer
from worker.runtime.versioned import Runtime
from worker.torch_runtime.base_models import BaseModels
from worker.torch_runtime.packed_forward import TrainOptions
from worker.torch_runtime.trainer import TorchTrainer
from worker.vllm_runtime import memory_share
from worker.vllm_runtime.memory_share import GIB, NoRoomForEngine, measured_share, plan_share

BASE = "tinyq-micro"


# -- the arithmetic ------------------------------------------------------------------------------------------------

def test_share_is_what_is_free_less_the_trainer_and_the_margin():
    plan = plan_share("b", total=100 * GIB, free=80 * GIB, trainer_peak=10 * GIB, margin=2 * GIB, budget_tokens=16384)
    assert plan.utilization == 0.68
    assert plan.engine_bytes == int(0.68 * 100 * GIB)
    # what vLLM asks for stays within what is free, and the trainer's peak and the margin stay free beside it
    assert plan.engine_bytes + plan.trainer_peak + plan.margin <= plan.free


def test_share_rounds_down_so_vllm_never_asks_for_more_than_is_free():
    total = 143_771_500_544  # an H200's
    free, peak, margin = 141_000_000_000, 15_123_456_789, 2 * GIB
    plan = plan_share("b", total, free, peak, margin, 16384)
    assert plan.utilization == pytest.approx((free - peak - margin) / total, abs=1e-4)
    assert plan.utilization <= (free - peak - margin) / total
    assert int(plan.utilization * 1e4) == plan.utilization * 1e4  # four decimals


def test_share_is_capped():
    assert plan_share("b", 100 * GIB, 100 * GIB, 0, 0, 1).utilization == memory_share.MAX_SHARE


def test_no_room_is_an_error_that_names_the_settings():
    with pytest.raises(NoRoomForEngine, match="TINKERQ_TRAIN_MICRO_BATCH_TOKENS"):
        plan_share("b", total=80 * GIB, free=12 * GIB, trainer_peak=11 * GIB, margin=2 * GIB, budget_tokens=16384)


def test_measured_share_measures_first_then_reads_the_device_and_logs_one_line(caplog):
    calls = []

    def measure():
        calls.append("measure")
        return 14 * GIB, 16384

    def mem_info():
        calls.append("mem_info")  # after the measure: the dry run's memory is handed back by then
        return 120 * GIB, 140 * GIB

    with caplog.at_level(logging.INFO, logger=memory_share.__name__):
        plan = measured_share("randq-0.5b", measure, mem_info, margin=2 * GIB)
    assert calls == ["measure", "mem_info"]
    assert plan.utilization == pytest.approx((120 - 14 - 2) / 140, abs=1e-4)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "randq-0.5b" in line and "trainer peak 14.00 GiB for 16384 tokens" in line and "margin 2.00 GiB" in line
    assert f"{plan.utilization:.4f}" in line


def test_after_start_says_what_the_trainer_has_and_warns_where_vllm_took_more_than_its_share():
    plan = plan_share("m", total=80 * GIB, free=77 * GIB, trainer_peak=22 * GIB, margin=2 * GIB, budget_tokens=16384)
    level, line = memory_share.after_start(plan, free=int(22.5 * GIB))
    assert level == logging.INFO and "22.50 GiB free for the trainer's peak of 22.00 GiB" in line
    level, line = memory_share.after_start(plan, free=21 * GIB)
    assert level == logging.WARNING
    assert "1.00 GiB short" in line and "16384 tokens" in line and "TINKERQ_VLLM_MEMORY_MARGIN_GIB" in line


def test_the_largest_peak_reserved_so_far_stays_reserved():
    """A second engine starts with the first one's share taken; the trainer trains one model at a time, so what
    must stay free is the larger of the two peaks, not the new one alone."""
    plan = measured_share("small", lambda: (3 * GIB, 16384), lambda: (50 * GIB, 100 * GIB), margin=0,
                          reserved=10 * GIB)
    assert plan.trainer_peak == 10 * GIB
    assert plan.utilization == 0.4


# -- the settings --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, parsed", [("auto", "auto"), ("0.5", 0.5), ("1", 1.0), ("0.125", 0.125)])
def test_utilization_setting_parses(monkeypatch, value, parsed):
    monkeypatch.setenv("TINKERQ_VLLM_GPU_MEMORY_UTILIZATION", value)
    assert RuntimeConfig().vllm_gpu_memory_utilization == parsed


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "half", ""])
def test_utilization_setting_refuses(monkeypatch, value):
    monkeypatch.setenv("TINKERQ_VLLM_GPU_MEMORY_UTILIZATION", value)
    with pytest.raises(ValidationError):
        RuntimeConfig()


def test_defaults(monkeypatch):
    for name in ("TINKERQ_VLLM_GPU_MEMORY_UTILIZATION", "TINKERQ_VLLM_MEMORY_MARGIN_GIB",
                 "TINKERQ_VLLM_SLEEP_DURING_TRAINING"):
        monkeypatch.delenv(name, raising=False)
    config = RuntimeConfig()
    assert (config.vllm_gpu_memory_utilization, config.vllm_memory_margin_gib,
            config.vllm_sleep_during_training) == ("auto", 2.0, False)


# -- the engine's choice -------------------------------------------------------------------------------------------

@pytest.fixture
def vllm_engine(tmp_path):
    pytest.importorskip("vllm")
    from worker.vllm_runtime.engine import VllmEngine

    def make(need=None, **settings):
        config = RuntimeConfig(runtime="torch", engine="vllm", device="cpu", checkpoint_root=str(tmp_path), **settings)
        return VllmEngine(config, trainer_need=need)
    return make


def test_engine_passes_an_explicit_share_without_measuring(vllm_engine):
    def need(base):
        raise AssertionError("an explicit share measures nothing")
    assert vllm_engine(need, vllm_gpu_memory_utilization=0.3)._share(BASE) == 0.3


def test_engine_without_a_trainer_takes_half(vllm_engine):
    assert vllm_engine(None)._share(BASE) == memory_share.NO_TRAINER_SHARE


def test_engine_auto_measures_each_base_and_keeps_the_largest_peak_reserved(vllm_engine, monkeypatch):
    peaks = {"big": 20 * GIB, "small": 4 * GIB}
    free = iter([100 * GIB, 60 * GIB])  # the second engine starts beside the first one's share
    monkeypatch.setattr(memory_share, "cuda_mem_info", lambda device: (next(free), 140 * GIB))
    engine = vllm_engine(lambda base: (peaks[base], 8192), vllm_memory_margin_gib=1.0)
    assert engine._share("big") == pytest.approx((100 - 20 - 1) / 140, abs=1e-4)
    assert engine._share("small") == pytest.approx((60 - 20 - 1) / 140, abs=1e-4)
    assert [p.trainer_peak for p in engine.memory_plans.values()] == [20 * GIB, 20 * GIB]


def test_sleep_mode_is_off_on_the_cpu_and_serves_one_base(vllm_engine):
    engine = vllm_engine(vllm_sleep_during_training=True)
    assert not engine.sleep_mode  # vLLM's sleep mode is CUDA only: on the CPU nothing changes
    engine.make_room()
    assert not engine.asleep
    engine.sleep_mode, engine.llms = True, {BASE: object()}  # as on a GPU with one engine started
    engine._check_new_base(BASE)
    with pytest.raises(DomainError, match="sleep mode"):
        engine.check_create(CreateModelRequest(model_id="m:train:0", base_model="tinyq-small",
                                               lora=LoraConfig(rank=8)))


# -- the runtime lends the engine's memory to forward passes only ----------------------------------------------

class CountingEngine(ReferenceEngine):
    def __init__(self):
        super().__init__(max_snapshots=4)
        self.rooms = 0

    def make_room(self):
        self.rooms += 1


def test_runtime_makes_room_before_forward_passes_only(tmp_path):
    from schemas import ForwardRequest, WeightSyncRequest

    engine = CountingEngine()
    rt = Runtime(ReferenceTrainer(tmp_path), engine)
    rt.execute(CreateModelRequest(model_id="m:train:0", base_model="ref", lora=LoraConfig(rank=4)))
    data = [Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2.0, 3.0, 4.0]})]
    rt.execute(ForwardBackwardRequest(model_id="m:train:0", data=data))
    rt.execute(ForwardRequest(model_id="m:train:0", data=data))
    assert engine.rooms == 2
    rt.execute(OptimStepRequest(model_id="m:train:0", adam_params=AdamParams()))
    rt.execute(WeightSyncRequest(model_id="m:train:0", version=1))
    assert engine.rooms == 2
    with pytest.raises(DomainError):  # an unknown model: nothing is put to sleep for it
        rt.execute(ForwardBackwardRequest(model_id="x:train:0", data=data))
    assert engine.rooms == 2


# -- the trainer's dry run -----------------------------------------------------------------------------------------

def fb(trainer: TorchTrainer, model_id: str) -> tuple[float, dict[str, torch.Tensor]]:
    data = [Datum(model_input=[5, 6, 7, 8, 9], loss_fn_inputs={"target_tokens": [6.0, 7.0, 8.0, 9.0, 10.0]})]
    out = trainer.forward(ForwardBackwardRequest(model_id=model_id, data=data), backward=True)
    grads = {n: p.grad.clone() for n, p in trainer.models[model_id].base.model.named_parameters()
             if p.grad is not None}
    return out.metrics["loss:sum"], grads


def test_dry_run_trains_a_full_pass_and_leaves_nothing_behind(tmp_path):
    def trainer():
        return TorchTrainer(BaseModels("cpu", "float32"), tmp_path, TrainOptions(micro_batch_tokens=300))

    create = CreateModelRequest(model_id="m:train:0", base_model=BASE, lora=LoraConfig(rank=4, seed=1))
    plain = trainer()
    plain.create_model(create)
    expected = fb(plain, "m:train:0")

    probed = trainer()
    probed.create_model(create)
    adapters = set(probed.bases.get(BASE).adapters)
    rng = torch.get_rng_state()
    assert probed.dry_run(BASE, rank=16) == 300
    assert torch.equal(torch.get_rng_state(), rng)
    assert set(probed.models) == {"m:train:0"}
    assert probed.bases.get(BASE).adapters == adapters
    assert all(p.grad is None for p in probed.models["m:train:0"].params)
    loss, grads = fb(probed, "m:train:0")  # the model trains exactly as if the dry run never happened
    assert loss == expected[0]
    assert grads.keys() == expected[1].keys() and all(torch.equal(grads[k], expected[1][k]) for k in grads)


def test_dry_run_loads_a_base_the_trainer_had_not(tmp_path):
    trainer = TorchTrainer(BaseModels("cpu", "float32"), tmp_path, TrainOptions(micro_batch_tokens=64))
    assert trainer.bases.loaded(BASE) is None
    assert trainer.dry_run(BASE, rank=4) == 64
    assert trainer.bases.loaded(BASE) is not None and not trainer.models


def test_peak_training_bytes_is_cuda_only(tmp_path):
    trainer = TorchTrainer(BaseModels("cpu", "float32"), tmp_path, TrainOptions(micro_batch_tokens=64))
    with pytest.raises(ValueError, match="CUDA"):
        trainer.peak_training_bytes(BASE, rank=4)
