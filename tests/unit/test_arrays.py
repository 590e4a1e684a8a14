"""Per-token arrays (schemas/arrays.py): numpy in memory, packed bytes on the wire, number lists for earlier peers;
what is refused is refused with a message, whichever form it came in."""

import base64
import json

import numpy as np
import pytest
from hypothesis import given, strategies as st
from pydantic import ValidationError

from schemas import Datum, ForwardBackwardOutput, ForwardBackwardRequest, parse_request, parse_result
from schemas.arrays import LISTS, pack, unpack


def packed(values, dtype: str) -> dict:
    little_endian = np.dtype(dtype).newbyteorder("<")
    return {"dtype": dtype, "base64": base64.b64encode(np.asarray(values, dtype=little_endian).tobytes()).decode()}


def test_lists_numpy_and_packed_forms_give_the_same_datum():
    as_lists = Datum(model_input=[5, 6, 7], loss_fn_inputs={"target_tokens": [6.0, 7.0, 8.0], "weights": [0, 0.5, 1]})
    as_numpy = Datum(model_input=np.array([5, 6, 7]),
                     loss_fn_inputs={"target_tokens": np.array([6.0, 7.0, 8.0]), "weights": np.array([0, 0.5, 1.0])})
    as_packed = Datum(model_input=packed([5, 6, 7], "int64"), loss_fn_inputs={
        "target_tokens": packed([6, 7, 8], "float64"), "weights": packed([0, 0.5, 1], "float64")})
    for datum in (as_numpy, as_packed):
        assert np.array_equal(datum.model_input, as_lists.model_input)
        for name, values in as_lists.loss_fn_inputs.items():
            assert (np.array_equal(datum.loss_fn_inputs[name], values)
                    and datum.loss_fn_inputs[name].dtype == values.dtype)


@pytest.mark.parametrize("dtype", ["int32", "int64", "float32", "float64"])
def test_a_request_round_trips_through_its_json_with_each_arrays_dtype_and_values(dtype):
    values = np.array([0, 1, 7, 151_935], dtype=dtype)
    inputs = {"target_tokens": values, "weights": np.array([1e-7, -2.5, 3.25, 1e30], dtype="float32")}
    request = ForwardBackwardRequest(model_id="m",
                                     data=[Datum(model_input=values.astype("int32"), loss_fn_inputs=inputs)])
    again = parse_request(json.loads(request.model_dump_json()))
    got = again.data[0]
    assert got.model_input.dtype == np.int32 and np.array_equal(got.model_input, values)
    for name, sent in inputs.items():
        assert got.loss_fn_inputs[name].dtype == sent.dtype and np.array_equal(got.loss_fn_inputs[name], sent), name


def test_the_list_form_is_the_number_lists_the_fields_once_were():
    datum = Datum(model_input=np.array([1, 2], "<i4"),
                  loss_fn_inputs={"target_tokens": np.array([2, 3], "<i8"), "weights": np.array([0.5, 1], "<f4")})
    assert json.loads(datum.model_dump_json(context=LISTS)) == {
        "model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2.0, 3.0], "weights": [0.5, 1.0]}}
    lists = datum.model_dump_json(context=LISTS)
    assert Datum.model_validate_json(lists).model_dump_json(context=LISTS) == lists


def test_arrays_in_a_datum_are_read_only_and_not_the_callers():
    tokens = np.array([1, 2, 3])
    datum = Datum(model_input=tokens)
    tokens[0] = 99
    assert datum.model_input[0] == 1
    with pytest.raises(ValueError):
        datum.model_input[0] = 5


BAD = {
    "a dtype outside the four": ({"dtype": "int8", "base64": "AA=="}, "dtype is one of"),
    "not base64": ({"dtype": "int32", "base64": "AAA*"}, "does not decode"),
    "base64 without its padding": ({"dtype": "int32", "base64": "AAA"}, "does not decode"),
    "a partial value": ({"dtype": "int32", "base64": base64.b64encode(b"\x01\x00\x00").decode()}, "whole number"),
    "another key": ({"dtype": "int32", "base64": "AQAAAA==", "shape": [1]}, "nothing else"),
    "a float token id": (packed([1.0], "float32"), "1-D array"),
    "a negative token id": (packed([3, -1], "int32"), ">= 0"),
    "no tokens": (packed([], "int32"), "no tokens"),
    "a string": ("AQAAAA==", "a list of numbers or a packed array"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_packed_model_input_is_refused_with_a_message(case):
    value, message = BAD[case]
    with pytest.raises(ValidationError, match=message):
        Datum(model_input=value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_loss_inputs_are_refused_in_every_form(value):
    for form in ([1.0, value], np.array([1.0, value]), packed([1.0, value], "float32")):
        with pytest.raises(ValidationError, match="finite"):
            Datum(model_input=[1, 2], loss_fn_inputs={"advantages": form})


def test_two_dimensional_arrays_are_refused():
    with pytest.raises(ValidationError, match="1-D"):
        Datum(model_input=np.ones((2, 2), dtype=np.int64))


def test_outputs_keep_nan_and_infinities_packed_and_as_lists():
    values = np.array([-1.5, np.nan, np.inf, -np.inf], dtype=np.float32)
    output = ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": values}], metrics={"loss:sum": 1.0})
    as_lists = output.model_dump_json(context=LISTS)
    assert json.loads(as_lists)["loss_fn_outputs"][0]["logprobs"] == [-1.5, "NaN", "Infinity", "-Infinity"]
    for raw in (output.model_dump_json(), as_lists):
        got = parse_result(raw).loss_fn_outputs[0]["logprobs"]
        assert np.array_equal(got, values, equal_nan=True)


@given(st.binary(max_size=64), st.sampled_from(["int32", "int64", "float32", "float64"]))
def test_unpack_reads_exactly_what_pack_wrote_or_says_why_not(raw, dtype):
    form = {"dtype": dtype, "base64": base64.b64encode(raw).decode()}
    if len(raw) % np.dtype(dtype).itemsize:
        with pytest.raises(ValueError, match="whole number"):
            unpack(form)
        return
    values = unpack(form)
    assert values.tobytes() == raw and pack(values) == form


def test_models_with_arrays_compare_by_dtype_and_values():
    def output(values, dtype="float32"):
        return ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": np.array(values, dtype)}], metrics={"loss:sum": 1.0})

    assert output([-1.0, -2.0]) == output([-1.0, -2.0])
    assert output([-1.0, -2.0]) != output([-1.0, -2.5])
    assert output([-1.0, -2.0]) != output([-1.0, -2.0], "float64")
    assert output([-1.0]) != output([-1.0, -2.0])
    one, other = Datum(model_input=[1, 2]), Datum(model_input=np.array([1, 2]))
    assert ForwardBackwardRequest(model_id="m", data=[one]) == ForwardBackwardRequest(model_id="m", data=[other])
    assert ForwardBackwardRequest(model_id="m", data=[one]) != ForwardBackwardRequest(
        model_id="m", data=[Datum(model_input=[1, 3])])
