"""A custom loss sent as data (the SDK's `CustomLossGraph`, `POST /api/v1/create_custom_loss`), rebuilt
into a per-datum callable from this module's own tables of allowed operations.

The graph comes from a client, so nothing in it is imported, eval'd or looked up by dotted name: each
node's target is a key into `_FUNCTIONS` or `_METHODS` (and `getattr` into `_ATTRIBUTES`), and anything
else is refused with `CustomLossError` before the loss runs. What the tables leave out, and why:
  * in-place ops (`add_`, `operator.iadd`/`setitem`, `out=`, `inplace=True`): they could write into
    logprobs or the datum's inputs;
  * integer-tensor indexing, `gather`, `nll_loss`, `cross_entropy`, ...: on a GPU an out-of-range index is
    a device-side assert, which kills the worker's CUDA context instead of raising;
  * `item`/`tolist`/`numpy`/`backward`/`cuda`/`to(device)` and device arguments: they leave the graph,
    run the backward pass themselves, or move data to another device;
  * `expand`/`repeat`/`matmul`/`cat`, and Python arithmetic on sequences or strings: they can allocate
    far more than their inputs. The ops kept create at most the broadcast of their tensor arguments (or an
    explicit size, for `new_*`), which is checked against `MAX_ELEMENTS` before the op runs.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

MAX_NODES = 512
MAX_INPUTS = 16  # the SDK's limit, logprobs included
MAX_ARG_DEPTH = 8  # nesting of encoded arguments, e.g. a tuple of slices
MAX_ELEMENTS = 1 << 26  # one tensor a node creates, checked before it runs
MAX_TOTAL_ELEMENTS = 1 << 28  # every tensor one datum's loss creates
MAX_INT = 1 << 63  # Python ints (sizes, indices) stay in int64; repeated * or ** could grow without bound

METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
INPUT_RANKS = (0, 1, 2)  # scalar, [T], [T, K]

Check = Callable[[str, tuple, dict], None]


class CustomLossError(ValueError):
    """A custom loss graph, its inputs or one run of it is refused; the message says what and where."""


# ---- guards: each gets (where, args, kwargs) and raises CustomLossError -------------------------------

_NUMBER = (bool, int, float)


def _tensor_first(where: str, args: tuple, kwargs: dict) -> None:
    if not args or not isinstance(args[0], torch.Tensor):
        got = type(args[0]).__name__ if args else "nothing"
        raise CustomLossError(f"{where}: its first argument must be a tensor, got {got}")
    device = kwargs.get("device")
    if device is not None and device != args[0].device:
        raise CustomLossError(f"{where}: device= may only be its input's own device (x.device)")


def _operands(where: str, args: tuple, kwargs: dict) -> None:
    for arg in args:
        if not isinstance(arg, (torch.Tensor, *_NUMBER)):
            raise CustomLossError(
                f"{where}: operands must be tensors or numbers, got {type(arg).__name__}"
            )


def _power(where: str, args: tuple, kwargs: dict) -> None:
    _operands(where, args, kwargs)
    if len(args) == 2 and all(isinstance(a, int) for a in args) and abs(args[1]) > 64:
        raise CustomLossError(f"{where}: integer power {args[1]} is too large")


def _numbers(where: str, args: tuple, kwargs: dict) -> None:
    if kwargs or not all(isinstance(a, _NUMBER) for a in args):
        raise CustomLossError(f"{where}: math functions take Python numbers only")


def _index(where: str, args: tuple, kwargs: dict) -> None:
    if len(args) != 2 or not isinstance(args[0], (torch.Tensor, tuple)):  # torch.Size is a tuple
        raise CustomLossError(f"{where}: only tensors, shapes and tuples can be indexed")
    parts = args[1] if isinstance(args[1], tuple) else (args[1],)
    for part in parts:
        if not (
            part is None
            or part is Ellipsis
            or isinstance(part, int)
            or (isinstance(part, slice) and all(_is_int_or_none(p) for p in (part.start, part.stop, part.step)))
            or (isinstance(part, torch.Tensor) and part.dtype == torch.bool)
        ):
            raise CustomLossError(
                f"{where}: an index may be an int, slice, None, ... or a boolean mask, got "
                f"{type(part).__name__} (integer-tensor indices are refused: on a GPU an out-of-range "
                "one aborts the device instead of raising)"
            )


def _is_int_or_none(value: Any) -> bool:
    return value is None or isinstance(value, int)


def _to_dtype(where: str, args: tuple, kwargs: dict) -> None:
    _tensor_first(where, args, kwargs)
    if not all(isinstance(a, torch.dtype) for a in (*args[1:], *kwargs.values())) or set(kwargs) - {"dtype"}:
        raise CustomLossError(f"{where}: .to() may only change the dtype, e.g. x.to(torch.float32)")


def _new_size(where: str, args: tuple, kwargs: dict) -> None:
    """new_full(size, fill) / new_zeros(*size) / new_ones(*size): bound the size they allocate."""
    _tensor_first(where, args, kwargs)
    rest = args[1:]
    size = kwargs.get("size", rest[0] if rest and isinstance(rest[0], (tuple, list)) else rest)
    if not (isinstance(size, (tuple, list)) and all(isinstance(s, int) and s >= 0 for s in size)):
        raise CustomLossError(f"{where}: size must be a tuple of non-negative ints")
    if math.prod(size) > MAX_ELEMENTS:
        raise CustomLossError(f"{where}: size {tuple(size)} is over {MAX_ELEMENTS} elements")


def _attribute(obj: Any, name: str) -> Any:
    """`getattr` as a node: only `_ATTRIBUTES[name]`'s kinds of object, whose value is data."""
    if not _ATTRIBUTES[name](obj):
        raise CustomLossError(f"getattr: {type(obj).__name__} has no allowed attribute {name!r}")
    return getattr(obj, name)


def _is_return_type(obj: Any) -> bool:  # the (values, indices) of torch.max(x, dim) and friends
    return type(obj).__module__ == "torch.return_types"


def _no_check(where: str, args: tuple, kwargs: dict) -> None:
    pass


# ---- the allowlists ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Op:
    fn: Callable[..., Any]
    check: Check


def _ops(check: Check, table: Mapping[str, Callable[..., Any]]) -> dict[str, _Op]:
    return {target: _Op(fn, check) for target, fn in table.items()}


# call_function targets, spelled as the SDK sends them (torch.fx qualified names, `_operator.` renamed
# `operator.`): elementwise math, reductions and (log-)softmax, all pure and bounded by their inputs.
_FUNCTIONS: dict[str, _Op] = {
    **_ops(_operands, {
        "operator.add": operator.add, "operator.sub": operator.sub, "operator.mul": operator.mul,
        "operator.truediv": operator.truediv, "operator.floordiv": operator.floordiv,
        "operator.mod": operator.mod, "operator.neg": operator.neg, "operator.pos": operator.pos,
        "operator.abs": operator.abs, "operator.eq": operator.eq, "operator.ne": operator.ne,
        "operator.lt": operator.lt, "operator.le": operator.le, "operator.gt": operator.gt,
        "operator.ge": operator.ge, "operator.and_": operator.and_, "operator.or_": operator.or_,
        "operator.xor": operator.xor, "operator.invert": operator.invert,
    }),
    "operator.pow": _Op(operator.pow, _power),
    "operator.getitem": _Op(operator.getitem, _index),
    "getattr": _Op(_attribute, _no_check),  # its name was checked against _ATTRIBUTES when compiled
    **_ops(_numbers, {"math.exp": math.exp, "math.log": math.log, "math.log1p": math.log1p,
                      "math.sqrt": math.sqrt}),
    **_ops(_tensor_first, {
        "torch.exp": torch.exp, "torch.log": torch.log, "torch.log1p": torch.log1p,
        "torch.expm1": torch.expm1, "torch.abs": torch.abs, "torch.neg": torch.neg,
        "torch.sign": torch.sign, "torch.sqrt": torch.sqrt, "torch.rsqrt": torch.rsqrt,
        "torch.square": torch.square, "torch.pow": torch.pow, "torch.sigmoid": torch.sigmoid,
        "torch.tanh": torch.tanh, "torch.relu": torch.relu, "torch.clamp": torch.clamp,
        "torch.clip": torch.clip, "torch.minimum": torch.minimum, "torch.maximum": torch.maximum,
        "torch.where": torch.where, "torch.isfinite": torch.isfinite, "torch.nan_to_num": torch.nan_to_num,
        "torch.zeros_like": torch.zeros_like, "torch.ones_like": torch.ones_like,
        "torch.full_like": torch.full_like, "torch.sum": torch.sum, "torch.mean": torch.mean,
        "torch.amax": torch.amax, "torch.amin": torch.amin, "torch.max": torch.max, "torch.min": torch.min,
        "torch.cumsum": torch.cumsum, "torch.logsumexp": torch.logsumexp, "torch.softmax": torch.softmax,
        "torch.log_softmax": torch.log_softmax,
        "torch.nn.functional.softmax": F.softmax, "torch.nn.functional.log_softmax": F.log_softmax,
        "torch.nn.functional.relu": F.relu,
        # F.softplus and F.logsigmoid are C functions; fx names them by where they live.
        "torch._C._nn.softplus": F.softplus, "torch._C._nn.log_sigmoid": F.logsigmoid,
    }),
}

# call_method targets: the same math as methods, dtype casts, shape views (no copy, or a copy of the same
# size) and shape queries. They are looked up on torch.Tensor from this list, never from the graph.
_METHODS: dict[str, _Op] = {
    **{name: _Op(getattr(torch.Tensor, name), _tensor_first) for name in (
        "sum", "mean", "amax", "amin", "max", "min", "cumsum", "logsumexp", "softmax", "log_softmax",
        "exp", "log", "log1p", "expm1", "abs", "neg", "sign", "sqrt", "rsqrt", "square", "pow",
        "sigmoid", "tanh", "relu", "clamp", "clip", "clamp_min", "clamp_max", "masked_fill",
        "isfinite", "nan_to_num", "eq", "ne", "lt", "le", "gt", "ge",
        "detach", "clone", "contiguous", "float", "double", "long", "bool", "type_as",
        "unsqueeze", "squeeze", "reshape", "view", "flatten", "transpose", "t",
        "size", "dim", "numel",
    )},
    "to": _Op(torch.Tensor.to, _to_dtype),
    **{name: _Op(getattr(torch.Tensor, name), _new_size) for name in ("new_full", "new_zeros", "new_ones")},
}

# getattr's names, each with the objects it may read them from.
_ATTRIBUTES: dict[str, Callable[[Any], bool]] = {
    **{name: lambda obj: isinstance(obj, torch.Tensor) for name in ("shape", "dtype", "ndim", "device")},
    **{name: _is_return_type for name in ("values", "indices")},
}

_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_CONSTANTS: dict[str, dict[str, Any]] = {
    "dtype": _DTYPES,
    "layout": {"strided": torch.strided},
    "memory_format": {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format},
}
_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


# ---- decoding ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ref:
    """A reference to an earlier node's value, resolved when the loss runs."""

    name: str


def _decode(value: Any, where: str, defined: Mapping[str, Any], depth: int = 0) -> Any:
    """One encoded argument (the SDK's `_encode_arg`) as a Python value, with `_Ref`s for nodes."""
    if depth > MAX_ARG_DEPTH:
        raise CustomLossError(f"{where}: arguments nest deeper than {MAX_ARG_DEPTH}")
    if value is None or isinstance(value, (bool, float, str)):
        return value
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise CustomLossError(f"{where}: integer {value} is out of range")
        return value
    if isinstance(value, list):
        return [_decode(v, where, defined, depth + 1) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        ((kind, body),) = value.items()
        if kind == "ref" and isinstance(body, str):
            if body not in defined:
                raise CustomLossError(f"{where}: refers to {body!r}, which is not an earlier node")
            return _Ref(body)
        if kind == "tuple" and isinstance(body, list):
            return tuple(_decode(v, where, defined, depth + 1) for v in body)
        if kind == "dict" and isinstance(body, dict) and all(isinstance(k, str) for k in body):
            return {k: _decode(v, where, defined, depth + 1) for k, v in body.items()}
        if kind == "slice" and isinstance(body, list) and len(body) == 3:
            return slice(*(_decode(v, where, defined, depth + 1) for v in body))
        if kind == "ellipsis" and body is True:
            return Ellipsis
        if kind == "float" and body in _FLOATS:
            return _FLOATS[body]
        if kind in _CONSTANTS and body in _CONSTANTS[kind]:
            return _CONSTANTS[kind][body]
        if kind == "device":
            raise CustomLossError(
                f"{where}: a literal device ({body!r}) is refused; the loss runs on its inputs' device"
            )
    raise CustomLossError(f"{where}: cannot decode argument {_short(value)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _resolve(value: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(value, _Ref):
        return values[value.name]
    if isinstance(value, (list, tuple)):
        return type(value)(_resolve(v, values) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, values) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_resolve(value.start, values), _resolve(value.stop, values), _resolve(value.step, values))
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return _tensors(list(value.values()))
    return []


# ---- compiling ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    name: str
    where: str  # "custom loss node 'mul' (operator.mul)", for messages
    op: _Op
    args: tuple
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class CompiledLoss:
    """One datum's loss: `(logprobs, *inputs) -> (0-dim loss, {metric key: 0-dim tensor})`."""

    inputs: tuple[tuple[str, int], ...]
    """(name, rank) of logprobs, then of each loss_fn_inputs key the loss reads, in order."""
    steps: tuple[_Step, ...]
    placeholders: tuple[str, ...]  # node names of the inputs, in order
    loss: _Ref
    metrics: dict[str, _Ref]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The loss_fn_inputs keys the loss reads, after logprobs."""
        return tuple(name for name, _ in self.inputs[1:])

    def __call__(self, logprobs: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = dict(zip(self.placeholders, self._checked_inputs((logprobs, *inputs)), strict=True))
        created = 0
        for step in self.steps:
            values[step.name] = result = _run(step, values)
            created += sum(t.numel() for t in _tensors(result))
            if created > MAX_TOTAL_ELEMENTS:
                raise CustomLossError(f"{step.where}: the loss has created over {MAX_TOTAL_ELEMENTS} elements")
        loss = values[self.loss.name]
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
            raise CustomLossError(f"custom loss must return a 0-dim float tensor as its loss, got {_describe(loss)}")
        metrics = {key: values[ref.name] for key, ref in self.metrics.items()}
        for key, value in metrics.items():
            if not (isinstance(value, torch.Tensor) and value.ndim == 0):
                raise CustomLossError(f"custom loss metric {key!r} must be a 0-dim tensor, got {_describe(value)}")
        return loss, metrics

    def _checked_inputs(self, tensors: tuple) -> tuple[torch.Tensor, ...]:
        if len(tensors) != len(self.inputs):
            raise CustomLossError(f"custom loss takes {len(self.inputs)} inputs, got {len(tensors)}")
        for (name, rank), tensor in zip(self.inputs, tensors):
            if not isinstance(tensor, torch.Tensor) or tensor.ndim != rank:
                raise CustomLossError(f"custom loss input {name!r} must have rank {rank}, got {_describe(tensor)}")
        return tensors


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _run(step: _Step, values: Mapping[str, Any]) -> Any:
    args, kwargs = _resolve(step.args, values), _resolve(step.kwargs, values)
    step.op.check(step.where, args, kwargs)
    tensors = _tensors((args, kwargs))
    if tensors:
        try:  # elementwise ops create the broadcast of their tensor arguments
            size = math.prod(torch.broadcast_shapes(*(t.shape for t in tensors)))
        except RuntimeError:  # not broadcastable: indexing or a reduction, which creates no more
            size = max(t.numel() for t in tensors)
        if size > MAX_ELEMENTS:
            raise CustomLossError(f"{step.where}: would create {size} elements, over {MAX_ELEMENTS}")
    try:
        result = step.op.fn(*args, **kwargs)
    except CustomLossError as e:
        raise CustomLossError(f"{step.where}: {e}") from None
    except Exception as e:  # a torch or Python error on these values: the loss's fault, not the worker's
        raise CustomLossError(f"{step.where} failed: {type(e).__name__}: {e}") from e
    if isinstance(result, int) and abs(result) > MAX_INT:
        raise CustomLossError(f"{step.where}: integer result is out of range")
    if any(t.numel() > MAX_ELEMENTS for t in _tensors(result)):
        raise CustomLossError(f"{step.where}: created a tensor over {MAX_ELEMENTS} elements")
    return result


def compile_loss(graph: Mapping[str, Any] | Any, inputs: Sequence[Mapping[str, Any] | Any]) -> CompiledLoss:
    """Check a `CustomLossGraph` (JSON, or the SDK's pydantic model) and its declared `inputs`
    (`[{"name": "logprobs", "rank": 1}, ...]`) and build the loss; raise CustomLossError if refused."""
    declared = _check_inputs([_plain(i) for i in inputs])
    nodes = _nodes(_plain(graph))
    defined: dict[str, None] = {}  # node names so far, in order
    placeholders: list[str] = []
    steps: list[_Step] = []
    output = None
    for index, node in enumerate(nodes):
        op, name, target, args, kwargs = _fields(index, node)
        where = f"custom loss node {name!r} ({target[:80]})"
        if name in defined:
            raise CustomLossError(f"{where}: the name is used twice")
        if output is not None:
            raise CustomLossError(f"{where}: comes after the output node")
        is_input = op == "placeholder"
        expected = declared[len(placeholders)][0] if len(placeholders) < len(declared) else None
        if is_input != (expected is not None) or (is_input and (args or kwargs or target != expected)):
            raise CustomLossError(
                f"{where}: the graph's inputs must be {[n for n, _ in declared]}, in order, before other nodes"
            )
        if is_input:
            placeholders.append(name)
        elif op == "output":
            output = _decode(args, where, defined), kwargs
        elif op in ("call_function", "call_method"):
            steps.append(_compile_call(op, name, target, args, kwargs, where, defined))
        else:
            raise CustomLossError(f"{where}: {op} nodes are refused; a custom loss only calls allowed functions")
        defined[name] = None
    if output is None:
        raise CustomLossError("custom loss graph has no output node")
    loss, metrics = _check_output(*output)
    return CompiledLoss(tuple(declared), tuple(steps), tuple(placeholders), loss, metrics)


def _nodes(graph: Any) -> list:
    version = graph.get("format", 1) if isinstance(graph, Mapping) else None
    if not isinstance(graph, Mapping) or set(graph) - {"format", "nodes"} or type(version) is not int or version != 1:
        raise CustomLossError('custom loss graph must be {"format": 1, "nodes": [...]}')
    nodes = graph.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise CustomLossError("custom loss graph has no nodes")
    if len(nodes) > MAX_NODES:
        raise CustomLossError(f"custom loss graph has {len(nodes)} nodes, more than {MAX_NODES}")
    return nodes


def _plain(value: Any) -> Any:
    """The SDK's pydantic types as the JSON they send; JSON as itself."""
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


def _check_inputs(inputs: list) -> list[tuple[str, int]]:
    declared: list[tuple[str, int]] = []
    for i, item in enumerate(inputs):
        name = item.get("name") if isinstance(item, Mapping) else None
        rank = item.get("rank") if isinstance(item, Mapping) else None
        if not (isinstance(name, str) and INPUT_NAME.fullmatch(name)) or set(item) != {"name", "rank"}:
            raise CustomLossError(f"custom loss inputs[{i}] must be {{name, rank}} with a lowercase name")
        if type(rank) is not int or rank not in INPUT_RANKS or (i == 0 and rank == 0):
            raise CustomLossError(f"custom loss input {name!r} has rank {rank!r}; ranks are 0, 1, 2 (logprobs 1, 2)")
        declared.append((name, rank))
    names = [n for n, _ in declared]
    if not names or names[0] != "logprobs" or len(set(names)) != len(names) or len(names) > MAX_INPUTS:
        raise CustomLossError(
            f"custom loss inputs must be logprobs, then distinct loss_fn_inputs keys, at most {MAX_INPUTS} in all; "
            f"got {names}"
        )
    return declared


_NODE_KEYS = {"op", "name", "target", "args", "kwargs"}


def _fields(index: int, node: Any) -> tuple[str, str, str, list, dict]:
    if not isinstance(node, Mapping) or not {"op", "name", "target"} <= set(node) <= _NODE_KEYS:
        raise CustomLossError(f"custom loss graph nodes[{index}] must be {{op, name, target, args, kwargs}}")
    op, name, target = node["op"], node["name"], node["target"]
    args, kwargs = node.get("args", []), node.get("kwargs", {})
    if not (isinstance(name, str) and NODE_NAME.fullmatch(name)):
        raise CustomLossError(f"custom loss graph nodes[{index}] has an invalid name {_short(name)}")
    if not (isinstance(op, str) and isinstance(target, str) and isinstance(args, list) and isinstance(kwargs, dict)):
        raise CustomLossError(f"custom loss node {name!r}: op and target must be strings, args a list, kwargs a dict")
    return op, name, target, args, kwargs


def _compile_call(op: str, name: str, target: str, args: list, kwargs: dict, where: str, defined: Mapping) -> _Step:
    table = _FUNCTIONS if op == "call_function" else _METHODS
    if target not in table:
        kind = "function" if op == "call_function" else "tensor method"
        raise CustomLossError(f"{where}: {kind} {target!r} is not allowed in a custom loss")
    if "out" in kwargs or kwargs.get("inplace", False) is not False:
        raise CustomLossError(f"{where}: out= and inplace=True are refused; a custom loss may not write in place")
    decoded_args = tuple(_decode(a, where, defined) for a in args)
    decoded_kwargs = {k: _decode(v, where, defined) for k, v in kwargs.items()}
    if op == "call_method" and not (decoded_args and isinstance(decoded_args[0], _Ref)):
        raise CustomLossError(f"{where}: a method must be called on a node's value")
    if target == "getattr" and not (
        len(decoded_args) == 2 and not decoded_kwargs and isinstance(decoded_args[1], str)
        and decoded_args[1] in _ATTRIBUTES
    ):
        raise CustomLossError(f"{where}: getattr may only read {sorted(_ATTRIBUTES)}, got {_short(args[1:])}")
    return _Step(name, where, table[target], decoded_args, decoded_kwargs)


def _check_output(returned: Any, kwargs: dict) -> tuple[_Ref, dict[str, _Ref]]:
    where = "custom loss output"
    if kwargs or len(returned) != 1 or not isinstance(returned[0], (tuple, list)) or len(returned[0]) != 2:
        raise CustomLossError(f"{where}: the loss must return (loss, metrics)")
    loss, metrics = returned[0]
    if not isinstance(loss, _Ref):
        raise CustomLossError(f"{where}: the loss must be a node's value, got {_short(loss)}")
    if not isinstance(metrics, dict):
        raise CustomLossError(f"{where}: metrics must be a dict, got {_short(metrics)}")
    for key, value in metrics.items():
        if not (isinstance(key, str) and METRIC_KEY.fullmatch(key)):
            raise CustomLossError(f"{where}: metric {key!r} must be named custom/<name>:sum or custom/<name>:mean")
        if not isinstance(value, _Ref):
            raise CustomLossError(f"{where}: metric {key!r} must be a node's value, got {_short(value)}")
    return loss, metrics


# ---- a batch -----------------------------------------------------------------------------------------


class BatchLoss:
    """A compiled loss over the datums of one request, one datum at a time (as a trainer that packs datums into
    micro-batches meets them), totalled as the SDK's client-side `run_loss_handle` does: the loss of the
    request is the sum of its datums', metrics are summed over datums and those keyed `:mean` then divided
    by the number of datums."""

    def __init__(self, loss: CompiledLoss) -> None:
        self.loss = loss
        self._sums: dict[str, torch.Tensor] = {}

    def __call__(self, index: int, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Datum `index`'s 0-dim loss, its metrics added to the running sums."""
        missing = [name for name in self.loss.input_names if name not in inputs]
        if missing:
            raise CustomLossError(f"datum[{index}] has no loss_fn_inputs {missing}, which the custom loss reads")
        try:
            datum_loss, metrics = self.loss(logprobs, *(inputs[name] for name in self.loss.input_names))
        except CustomLossError as e:
            raise CustomLossError(f"datum[{index}]: {e}") from None
        for key, value in metrics.items():  # float64, like the SDK's sum of Python floats
            value = value.detach().double()
            self._sums[key] = self._sums[key] + value if key in self._sums else value
        return datum_loss

    def metrics(self, datums: int) -> dict[str, float]:
        return {k: v.item() / datums if k.endswith(":mean") else v.item() for k, v in self._sums.items()}


def run_loss_batch(
    loss: CompiledLoss, logprobs: Sequence[torch.Tensor], inputs: Sequence[Mapping[str, torch.Tensor]]
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss over a batch as the SDK's client-side `run_loss_handle` computes it (see BatchLoss)."""
    if not logprobs or len(logprobs) != len(inputs):
        raise CustomLossError(f"custom loss needs one set of inputs per datum, got {len(logprobs)} and {len(inputs)}")
    batch = BatchLoss(loss)
    total = torch.stack([batch(i, p, x) for i, (p, x) in enumerate(zip(logprobs, inputs))]).sum()
    return total, batch.metrics(len(logprobs))
