"""Custom losses as the SDK uploads them: traced and encoded by the SDK's own code, sent through JSON,
rebuilt by worker.torch_runtime.custom_loss and run against the Python function and the SDK's
client-side reference (run_loss_handle); forged graphs are refused."""

import copy
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from tinker import types
from tinker._compat import model_dump
from tinker.lib.public_interfaces.custom_loss import encode_graph, run_loss_handle, trace_loss
from torch.fx.node import _get_qualified_name

from schemas import (
    CreateCustomLossRequest,
    CreateModelRequest,
    CustomLoss,
    Datum,
    ErrorResponse,
    ForwardBackwardRequest,
    LoraConfig,
)
from schemas.ids import losses_model_id
from tinkerq.config import RuntimeConfig
from worker.runtime import DomainError
from worker.runtime.registry import build_runtime
from worker.torch_runtime import custom_loss
from worker.torch_runtime.custom_loss import CustomLossError, compile_loss, run_loss_batch

T, K = 6, 4


def wire(fn, ranks):
    """What `ServiceClient.create_custom_loss` sends: trace_loss, encode_graph, CreateCustomLossRequest
    serialized as `resources/service.py` does, through JSON; returns (handle, body)."""
    handle = trace_loss(fn, ranks, "session")
    request = types.CreateCustomLossRequest(
        session_id="session", custom_loss_seq_id=0, name=handle.name, inputs=list(handle.inputs),
        graph=encode_graph(handle),
    )
    body = json.loads(json.dumps(model_dump(request, exclude_unset=False, exclude_none=True, mode="json")))
    return handle, body


def compiled(fn, ranks):
    _, body = wire(fn, ranks)
    return compile_loss(body["graph"], body["inputs"])


# ---- real losses ---------------------------------------------------------------------------------------


def neg_ll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def ppo(logprobs, old_logprobs, advantages):
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    clip_fraction = ((ratio > 1.2) | (ratio < 0.8)).float().mean()
    return loss, {"custom/ppo/clip_fraction:mean": clip_fraction, "custom/ppo/ratio:mean": ratio.detach().mean()}


def distill(logprobs, teacher_logits, weights):
    """Rank-2 [T, K]: cross-entropy against the teacher's softmax, plus a log-softmax KL term."""
    teacher = F.softmax(teacher_logits, dim=-1)
    ce = -(teacher * logprobs).sum(dim=-1)
    kl = (teacher * (F.log_softmax(teacher_logits, dim=-1) - torch.log_softmax(logprobs, -1))).sum(-1)
    loss = ((ce + kl) * weights).sum() + 0.1 * torch.logsumexp(logprobs, dim=-1).mean()
    return loss, {"custom/kl:mean": kl.mean(), "custom/teacher_max:sum": teacher.max(dim=-1).values.sum()}


def length_normalized(logprobs, weights):
    """Shape via getattr, new_full with inf, sum over a dim tuple with a dtype, clamp(max=)."""
    n = getattr(logprobs, "shape")[0]  # noqa: B009 - the traced graph is to hold a getattr node
    nll = -(logprobs * weights).sum(dim=(0,), dtype=torch.float32) / n
    floor = logprobs.new_full((), float("-inf"))
    loss = torch.maximum(nll, floor).clamp(max=100.0)
    return loss, {"custom/tokens:sum": weights.to(torch.float64).sum(), "custom/nll:mean": nll.detach()}


def sequence_advantage(logprobs, advantage, mask):
    """A rank-0 input, slicing with a computed bound, None/Ellipsis indexing, a boolean mask, where."""
    shifted = logprobs[1 : logprobs.size(0)] - logprobs[: logprobs.shape[0] - 1]
    picked = logprobs[mask > 0]
    safe = torch.where(mask > 0, logprobs, torch.zeros_like(logprobs, device=logprobs.device))
    expanded = logprobs[..., None][:, 0]
    loss = -(safe * advantage).sum() + 0.01 * (shifted**2).sum() + 0 * expanded.sum() - picked.mean()
    return loss, {"custom/picked:sum": picked.sum().detach()}


def batch(ranks, n=3, seed=0):
    """n datums of random inputs at the given ranks; logprobs are negative, as log-probabilities are."""
    g = torch.Generator().manual_seed(seed)
    shapes = {0: (), 1: (T,), 2: (T, K)}
    out = []
    for _ in range(n):
        datum = {name: torch.randn(shapes[rank], generator=g) for name, rank in ranks.items()}
        datum["logprobs"] = -datum["logprobs"].abs()
        out.append(datum)
    if "mask" in ranks:
        for datum in out:
            datum["mask"] = (torch.arange(T) % 2).float()
    return out


CASES = [
    (neg_ll, {"logprobs": 1, "weights": 1}),
    (ppo, {"logprobs": 1, "old_logprobs": 1, "advantages": 1}),
    (distill, {"logprobs": 2, "teacher_logits": 2, "weights": 1}),
    (length_normalized, {"logprobs": 1, "weights": 1}),
    (sequence_advantage, {"logprobs": 1, "advantage": 0, "mask": 1}),
]


@pytest.mark.parametrize("fn,ranks", CASES, ids=[fn.__name__ for fn, _ in CASES])
def test_compiled_loss_matches_the_python_function(fn, ranks):
    loss = compiled(fn, ranks)
    for datum in batch(ranks):
        names = list(ranks)[1:]
        ours = datum["logprobs"].clone().requires_grad_(True)
        theirs = datum["logprobs"].clone().requires_grad_(True)
        got, got_metrics = loss(ours, *(datum[n] for n in names))
        want, want_metrics = fn(theirs, *(datum[n] for n in names))
        got.backward()
        want.backward()
        assert got.ndim == 0 and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert got_metrics.keys() == want_metrics.keys()
        for key in want_metrics:
            torch.testing.assert_close(got_metrics[key], want_metrics[key], rtol=1e-6, atol=1e-6)
        assert ours.grad is not None and ours.grad.abs().sum() > 0
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-6)


def sdk_datums(data, ranks):
    """The same batch as the SDK's Datum, for its client-side run_loss_handle."""
    out = []
    for datum in data:
        inputs = {name: types.TensorData.from_torch(datum[name]) for name in list(ranks)[1:]}
        tokens = torch.zeros(datum["logprobs"].shape, dtype=torch.int64)
        inputs["target_tokens"] = types.TensorData.from_torch(tokens)
        out.append(types.Datum(model_input=types.ModelInput.from_ints([1] * T), loss_fn_inputs=inputs))
    return out


@pytest.mark.parametrize("fn,ranks", CASES, ids=[fn.__name__ for fn, _ in CASES])
def test_batch_matches_the_sdks_client_side_reference(fn, ranks):
    handle, body = wire(fn, ranks)
    loss = compile_loss(body["graph"], body["inputs"])
    data = batch(ranks, n=4, seed=1)
    ours = [d["logprobs"].clone().requires_grad_(True) for d in data]
    theirs = [d["logprobs"].clone().requires_grad_(True) for d in data]
    got, got_metrics = run_loss_batch(loss, ours, data)
    want, want_metrics = run_loss_handle(handle, sdk_datums(data, ranks), theirs)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got_metrics == pytest.approx(want_metrics, rel=1e-6, abs=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_batch_sums_losses_and_metrics_and_averages_mean_metrics():
    def counts(logprobs, weights):
        return logprobs.sum(), {"custom/one:sum": weights.sum(), "custom/one:mean": weights.sum()}

    loss = compiled(counts, {"logprobs": 1, "weights": 1})
    logprobs = [torch.full((T,), -1.0), torch.full((T,), -2.0), torch.full((T,), -3.0)]
    inputs = [{"weights": torch.full((T,), float(i))} for i in (1, 2, 3)]
    total, metrics = run_loss_batch(loss, logprobs, inputs)
    assert total.item() == pytest.approx(-6.0 * T)
    assert metrics == pytest.approx({"custom/one:sum": 6.0 * T, "custom/one:mean": 2.0 * T})


def test_a_missing_input_names_the_datum_and_key():
    loss = compiled(neg_ll, {"logprobs": 1, "weights": 1})
    with pytest.raises(CustomLossError, match=r"datum\[1\].*weights"):
        run_loss_batch(loss, [torch.zeros(T), torch.zeros(T)], [{"weights": torch.ones(T)}, {}])


def test_the_function_table_is_spelled_as_the_sdk_sends_it():
    for target, op in custom_loss._FUNCTIONS.items():
        if target != "getattr":
            assert _get_qualified_name(op.fn).replace("_operator.", "operator.", 1) == target


# ---- refusals ------------------------------------------------------------------------------------------


def neg_ll_body():
    return wire(neg_ll, {"logprobs": 1, "weights": 1})[1]


def forged(**node):
    """neg_ll's request with its graph cut to its inputs and one forged node, which it returns as its loss."""
    body = neg_ll_body()
    nodes = body["graph"]["nodes"]
    node = {"op": "call_function", "name": "evil", "args": [], "kwargs": {}, **node}
    output = dict(nodes[-1], args=[{"tuple": [{"ref": "evil"}, {"dict": {}}]}])
    body["graph"]["nodes"] = [n for n in nodes if n["op"] == "placeholder"] + [node, output]
    return body


def refused(body, match):
    with pytest.raises(CustomLossError, match=match):
        compile_loss(body["graph"], body["inputs"])


@pytest.mark.parametrize(
    "target,args",
    [
        ("os.system", ["touch /tmp/pwned"]),
        ("builtins.eval", ["__import__('os')"]),
        ("eval", ["1"]),
        ("torch.load", ["/tmp/x.pt"]),
        ("torch.save", [{"ref": "logprobs"}, "/tmp/x.pt"]),
        ("subprocess.run", [["ls"]]),
        ("operator.setitem", [{"ref": "logprobs"}, 0, 1.0]),
        ("operator.iadd", [{"ref": "logprobs"}, 1.0]),
        ("torch.gather", [{"ref": "logprobs"}, 0, {"ref": "weights"}]),
        ("torch.Tensor.backward", [{"ref": "logprobs"}]),
    ],
)
def test_functions_outside_the_table_are_refused(target, args):
    refused(forged(target=target, args=args), rf"node 'evil'.*function '{target}' is not allowed")


@pytest.mark.parametrize("method", ["backward", "numpy", "tolist", "item", "add_", "cuda", "__reduce__", "data_ptr"])
def test_methods_outside_the_table_are_refused(method):
    refused(forged(op="call_method", target=method, args=[{"ref": "logprobs"}]), f"method '{method}' is not allowed")


@pytest.mark.parametrize("op,target", [("call_module", "linear"), ("get_attr", "weight"), ("eval", "x")])
def test_call_module_get_attr_and_unknown_ops_are_refused(op, target):
    refused(forged(op=op, target=target), f"node 'evil'.*{op} nodes are refused")


@pytest.mark.parametrize("name", ["__class__", "__globals__", "__dict__", "grad_fn", "data", "_base"])
def test_getattr_of_other_attributes_is_refused(name):
    refused(forged(target="getattr", args=[{"ref": "logprobs"}, name]), r"node 'evil'.*getattr may only read")


def test_getattr_needs_a_literal_name():
    refused(forged(target="getattr", args=[{"ref": "logprobs"}, {"ref": "weights"}]), "getattr may only read")


def test_nothing_from_the_graph_is_imported(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "tinkerq_evil_marker.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef run(): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    attempts = [
        forged(target="tinkerq_evil_marker.run"),
        forged(target="tinkerq_evil_marker"),
        forged(op="call_method", target="tinkerq_evil_marker.run", args=[{"ref": "logprobs"}]),
        forged(target="torch.exp", args=[{"ref": "logprobs"}], kwargs={"dtype": {"dtype": "tinkerq_evil_marker"}}),
        forged(target="torch.exp", args=[{"ref": "logprobs"}], kwargs={"x": {"tinkerq_evil_marker.run": []}}),
        forged(target="getattr", args=[{"ref": "logprobs"}, "tinkerq_evil_marker"]),
    ]
    for body in attempts:
        with pytest.raises(CustomLossError):
            compile_loss(body["graph"], body["inputs"])
    assert not marker.exists() and "tinkerq_evil_marker" not in sys.modules
    __import__("tinkerq_evil_marker")  # the marker does show an import: this test can fail
    assert marker.exists()
    monkeypatch.delitem(sys.modules, "tinkerq_evil_marker")


def test_references_must_be_to_earlier_nodes():
    body = neg_ll_body()
    nodes = body["graph"]["nodes"]
    mul = next(n for n in nodes if n["name"] == "mul")
    for ref in ("mul", "neg", "nowhere"):  # itself (a cycle), a later node, no node
        cyclic = copy.deepcopy(body)
        next(n for n in cyclic["graph"]["nodes"] if n["name"] == "mul")["args"][1] = {"ref": ref}
        refused(cyclic, rf"node 'mul'.*refers to '{ref}', which is not an earlier node")
    assert mul["args"][1] == {"ref": "weights"}
    output_ref = copy.deepcopy(body)
    output_ref["graph"]["nodes"][-1]["args"] = [{"tuple": [{"ref": "ghost"}, {"dict": {}}]}]
    refused(output_ref, "refers to 'ghost'")


def mutate(edit):
    body = neg_ll_body()
    edit(body)
    return body


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda b: b["graph"]["nodes"][2].pop("op"), r"nodes\[2\] must be"),
        (lambda b: b["graph"]["nodes"][2].update(extra=1), r"nodes\[2\] must be"),
        (lambda b: b["graph"]["nodes"][2].update(name="a b"), "invalid name"),
        (lambda b: b["graph"]["nodes"][2].update(args={"ref": "logprobs"}), "args a list"),
        (lambda b: b["graph"]["nodes"][3].update(name="mul"), "used twice"),
        (lambda b: b["graph"]["nodes"].append(dict(b["graph"]["nodes"][2], name="late")), "after the output"),
        (lambda b: b["graph"]["nodes"].pop(), "no output node"),
        (lambda b: b["graph"].update(format=2), "format"),
        (lambda b: b["graph"].update(nodes=[]), "no nodes"),
        (lambda b: b["graph"]["nodes"].pop(1), "inputs must be"),
        (lambda b: b["graph"]["nodes"][1].update(target="advantages"), "inputs must be"),
        (lambda b: b["graph"]["nodes"][2]["args"].append({"lambda": "x"}), "cannot decode argument"),
        (lambda b: b["graph"]["nodes"][2]["args"].append({"ref": "logprobs", "tuple": []}), "cannot decode"),
        (lambda b: b["graph"]["nodes"][2]["args"].append(10**30), "out of range"),
        (lambda b: b["graph"]["nodes"][2]["kwargs"].update(x={"device": "cuda:3"}), "literal device"),
        (lambda b: b["graph"]["nodes"][2]["kwargs"].update(x={"float": "1e999"}), "cannot decode"),
        (lambda b: b["graph"]["nodes"][2]["kwargs"].update(out={"ref": "weights"}), "out= and inplace"),
        (lambda b: b["graph"]["nodes"][2]["kwargs"].update(inplace=True), "out= and inplace"),
        (lambda b: b["graph"]["nodes"][2]["args"].append(json.loads("[" * 20 + "]" * 20)), "nest deeper"),
        (lambda b: b["graph"]["nodes"][-1].update(args=[{"ref": "neg"}]), r"must return \(loss, metrics\)"),
        (lambda b: b["graph"]["nodes"][-1].update(args=[{"tuple": [1.0, {"dict": {}}]}]), "loss must be a node"),
        (lambda b: b["graph"]["nodes"][-1]["args"][0]["tuple"][1]["dict"].update({"loss:sum": {"ref": "neg"}}),
         "metric 'loss:sum' must be named"),
        (lambda b: b["graph"]["nodes"][-1]["args"][0]["tuple"][1]["dict"].update({"custom/X:sum": {"ref": "neg"}}),
         "metric 'custom/X:sum' must be named"),
        (lambda b: b["graph"]["nodes"][-1]["args"][0]["tuple"][1]["dict"].update({"custom/x:max": {"ref": "neg"}}),
         "must be named"),
        (lambda b: b["graph"]["nodes"][-1]["args"][0]["tuple"][1]["dict"].update({"custom/x:sum": 1.0}),
         "must be a node's value"),
        (lambda b: b.update(inputs=[{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 3}]), "rank 3"),
        (lambda b: b.update(inputs=[{"name": "logprobs", "rank": 0}, {"name": "weights", "rank": 1}]), "rank 0"),
        (lambda b: b.update(inputs=[{"name": "logprobs", "rank": True}, {"name": "weights", "rank": 1}]), "rank"),
        (lambda b: b.update(inputs=[{"name": "weights", "rank": 1}, {"name": "logprobs", "rank": 1}]),
         "must be logprobs"),
        (lambda b: b.update(inputs=[{"name": "logprobs", "rank": 1}, {"name": "logprobs", "rank": 1}]), "distinct"),
        (lambda b: b.update(inputs=[{"name": "logprobs", "rank": 1}, {"name": "Weights", "rank": 1}]), "lowercase"),
        (lambda b: b.update(inputs=[{"name": "logprobs", "rank": 1}]), "inputs must be"),
    ],
)
def test_malformed_graphs_and_inputs_are_refused(edit, match):
    refused(mutate(edit), match)


def test_too_many_nodes_are_refused():
    body = neg_ll_body()
    nodes = body["graph"]["nodes"]
    extra = [{"op": "call_function", "name": f"n{i}", "target": "operator.neg", "args": [{"ref": "logprobs"}],
              "kwargs": {}} for i in range(custom_loss.MAX_NODES)]
    body["graph"]["nodes"] = nodes[:-1] + extra + nodes[-1:]
    refused(body, f"more than {custom_loss.MAX_NODES}")


def test_the_sdks_pydantic_types_compile_like_their_json():
    handle = trace_loss(neg_ll, {"logprobs": 1, "weights": 1}, "session")
    loss = compile_loss(encode_graph(handle), handle.inputs)
    value, metrics = loss(torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 0.5]))
    assert value.item() == pytest.approx(2.0) and metrics["custom/neg_ll:sum"].item() == pytest.approx(2.0)


# ---- refusals when the loss runs -----------------------------------------------------------------------


def run_forged(datum_inputs=None, **node):
    body = forged(**node)
    loss = compile_loss(body["graph"], body["inputs"])
    return loss(-torch.rand(T), *(datum_inputs or [torch.ones(T)]))


def test_inputs_must_have_their_declared_rank():
    loss = compiled(neg_ll, {"logprobs": 1, "weights": 1})
    with pytest.raises(CustomLossError, match="input 'weights' must have rank 1, got .* shape \\(6, 4\\)"):
        loss(torch.zeros(T), torch.zeros(T, K))
    with pytest.raises(CustomLossError, match="takes 2 inputs, got 1"):
        loss(torch.zeros(T))


def test_a_loss_that_is_not_0_dim_is_refused():
    def per_token(logprobs, weights):
        return -(logprobs * weights), {}

    loss = compiled(per_token, {"logprobs": 1, "weights": 1})
    with pytest.raises(CustomLossError, match="0-dim float tensor as its loss, got .* shape \\(6,\\)"):
        loss(torch.zeros(T), torch.ones(T))


def test_a_metric_that_is_not_0_dim_is_refused():
    def vector_metric(logprobs, weights):
        return logprobs.sum(), {"custom/w:sum": weights}

    with pytest.raises(CustomLossError, match="metric 'custom/w:sum' must be a 0-dim tensor"):
        compiled(vector_metric, {"logprobs": 1, "weights": 1})(torch.zeros(T), torch.ones(T))


def test_a_loss_that_is_a_python_number_is_refused():
    with pytest.raises(CustomLossError, match="0-dim float tensor as its loss, got int"):
        run_forged(target="operator.add", args=[1, 2])


def test_integer_tensor_indices_are_refused():
    with pytest.raises(CustomLossError, match="node 'evil'.*integer-tensor indices are refused"):
        index = [{"ref": "logprobs"}, {"ref": "weights"}]
        run_forged([torch.tensor([0, 1, 99])], target="operator.getitem", args=index)
    with pytest.raises(CustomLossError, match="an index may be"):
        run_forged(target="operator.getitem", args=[{"ref": "logprobs"}, [0, 1]])


def test_to_may_only_change_the_dtype():
    with pytest.raises(CustomLossError, match=r"\.to\(\) may only change the dtype"):
        run_forged(op="call_method", target="to", args=[{"ref": "logprobs"}, "meta"])


def test_device_arguments_must_be_the_inputs_own():
    with pytest.raises(CustomLossError, match="device= may only be"):
        run_forged(target="torch.zeros_like", args=[{"ref": "logprobs"}], kwargs={"device": "meta"})


def test_sequence_and_string_arithmetic_is_refused():
    with pytest.raises(CustomLossError, match="operands must be tensors or numbers, got tuple"):
        run_forged(target="operator.mul", args=[{"tuple": [0]}, 10**12])
    with pytest.raises(CustomLossError, match="got str"):
        run_forged(target="operator.mul", args=["x", 10**12])


def test_huge_integers_and_tensors_are_refused_before_they_are_built():
    with pytest.raises(CustomLossError, match="integer power .* too large"):
        run_forged(target="operator.pow", args=[10, 10**12])
    with pytest.raises(CustomLossError, match="size .* is over"):
        run_forged(op="call_method", target="new_zeros", args=[{"ref": "logprobs"}, {"tuple": [1 << 20, 1 << 20]}])
    outer = [{"ref": "logprobs"}, {"tuple": [{"slice": [None, None, None]}, None]}]
    body = forged(target="operator.mul", args=[{"ref": "col"}, {"ref": "logprobs"}])
    body["graph"]["nodes"].insert(2, {"op": "call_function", "name": "col", "target": "operator.getitem",
                                      "args": outer, "kwargs": {}})
    loss = compile_loss(body["graph"], body["inputs"])
    big = -torch.rand(1 << 14)
    with pytest.raises(CustomLossError, match=r"node 'evil'.*would create 268435456 elements"):
        loss(big, torch.ones(1 << 14))


def test_torch_errors_become_custom_loss_errors_naming_the_node():
    with pytest.raises(CustomLossError, match=r"node 'evil' \(operator.mul\) failed: RuntimeError"):
        run_forged([torch.ones(T + 1)], target="operator.mul", args=[{"ref": "logprobs"}, {"ref": "weights"}])


def test_running_a_loss_leaves_its_inputs_unchanged():
    loss = compiled(ppo, {"logprobs": 1, "old_logprobs": 1, "advantages": 1})
    datum = batch({"logprobs": 1, "old_logprobs": 1, "advantages": 1})[0]
    before = {k: v.clone() for k, v in datum.items()}
    loss(datum["logprobs"], datum["old_logprobs"], datum["advantages"])
    for key, value in datum.items():
        assert torch.equal(value, before[key])


# ---- the trainer's own limit: per-token inputs ---------------------------------------------------------------

NOT_PER_TOKEN = [
    (distill, {"logprobs": 2, "teacher_logits": 2, "weights": 1}),
    (neg_ll, {"logprobs": 1, "weights": 2}),
    (sequence_advantage, {"logprobs": 1, "advantage": 0, "mask": 1}),
]
PER_TOKEN_ONLY = ("this server's custom losses read per-token inputs only: logprobs first, every input of rank 1 "
                  "([T])")


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return build_runtime(RuntimeConfig(runtime="torch", engine="torch", checkpoint_root=str(root)))


def refused_by(rt, request):
    """The ErrorResponse a worker answers for `request` (DomainError is answered, never an RQ failure)."""
    with pytest.raises(DomainError) as raised:
        rt.execute(request)
    return raised.value.response()


@pytest.mark.parametrize("fn,ranks", NOT_PER_TOKEN, ids=[fn.__name__ for fn, _ in NOT_PER_TOKEN])
def test_the_trainer_refuses_inputs_that_are_not_rank_1_with_a_400(rt, fn, ranks):
    """The compiler takes ranks 0-2 (the SDK's), but a datum's loss_fn_inputs carry one value per token: the torch
    trainer refuses the rest, at create_custom_loss and at a forward_backward that carries such a loss."""
    _, body = wire(fn, ranks)
    loss = CustomLoss(name=body["name"], inputs=body["inputs"], graph=body["graph"])
    expected = ErrorResponse(error=PER_TOKEN_ONLY, status=400, code="invalid_custom_loss", retryable=False)
    assert refused_by(rt, CreateCustomLossRequest(model_id=losses_model_id("session"), loss=loss)) == expected

    model_id = f"{fn.__name__.replace('_', '-')}:train:0"
    rt.execute(CreateModelRequest(model_id=model_id, base_model="tinyq-micro", lora=LoraConfig(rank=4)))
    datum = Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2.0, 3.0, 4.0], "weights": [1.0] * 3})
    forward = ForwardBackwardRequest(model_id=model_id, data=[datum], loss_fn="custom", custom_loss=loss)
    assert refused_by(rt, forward) == expected
