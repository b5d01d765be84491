"""The golden-file schema: names, versions, flags, and the JSON encoding of arrays.

Three kinds of file share one header (see ``docs/oracle/format.rst`` for the full spec):

* ``refkv-vectors``: score-function test vectors of one policy (JSON);
* ``refkv-e2e``: an end-to-end golden, a JSON manifest beside an ``.npz`` of arrays;
* ``refkv-suite``: the index of a golden directory (JSON).

Every file carries ``schema``, ``schema_version``, ``refkv_version``, ``numpy_version``
and a dtype (per case for vectors, per file for end-to-end goldens).

Arrays inside JSON are objects ``{"dtype": ..., "shape": [...], "data": ...}`` with
``data`` flat in C order: a list of numbers, or for bool arrays a string of ``0`` and
``1`` characters (one per element; per-token state such as Scissorhands' 400-step
history would otherwise dominate the files). Floats are written as the shortest decimal that reads back to
the same IEEE-754 binary64 number (Python's ``repr``); float32 values are written as
their exact binary64 value, so parsing as a double and casting to float32 is exact. JSON
has no infinities or NaN, so those are the strings ``"inf"``, ``"-inf"`` and ``"nan"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

__all__ = [
    "ARRAY_DTYPES",
    "E2E_SCHEMA",
    "FLAGS",
    "FLOAT_FORMAT",
    "READ_VERSIONS",
    "SCHEDULE_VERSION",
    "SCHEMA_VERSION",
    "SUITE_SCHEMA",
    "SUPPORTED_VERSIONS",
    "VECTORS_SCHEMA",
    "check_header",
    "decode_array",
    "encode_array",
    "header",
    "require",
]

VECTORS_SCHEMA = "refkv-vectors"
E2E_SCHEMA = "refkv-e2e"
SUITE_SCHEMA = "refkv-suite"

#: The version this refkv writes (end-to-end goldens with a compression schedule are
#: :data:`SCHEDULE_VERSION`: a reader that predates schedules refuses them).
SCHEMA_VERSION = 1
#: The version of end-to-end goldens that state a compression schedule (``refkv.schedule``):
#: their arrays are indexed by round, not by block.
SCHEDULE_VERSION = 2
#: The versions this refkv reads (end-to-end goldens also :data:`SCHEDULE_VERSION`).
SUPPORTED_VERSIONS = (1,)
#: The versions this refkv reads, by schema (the golden kinds of :mod:`refkv.oracle.kinds` name
#: their schema; this table lives here, below them, because every reader checks its header here).
READ_VERSIONS = {VECTORS_SCHEMA: SUPPORTED_VERSIONS, E2E_SCHEMA: (*SUPPORTED_VERSIONS, SCHEDULE_VERSION),
                 SUITE_SCHEMA: SUPPORTED_VERSIONS}

FLOAT_FORMAT = ("shortest decimal that round-trips the IEEE-754 binary64 value (Python repr); "
                "float32 values written as their exact binary64 value; non-finite values as the "
                "strings 'inf', '-inf', 'nan'")

#: Dtypes an encoded array may declare.
ARRAY_DTYPES = ("float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                "uint64", "bool")

#: Case flags and what they mean (written into every vectors file as ``notes``).
FLAGS = {
    "gqa": "more than one query head per KV head (grouped-query attention); attention-based scores "
           "average the group's weights",
    "mha": "one query head per KV head",
    "single-token": "the block holds one token (B = 1, the generation step)",
    "no-eviction": "the candidates fit in the budget: every token is kept",
    "exact-tie": "a kept and an evicted unprotected token have exactly equal scores, so the tie rule "
                 "(equal scores keep the more recent token) decides",
    "near-tie": "a kept and an evicted unprotected token have scores within 100 tolerances of each "
                "other (but not equal): a careless implementation may flip the choice",
    "zero-norm-key": "some cached key is exactly the zero vector",
    "duplicate-keys": "two cached tokens of one KV head have identical keys",
    "huge-logits": "some query-key logit q.k/sqrt(d) exceeds 30 in magnitude, so the softmax saturates",
    "stateful": "the case carries per-token policy state (inputs.fields)",
    "before-attention": "the eviction happens before the block attends (the block is not among the "
                        "candidates; budget is N - B)",
    "engine": "captured from a run of the built-in model (realistic keys and state) rather than synthetic",
    "float32": "inputs and computation in float32",
}


def require(obj: Mapping, key: str, where: str):
    """``obj[key]``, or a ValueError naming the missing field and where it was expected."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise ValueError(f"{where}: missing field {key!r}")
    return obj[key]


def header(schema: str, version: int = SCHEMA_VERSION) -> dict:
    """The fields every file starts with."""
    from .. import __version__

    return {"schema": schema, "schema_version": version, "refkv_version": __version__,
            "numpy_version": np.__version__}


def check_header(obj: Mapping, schema: str, where: str) -> None:
    """Validate the common header: the schema name and a version this refkv reads."""
    supported = READ_VERSIONS.get(schema, SUPPORTED_VERSIONS)
    name = require(obj, "schema", where)
    if name != schema:
        raise ValueError(f"{where}: schema is {name!r}, expected {schema!r}")
    version = require(obj, "schema_version", where)
    if isinstance(version, bool) or not isinstance(version, int) or version not in supported:
        raise ValueError(f"{where}: unknown schema version {version!r} of {schema}; this refkv reads "
                         f"versions {list(supported)} (a newer refkv may read it)")
    for key in ("refkv_version", "numpy_version"):
        require(obj, key, where)


# -- arrays in JSON ----------------------------------------------------------------------
def _encode_float(x: float):
    if math.isfinite(x):
        return x  # json writes repr(x): the shortest string that round-trips
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def encode_array(array) -> dict:
    """An array as a JSON object ``{"dtype", "shape", "data"}`` (data flat, C order)."""
    a = np.asarray(array)
    name = a.dtype.name
    if name not in ARRAY_DTYPES:
        raise ValueError(f"cannot encode dtype {name}; allowed: {', '.join(ARRAY_DTYPES)}")
    flat = a.reshape(-1)
    if a.dtype.kind == "f":
        data = [_encode_float(x) for x in flat.astype(np.float64).tolist()]
    elif a.dtype.kind == "b":
        data = "".join("1" if x else "0" for x in flat.tolist())
    else:
        data = flat.tolist()
    return {"dtype": name, "shape": list(a.shape), "data": data}


_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def decode_array(obj, where: str, *, shape: tuple | None = None) -> np.ndarray:
    """Read an encoded array; ValueError on a bad dtype, a shape mismatch or bad values.

    Parameters
    ----------
    obj : dict
        ``{"dtype", "shape", "data"}``.
    where : str
        Where the array sits, for error messages.
    shape : tuple, optional
        The expected shape; ``None`` entries match any length.
    """
    dtype = require(obj, "dtype", where)
    declared = require(obj, "shape", where)
    data = require(obj, "data", where)
    if dtype not in ARRAY_DTYPES:
        raise ValueError(f"{where}: unknown dtype {dtype!r}; allowed: {', '.join(ARRAY_DTYPES)}")
    if (not isinstance(declared, list)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in declared)):
        raise ValueError(f"{where}: shape must be a list of non-negative integers, got {declared!r}")
    kind = np.dtype(dtype).kind
    if kind == "b" and not isinstance(data, str):
        raise ValueError(f"{where}: data of a bool array must be a string of '0' and '1', got {type(data).__name__}")
    if kind != "b" and not isinstance(data, list):
        raise ValueError(f"{where}: data must be a list, got {type(data).__name__}")
    count = math.prod(declared)
    if len(data) != count:
        raise ValueError(f"{where}: shape mismatch: shape {tuple(declared)} needs {count} values, "
                         f"data holds {len(data)}")
    if shape is not None:
        ok = len(shape) == len(declared) and all(e is None or e == s for e, s in zip(shape, declared))
        if not ok:
            expected = ", ".join("*" if e is None else str(e) for e in shape)
            raise ValueError(f"{where}: shape mismatch: expected ({expected}), got {tuple(declared)}")
    try:
        if kind == "f":
            values = [_NONFINITE[x] if isinstance(x, str) else x for x in data]
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values):
                raise TypeError
            out = np.array(values, dtype=np.float64).astype(dtype)
        elif kind == "b":
            if data.strip("01"):
                raise TypeError
            out = np.frombuffer(data.encode("ascii"), dtype=np.uint8) == ord("1")
        else:
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
                raise TypeError
            out = np.array(data, dtype=dtype)
    except (TypeError, KeyError, OverflowError):
        raise ValueError(f"{where}: data holds values that are not {dtype}") from None
    return out.reshape(declared)
