"""Per-token arrays in requests and results: numpy in memory, packed bytes on the wire.

A 16k-token forward_backward carries tens of thousands of numbers each way. As JSON number lists their encoding and
parsing dominate the trip on each side (bench/queue_fb.py); the SDK already sends them as raw arrays in protobuf. So
an array field holds a read-only numpy array, and its JSON form is the array's little-endian bytes in base64:

    {"dtype": "float32", "base64": "AACAPwAAAEA="}

Validation takes that form, a numpy array, or a plain list of numbers (what producers and workers before the
packed form wrote, and what a person types): a list is checked by pydantic exactly as the field's list type always
was. JSON output is packed unless the serialization context asks for lists (LISTS), which a worker does for a
producer that never said it reads the packed form (ForwardRequest.packed_results). The list form is the one the
field's list type wrote (token ids as ints, other values as floats), so a digest taken of it is the one earlier
producers took.
"""

import binascii
from collections.abc import Callable
from typing import Annotated, Any

import numpy as np
import pybase64
from pydantic import Field, PlainSerializer, PlainValidator, SerializationInfo, TypeAdapter, WithJsonSchema

# The dtypes a packed array may name; always little-endian on the wire.
DTYPES: dict[str, np.dtype] = {name: np.dtype(name).newbyteorder("<")
                               for name in ("int32", "int64", "float32", "float64")}
_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}  # dtype.name is a slow property
# Serialization context for the list form (json.dumps-compatible numbers; NaN and infinities as the model's config
# writes them).
LISTS: dict[str, str] = {"arrays": "lists"}

_PACKED_SCHEMA = {
    "oneOf": [
        {"type": "array", "items": {"type": "number"}},
        {"type": "object", "required": ["dtype", "base64"],
         "properties": {"dtype": {"enum": list(DTYPES)},
                        "base64": {"type": "string", "description": "the values' little-endian bytes"}}},
    ],
}


def pack(values: np.ndarray) -> dict[str, str]:
    """The packed JSON form of a 1-D array."""
    name = _NAMES.get(values.dtype)
    if name is None:
        raise ValueError(f"cannot pack an array of {values.dtype}")
    return {"dtype": name, "base64": pybase64.b64encode_as_string(values.astype(DTYPES[name], copy=False).tobytes())}


def unpack(form: dict) -> np.ndarray:
    """A packed array's values (read-only); ValueError says what is wrong with the form."""
    if set(form) != {"dtype", "base64"} or not isinstance(form["base64"], str):
        raise ValueError("a packed array is {\"dtype\": ..., \"base64\": \"...\"} and nothing else")
    dtype = DTYPES.get(form["dtype"]) if isinstance(form["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"a packed array's dtype is one of {', '.join(DTYPES)}, not {form['dtype']!r}")
    try:
        raw = pybase64.b64decode(form["base64"], validate=True)  # SIMD: many times the standard library's speed
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"a packed array's base64 does not decode: {exc}") from None
    if len(raw) % dtype.itemsize:
        raise ValueError(f"{len(raw)} bytes is not a whole number of {form['dtype']} values")
    return np.frombuffer(raw, dtype=dtype)


def _read_only(values: np.ndarray, owned: bool) -> np.ndarray:
    """`values`, read-only; copied first where the caller still holds them (`owned`: made here)."""
    if values.flags.writeable:
        if not owned:
            values = values.copy()  # the model is frozen: no caller keeps a handle that writes into it
        values.flags.writeable = False
    return values


def _canonical_dtype(values: np.ndarray, kinds: str) -> np.ndarray:
    """`values` as one of DTYPES: another integer or float width becomes int64 or float64."""
    if values.ndim != 1 or values.dtype.kind not in kinds:
        raise ValueError(f"expected a 1-D array of numbers of kind {kinds!r}, got {values.dtype} of shape "
                         f"{values.shape}")
    if values.dtype in _NAMES:
        return values
    return values.astype(np.float64 if values.dtype.kind == "f" else np.int64)


def _array_type(list_type: Any, kinds: str, check: Callable[[np.ndarray], None], list_dtype: np.dtype) -> Any:
    """A 1-D array field whose values are of the numpy kinds `kinds` (e.g. "iu", "iuf"), checked by `check`."""
    from_list = TypeAdapter(list_type)

    def validate(value: Any) -> np.ndarray:
        if isinstance(value, dict):
            values = unpack(value)
        elif isinstance(value, np.ndarray):
            values = value
        elif isinstance(value, (list, tuple)):
            values = np.asarray(from_list.validate_python(value), dtype=list_dtype)
        else:
            raise ValueError(f"expected a list of numbers or a packed array, got {type(value).__name__}")
        values = _canonical_dtype(values, kinds)
        check(values)
        return _read_only(values, owned=values is not value)  # a list, a packed form or a cast: a new array

    def serialize(values: np.ndarray, info: SerializationInfo) -> Any:
        if info.context and info.context.get("arrays") == "lists":
            return values.astype(list_dtype, copy=False).tolist()  # as the list type wrote them: ints, or floats
        return pack(values)

    return Annotated[np.ndarray, PlainValidator(validate), PlainSerializer(serialize, when_used="json"),
                     WithJsonSchema(_PACKED_SCHEMA)]


def _non_negative(values: np.ndarray) -> None:
    if values.size and values.min() < 0:
        raise ValueError(f"token ids are >= 0, got {values.min()}")


def _finite(values: np.ndarray) -> None:
    # NaN and inf would only come back as NaN losses and gradients, or poison a model's weights
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise ValueError("values must be finite (no NaN or infinity)")


def _unchecked(values: np.ndarray) -> None:
    pass


# Token ids (a datum's model_input); a list becomes int64.
TokenArray = _array_type(list[Annotated[int, Field(ge=0)]], "iu", _non_negative, np.dtype(np.int64))
# Per-token numbers of a request (loss inputs: target tokens, weights, advantages, logprobs); finite. A list becomes
# float64, as the list[float] it was; a packed or numpy array keeps its dtype (the SDK's int64 targets, float32
# weights).
InputArray = _array_type(list[Annotated[float, Field(allow_inf_nan=False)]], "iuf", _finite, np.dtype(np.float64))
# Per-token numbers of a result (logprobs, elementwise losses); NaN and infinities pass through.
OutputArray = _array_type(list[float], "f", _unchecked, np.dtype(np.float64))


def equal(a: Any, b: Any) -> bool:
    """==, with arrays (at any depth of dicts, lists and models) equal when their dtypes and values are."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    return a == b


class ArrayEquality:
    """For a model with array fields: == compares field by field through equal() (pydantic's own __eq__ compares
    the fields' dicts, and numpy's == is elementwise). Listed before BaseModel among the model's bases."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return equal(self.__dict__, other.__dict__)

    __hash__ = None  # arrays are not hashable
