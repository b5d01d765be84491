"""The golden format: exact JSON floats, array encoding, reader errors, atomic and reproducible writes."""

import json
import os
import zipfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refkv.oracle import io as oio
from refkv.oracle.schema import (
    SCHEMA_VERSION,
    VECTORS_SCHEMA,
    check_header,
    decode_array,
    encode_array,
    header,
)

# -- arrays in JSON ----------------------------------------------------------------------


@given(hnp.arrays(st.sampled_from([np.float32, np.float64]), hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
                  elements={"allow_nan": True, "allow_infinity": True}))
def test_float_arrays_round_trip_exactly_through_json_text(a):
    # Through real JSON text, as another language would read it: bit-exact, NaN/inf included.
    text = json.dumps(encode_array(a), allow_nan=False)
    b = decode_array(json.loads(text), "x")
    assert b.dtype == a.dtype and b.shape == a.shape
    assert np.array_equal(a, b, equal_nan=True)
    finite = ~np.isnan(a)
    assert np.array_equal(np.signbit(a[finite]), np.signbit(b[finite]))  # -0.0 survives


def test_float32_values_are_written_as_their_exact_double():
    # 0.1f is 0.100000001490116119384765625; its double repr is what the file holds.
    enc = encode_array(np.array([0.1], dtype=np.float32))
    assert enc["data"] == [0.10000000149011612]
    assert float(np.float32(0.1)) == 0.10000000149011612


def test_nonfinite_values_are_strings_and_bools_a_bit_string():
    enc = encode_array(np.array([np.inf, -np.inf, np.nan, 1.5]))
    assert enc["data"] == ["inf", "-inf", "nan", 1.5]
    enc = encode_array(np.array([[True, False, False], [False, True, True]]))
    assert enc == {"dtype": "bool", "shape": [2, 3], "data": "100011"}
    assert np.array_equal(decode_array(enc, "m"), [[True, False, False], [False, True, True]])


@given(st.lists(st.integers(0, 255), max_size=12))
def test_integer_arrays_round_trip(values):
    a = np.array(values, dtype=np.uint8)
    b = decode_array(json.loads(json.dumps(encode_array(a))), "x")
    assert b.dtype == np.uint8 and np.array_equal(a, b)


@pytest.mark.parametrize("obj, match", [
    ({"dtype": "float64", "shape": [2, 2], "data": [1.0, 2.0, 3.0]}, r"shape mismatch: shape \(2, 2\) needs 4"),
    ({"dtype": "float16", "shape": [1], "data": [1.0]}, "unknown dtype 'float16'"),
    ({"dtype": "float64", "shape": [1]}, "missing field 'data'"),
    ({"shape": [1], "data": [1.0]}, "missing field 'dtype'"),
    ({"dtype": "float64", "shape": [-1], "data": []}, "non-negative integers"),
    ({"dtype": "float64", "shape": [1], "data": ["one"]}, "not float64"),
    ({"dtype": "int64", "shape": [1], "data": [1.5]}, "not int64"),
    ({"dtype": "uint8", "shape": [1], "data": [300]}, "not uint8"),
    ({"dtype": "bool", "shape": [2], "data": "12"}, "not bool"),
    ({"dtype": "bool", "shape": [2], "data": [True, False]}, "string of '0' and '1'"),
])
def test_decode_array_errors_name_the_problem(obj, match):
    with pytest.raises(ValueError, match=match):
        decode_array(obj, "case 3: inputs.keys")


def test_decode_array_checks_an_expected_shape():
    enc = encode_array(np.zeros((2, 3)))
    assert decode_array(enc, "k", shape=(2, None)).shape == (2, 3)
    with pytest.raises(ValueError, match=r"inputs.keys: shape mismatch: expected \(3, \*\), got \(2, 3\)"):
        decode_array(enc, "inputs.keys", shape=(3, None))


# -- headers ------------------------------------------------------------------------------
def test_header_carries_versions():
    import refkv

    h = header(VECTORS_SCHEMA)
    assert h == {"schema": VECTORS_SCHEMA, "schema_version": SCHEMA_VERSION, "refkv_version": refkv.__version__,
                 "numpy_version": np.__version__}
    check_header(h, VECTORS_SCHEMA, "f")


@pytest.mark.parametrize("change, match", [
    ({"schema_version": 99}, "unknown schema version 99 of refkv-vectors"),
    ({"schema_version": "1"}, "unknown schema version '1'"),
    ({"schema": "refkv-e2e"}, "schema is 'refkv-e2e', expected 'refkv-vectors'"),
])
def test_check_header_rejects_unknown_versions_and_schemas(change, match):
    with pytest.raises(ValueError, match=match):
        check_header({**header(VECTORS_SCHEMA), **change}, VECTORS_SCHEMA, "f")


def test_check_header_names_a_missing_field():
    h = header(VECTORS_SCHEMA)
    del h["numpy_version"]
    with pytest.raises(ValueError, match="f: missing field 'numpy_version'"):
        check_header(h, VECTORS_SCHEMA, "f")


# -- writing and reading ----------------------------------------------------------------------
def test_dumps_is_valid_deterministic_json_with_arrays_on_one_line():
    obj = {"b": 1, "a": [{"x": encode_array(np.arange(3.0))}], "s": "é"}
    text = oio.dumps(obj)
    assert json.loads(text) == obj
    assert oio.dumps(json.loads(text)) == text
    assert '"x": {"dtype": "float64", "shape": [3], "data": [0.0, 1.0, 2.0]}' in text
    assert text.index('"b"') < text.index('"a"')  # insertion order, not sorted


def test_read_json_refuses_nonstandard_constants(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"a": NaN}')
    with pytest.raises(ValueError, match="non-standard JSON constant NaN"):
        oio.read_json(p)
    p.write_text('{"a": ')
    with pytest.raises(ValueError, match="not valid JSON"):
        oio.read_json(p)
    with pytest.raises(ValueError, match="no such file"):
        oio.read_json(tmp_path / "missing.json")


def test_atomic_write_leaves_the_old_file_when_interrupted(tmp_path, monkeypatch):
    p = tmp_path / "golden.json"
    oio.write_json(p, {"v": 1})

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        oio.write_json(p, {"v": 2})
    monkeypatch.undo()
    assert json.loads(p.read_text()) == {"v": 1}
    assert sorted(f.name for f in tmp_path.iterdir()) == ["golden.json"]  # no temporary left behind


def test_npz_is_reproducible_and_readable_by_numpy(tmp_path):
    arrays = {"b": np.arange(5), "a": np.linspace(0, 1, 7, dtype=np.float32), "m": np.eye(2, dtype=bool)}
    d1 = oio.write_npz(tmp_path / "one.npz", arrays)
    d2 = oio.write_npz(tmp_path / "two.npz", dict(reversed(list(arrays.items()))))
    assert d1 == d2  # fixed timestamps, sorted members
    with np.load(tmp_path / "one.npz", allow_pickle=False) as z:
        assert sorted(z.files) == ["a", "b", "m"]
        assert np.array_equal(z["a"], arrays["a"]) and z["a"].dtype == np.float32
    back = oio.read_npz(tmp_path / "one.npz")
    assert all(np.array_equal(back[k], v) for k, v in arrays.items())
    with zipfile.ZipFile(tmp_path / "one.npz") as zf:
        assert {i.date_time for i in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}


def test_read_npz_never_unpickles(tmp_path):
    p = tmp_path / "evil.npz"
    np.savez(p, x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match=r"evil.npz"):
        oio.read_npz(p)
    with pytest.raises(ValueError, match="not allowed"):
        oio.write_npz(tmp_path / "y.npz", {"x": np.array([None], dtype=object)})
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"junk.npz"):
        oio.read_npz(tmp_path / "junk.npz")


def test_sha256_is_the_standard_digest():
    assert oio.sha256(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
