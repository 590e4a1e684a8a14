"""The trainer's lean forward/backward against the straightforward computation, in float32 on the CPU, to 1e-5.

Straightforward: each datum alone through `model(input_ids).logits`, float32, log_softmax, gather, the loss of
`losses.elementwise_loss`, summed, one backward. Ours packs the datums into micro-batches, runs the
unembedding in chunks and checkpoints layers; every output and every adapter gradient (LoRA on attention, MLP
and the unembedding, randomised so each one matters) must be the same, for every loss function, on a batch of
uneven lengths, for an untied and a tied-embedding model.
"""

import tempfile
from pathlib import Path

import pytest
import torch

from schemas import CreateModelRequest, Datum, ForwardBackwardRequest, ForwardRequest, LoraConfig
from schemas.requests import STABLE_LOGPROBS, STABLE_MASK
from worker.runtime.base import DomainError
from worker.torch_runtime import losses
from worker.torch_runtime.base_models import BaseModels
from worker.torch_runtime.packed_forward import TrainOptions
from worker.torch_runtime.packing import flatten, plan
from worker.torch_runtime.trainer import TorchTrainer

LENGTHS = [5, 17, 1, 9, 30, 12]  # uneven, one a single token
VOCAB = 2048  # both tiny models'
OPTIONS = {
    "one pass": TrainOptions(),
    "chunked unembedding": TrainOptions(logits_chunk_elements=7 * VOCAB),  # 7 tokens a chunk, datums up to 30
    "micro-batches": TrainOptions(micro_batch_tokens=20),  # 5 passes, gradients accumulated
    "checkpointed": TrainOptions(activation_budget_bytes=0),  # every layer recomputed in the backward
    "autograd's LoRA": TrainOptions(lora_function=False),  # peft's layers through addmm, not lora_compute's function
    "all at once": TrainOptions(micro_batch_tokens=20, logits_chunk_elements=7 * VOCAB, activation_budget_bytes=0),
}


@pytest.fixture(scope="module")
def trainer():
    return TorchTrainer(BaseModels("cpu", "float32"), Path(tempfile.mkdtemp(prefix="packed-fwd-")))


@pytest.fixture(scope="module")
def models(trainer):
    """One model per base, LoRA on attention, MLP and unembedding, its weights random (B is zero at creation)."""
    out = {}
    for i, base in enumerate(["tinyq-micro", "tinyq-tied"]):
        model_id = f"packed{i}:train:0"
        trainer.create_model(CreateModelRequest(model_id=model_id, base_model=base, lora=LoraConfig(rank=4, seed=i)))
        torch.manual_seed(100 + i)
        with torch.no_grad():
            for p in params(trainer, model_id):
                p.normal_(0.0, 0.05)
        assert any("lm_head" in n for n, _ in adapter_params(trainer, model_id))
        out[base] = model_id
    return out


def params(trainer, model_id) -> list[torch.nn.Parameter]:
    return trainer.models[model_id].optimizer.param_groups[0]["params"]


def adapter_params(trainer, model_id):
    trained = trainer.models[model_id]
    return [(n, p) for n, p in trained.base.model.named_parameters() if f".{trained.adapter}." in n]


def straightforward(trainer, model_id, request):
    """Per datum: logprobs, elementwise loss; the total; every adapter gradient."""
    trained = trainer.models[model_id]
    model = trained.base.model
    model.set_adapter(trained.adapter)
    zero(trainer, model_id)
    total, logprobs, elementwise = 0.0, [], []
    for d in request.data:
        logits = model(input_ids=torch.as_tensor(d.model_input)[None]).logits.float()[0]
        targets = torch.tensor(d.loss_fn_inputs["target_tokens"]).long()
        p = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        inputs = {k: torch.tensor(v) for k, v in d.loss_fn_inputs.items() if k != "target_tokens"}
        e = losses.elementwise_loss(request.loss_fn, p, inputs, request.loss_fn_config)
        total = total + e.sum()
        logprobs.append(p.tolist())
        elementwise.append(e.tolist())
    if request.kind == "forward_backward":
        total.backward()
    grads = grads_of(trainer, model_id)
    zero(trainer, model_id)
    return logprobs, elementwise, float(total), grads


def grads_of(trainer, model_id):
    return {n: None if p.grad is None else p.grad.clone() for n, p in adapter_params(trainer, model_id)}


def zero(trainer, model_id):
    for p in params(trainer, model_id):
        p.grad = None


def batch(trainer, model_id, loss_fn, lengths=LENGTHS, seed=0, kind=ForwardBackwardRequest):
    """Random tokens; sampler logprobs near the model's own (so PPO/CISPO clip some tokens), mixed advantages."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for n in lengths:
        tokens = torch.randint(0, VOCAB, (n + 1,), generator=g).tolist()
        data.append(Datum(model_input=tokens[:-1], loss_fn_inputs={
            "target_tokens": [float(t) for t in tokens[1:]],
            "weights": torch.rand(n, generator=g).tolist(),
            "advantages": torch.randn(n, generator=g).tolist()}))
    probe = ForwardRequest(model_id=model_id, data=data)
    own, _, _, _ = straightforward(trainer, model_id, probe)
    for d, p in zip(data, own):
        d.loss_fn_inputs["logprobs"] = (torch.tensor(p) + 0.3 * torch.randn(len(p), generator=g)).tolist()
        # gspo's sequence ratio mask and stable_reinforce's sampled mask / recorded logprobs (what the API fills)
        mask = (torch.rand(len(p), generator=g) > 0.3).float().tolist()
        d.loss_fn_inputs.update({"sequence_ratio_mask": mask, STABLE_MASK: mask,
                                 STABLE_LOGPROBS: d.loss_fn_inputs["logprobs"]})
    config = {"beta": 0.1} if loss_fn == "dro" else {}
    return kind(model_id=model_id, data=data, loss_fn=loss_fn, loss_fn_config=config)


def assert_close(ours, ref, what):
    ours, ref = torch.as_tensor(ours, dtype=torch.float32), torch.as_tensor(ref, dtype=torch.float32)
    scale = max(1.0, float(ref.abs().max()))
    diff = float((ours - ref).abs().max())
    assert diff <= 1e-5 * scale, f"{what}: max |ours - straightforward| = {diff:.3g} (scale {scale:.3g})"


def check_against_straightforward(trainer, model_id, request, backward=True):
    logprobs, elementwise, total, grads = straightforward(trainer, model_id, request)
    zero(trainer, model_id)
    out = trainer.forward(request, backward)
    for i, (o, lp, el) in enumerate(zip(out.loss_fn_outputs, logprobs, elementwise, strict=True)):
        assert len(o["logprobs"]) == len(lp)
        assert_close(o["logprobs"], lp, f"data[{i}] logprobs")
        assert_close(o["elementwise_loss"], el, f"data[{i}] elementwise_loss")
    assert_close([out.metrics["loss:sum"]], [total], "loss:sum")
    ours = grads_of(trainer, model_id)
    if backward:
        for name, ref in grads.items():
            assert ref is not None and float(ref.abs().max()) > 0, f"{name}: no gradient in the reference"
            assert ours[name] is not None, f"{name}: no gradient"
            assert_close(ours[name], ref, name)
    else:
        assert all(g is None for g in ours.values())
    zero(trainer, model_id)


@pytest.mark.parametrize("option", ["one pass", "all at once"])
@pytest.mark.parametrize("base", ["tinyq-micro", "tinyq-tied"])
@pytest.mark.parametrize("loss_fn", list(losses.LOSSES))
def test_every_loss_gives_the_outputs_and_gradients_of_the_straightforward_computation(trainer, models, loss_fn,
                                                                                        base, option):
    trainer.options = OPTIONS[option]
    check_against_straightforward(trainer, models[base], batch(trainer, models[base], loss_fn))


@pytest.mark.parametrize("option", ["chunked unembedding", "micro-batches", "checkpointed", "autograd's LoRA"])
@pytest.mark.parametrize("base", ["tinyq-micro", "tinyq-tied"])
def test_each_means_alone_gives_the_straightforward_computation(trainer, models, base, option):
    trainer.options = OPTIONS[option]
    check_against_straightforward(trainer, models[base], batch(trainer, models[base], "importance_sampling"))


@pytest.mark.parametrize("option", ["one pass", "all at once"])
def test_forward_alone_gives_the_same_outputs_and_no_gradient(trainer, models, option):
    trainer.options = OPTIONS[option]
    model = models["tinyq-micro"]
    check_against_straightforward(trainer, model, batch(trainer, model, "ppo", kind=ForwardRequest), backward=False)


def test_calls_accumulate_gradients_until_a_step(trainer, models):
    trainer.options = OPTIONS["micro-batches"]
    model = models["tinyq-tied"]
    first, second = batch(trainer, model, "importance_sampling", seed=1), batch(trainer, model, "cross_entropy", seed=2)
    refs = [straightforward(trainer, model, r)[3] for r in (first, second)]
    trainer.forward(first, True)
    trainer.forward(second, True)
    ours = grads_of(trainer, model)
    for name in ours:
        assert_close(ours[name], refs[0][name] + refs[1][name], name)
    zero(trainer, model)


def test_a_call_failing_in_a_later_micro_batch_leaves_earlier_gradients_as_they_were(trainer, models):
    trainer.options = OPTIONS["micro-batches"]
    model = models["tinyq-micro"]
    good, bad = (batch(trainer, model, "importance_sampling", seed=s) for s in (3, 4))
    del bad.data[-1].loss_fn_inputs["advantages"]  # the last datum is alone in the last of 5 passes
    trainer.forward(good, True)
    before = grads_of(trainer, model)
    with pytest.raises(DomainError, match="advantages"):
        trainer.forward(bad, True)
    after = grads_of(trainer, model)
    for name in before:
        assert torch.equal(after[name], before[name]), name
    zero(trainer, model)


@pytest.mark.parametrize("budget, runs_per_pass", [(float("inf"), 1), (0, 2)])
def test_the_activation_budget_decides_which_layers_run_again_in_the_backward(trainer, models, budget, runs_per_pass,
                                                                            monkeypatch):
    trainer.options = TrainOptions(micro_batch_tokens=20, activation_budget_bytes=budget)
    model = models["tinyq-micro"]
    decoder = trainer.models[model].base.model.get_base_model().get_decoder()
    request = batch(trainer, model, "cross_entropy")
    runs = []
    for i, layer in enumerate(decoder.layers):  # count each layer's forward runs (a recompute is one more)
        monkeypatch.setattr(layer, "forward", lambda *a, i=i, f=layer.forward, **k: runs.append(i) or f(*a, **k))
    trainer.forward(request, True)
    zero(trainer, model)
    passes = len(plan(LENGTHS, 20))
    assert runs.count(0) == runs.count(1) == passes * runs_per_pass


def test_micro_batches_are_whole_datums_up_to_the_budget():
    assert plan([5, 17, 1, 9, 30, 12], 20) == [(0, 1), (1, 3), (3, 4), (4, 5), (5, 6)]
    assert plan([5, 17, 1, 9, 30, 12], 10**6) == [(0, 6)]
    assert plan([3, 3, 3], 6) == [(0, 2), (2, 3)]


def test_datums_become_the_tensors_torch_tensor_makes_of_their_lists():
    """flatten reads the lists with numpy (faster than torch.tensor of a list): the same values, the same float32
    rounding of inputs, the same truncation of float target tokens."""
    data = [Datum(model_input=[0, 7, 2047], loss_fn_inputs={"target_tokens": [7.0, 2047.9, 3.0],
                                                             "weights": [0.1, 1 / 3, 1e-40]}),
            Datum(model_input=[5], loss_fn_inputs={"target_tokens": [1.0], "advantages": [-2.5]})]
    flat = flatten(data, 2048, torch.device("cpu"))
    assert torch.equal(flat.tokens, torch.tensor([0, 7, 2047, 5], dtype=torch.long))
    assert torch.equal(flat.targets, torch.tensor([7.0, 2047.9, 3.0, 1.0], dtype=torch.float64).long())
    assert torch.equal(flat.inputs["weights"].values, torch.tensor([0.1, 1 / 3, 1e-40], dtype=torch.float32))
    assert flat.inputs["weights"].starts == {0: 0} and flat.inputs["advantages"].starts == {1: 0}
    assert flat.inputs["advantages"].values.dtype == torch.float32
    with pytest.raises(DomainError, match="outside"):
        flatten([Datum(model_input=[1, 2048], loss_fn_inputs={"target_tokens": [2.0, 3.0]})], 2048, torch.device("cpu"))


@pytest.mark.parametrize("loss_fn, calls", [("importance_sampling", 1), ("gspo", len(LENGTHS))])
def test_a_per_token_loss_is_one_call_over_the_micro_batch(trainer, models, loss_fn, calls, monkeypatch):
    """No per-datum ops on the hot path where the loss is per token; gspo (a mean per sequence) goes datum by datum."""
    trainer.options = OPTIONS["one pass"]
    model = models["tinyq-micro"]
    request = batch(trainer, model, loss_fn)
    seen = []
    real = losses.elementwise_loss
    monkeypatch.setattr(losses, "elementwise_loss", lambda *a: seen.append(len(a[1])) or real(*a))
    trainer.forward(request, True)
    zero(trainer, model)
    assert len(seen) == calls and sum(seen) == sum(LENGTHS)


def test_the_activation_budget_and_pass_size_come_from_the_environment(monkeypatch, tmp_path):
    from tinkerq.config import RuntimeConfig
    from worker.torch_runtime.assembly import make_trainer

    monkeypatch.setenv("TINKERQ_TRAIN_ACTIVATION_GIB", "1.5")
    monkeypatch.setenv("TINKERQ_TRAIN_MICRO_BATCH_TOKENS", "4096")
    options = make_trainer(RuntimeConfig(checkpoint_root=str(tmp_path)), BaseModels("cpu", "float32")).options
    assert options.activation_budget_bytes == 1.5 * 2**30 and options.micro_batch_tokens == 4096
    monkeypatch.delenv("TINKERQ_TRAIN_ACTIVATION_GIB")
    default = make_trainer(RuntimeConfig(checkpoint_root=str(tmp_path)), BaseModels("cpu", "float32")).options
    assert default.activation_budget_bytes == TrainOptions.for_device(torch.device("cpu")).activation_budget_bytes


def test_the_default_activation_budget_is_a_share_of_the_gpu_capped():
    from worker.torch_runtime.packed_forward import activation_budget

    h100, h200 = 81559 * 2**20, 143771 * 2**20  # what torch reports of each card
    assert activation_budget(h100) == 0.15 * h100 and round(activation_budget(h100) / 2**30, 1) == 11.9
    assert activation_budget(h200) == 20 * 2**30  # the cap
    assert activation_budget(24 * 2**30) == 0.15 * 24 * 2**30
