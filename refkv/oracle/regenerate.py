"""What changed between two generations of a suite: decisions must be identical, floats within a
stated bound (:data:`REGENERATION_BOUND`, also written into ``suite.json``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .io import read_json, read_npz
from .kinds import kind_at

__all__ = ["REGENERATION_BOUND", "Differences", "regeneration_differences"]


#: How far floats may move when the suite is regenerated on another machine (another CPU or
#: BLAS rounds differently): ``|a - b| <= bound * max(1, max |a|)`` per array (per value for
#: JSON numbers), by kind of file and dtype. Decisions (kept positions, protected masks,
#: flags, counts, integers, strings) must be identical. Each bound is at least 5x below the
#: check tolerance of its files (vectors: rtol 1e-10 / 1e-5; end to end, where a whole model
#: runs: 1e-8 / 1e-4).
REGENERATION_BOUND = {"vectors": {"float64": 1e-12, "float32": 2e-6},
                      "e2e": {"float64": 1e-10, "float32": 1e-5}}

_VERSION_FIELDS = {"refkv_version", "numpy_version", "sha256", "npz_sha256"}


@dataclass
class Differences:
    """What changed between two generations of a suite (see :func:`regeneration_differences`).

    Attributes
    ----------
    decisions : list of str
        Every difference in a decision: a kept position, a protected mask, a flag, a count,
        an integer, a string, a file present on one side only. Must be empty.
    floats : list of tuple
        ``(where, scaled difference, dtype, first side, second side)`` for every float
        array or number that differs at all, the difference scaled as in
        :data:`REGENERATION_BOUND`; ``where`` starts with the file's path.
    """

    decisions: list
    floats: list

    @staticmethod
    def kind(where: str) -> str:
        """The kind (as listed: ``vectors``, ``e2e``) of the file ``where`` starts with."""
        return kind_at(where).listed_as

    def largest(self, dtype: str, kind: str | None = None) -> float:
        return max((f[1] for f in self.floats if f[2] == dtype and kind in (None, self.kind(f[0]))), default=0.0)

    def beyond(self, bound: dict) -> list:
        """The float differences above ``bound[kind][dtype]``."""
        return [f for f in self.floats if f[1] > bound[self.kind(f[0])][f[2]]]


def _scaled(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    if same.all():
        return 0.0
    finite = np.isfinite(a64) & np.isfinite(b64)
    if not finite[~same].all():
        return math.inf  # a NaN or an infinity on one side only
    scale = max(1.0, float(np.abs(a64[np.isfinite(a64)]).max(initial=0.0)))
    # only where they differ: inf - inf elsewhere would be NaN (and a warning)
    return float(np.abs(a64[~same] - b64[~same]).max()) / scale


def _json_diff(a, b, where: str, dtype: str, out: Differences) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) == {"dtype", "shape", "data"} and set(b) == set(a):  # an encoded array
            if a["dtype"] != b["dtype"] or a["shape"] != b["shape"]:
                out.decisions.append(f"{where}: dtype/shape {a['dtype']}{a['shape']} vs {b['dtype']}{b['shape']}")
            elif a["data"] != b["data"]:
                if np.dtype(a["dtype"]).kind == "f":
                    conv = [[{"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(x, x) if isinstance(x, str)
                             else x for x in side["data"]] for side in (a, b)]
                    x, y = (np.array(c, dtype=np.float64) for c in conv)
                    # Bounded by the coarser of the array's dtype and its case's: a float64
                    # array computed by a float32 run (H2O's accumulator) moves like float32.
                    coarser = "float32" if "float32" in (a["dtype"], dtype) else a["dtype"]
                    out.floats.append((where, _scaled(x, y), coarser, a["data"], b["data"]))
                else:
                    out.decisions.append(f"{where}: {a['data']!r} vs {b['data']!r}")
            return
        dtype = a["dtype"] if a.get("dtype") in ("float32", "float64") else dtype
        for key in sorted(set(a) | set(b)):
            if key in _VERSION_FIELDS:
                continue
            if key not in a or key not in b:
                out.decisions.append(f"{where}.{key}: only in one")
            else:
                _json_diff(a[key], b[key], f"{where}.{key}", dtype, out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _json_diff(x, y, f"{where}[{i}]", dtype, out)
    elif type(a) is float and type(b) is float:
        if a != b:
            out.floats.append((where, _scaled(np.array([a]), np.array([b])), dtype, a, b))
    elif a != b or type(a) is not type(b):
        out.decisions.append(f"{where}: {a!r} vs {b!r}")


def regeneration_differences(first, second) -> Differences:
    """Compare two generations of a suite: decisions exactly, floats as scaled differences.

    Version fields and checksums are ignored (they change with the refkv/NumPy versions and
    with any float). ``.npz`` arrays: integer and bool arrays are decisions, float arrays
    are compared in the dtype of their golden (float64 scores of a float32 run count as
    float32).
    """
    first, second = Path(first), Path(second)

    def files(root):
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    out = Differences([], [])
    a_files, b_files = files(first), files(second)
    for rel in sorted(a_files ^ b_files):
        out.decisions.append(f"{rel}: only in {first if rel in a_files else second}")
    for rel in sorted(a_files & b_files):
        if rel.endswith(".json"):
            _json_diff(read_json(first / rel), read_json(second / rel), rel, "float64", out)
            continue
        dtype = read_json((first / rel).with_suffix(".json")).get("dtype", "float64")
        a, b = read_npz(first / rel), read_npz(second / rel)
        for name in sorted(set(a) | set(b)):
            x, y = a.get(name), b.get(name)
            where = f"{rel}:{name}"
            if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape:
                out.decisions.append(f"{where}: missing on one side, or dtype/shape changed")
            elif x.dtype.kind == "f":
                if not np.array_equal(x, y, equal_nan=True):
                    out.floats.append((where, _scaled(x, y), dtype, x, y))
            elif not np.array_equal(x, y):
                out.decisions.append(f"{where}: values differ: {x.tolist()} vs {y.tolist()}")
    return out
