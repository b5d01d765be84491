"""Array comparison: shape, then dtype, then values, reporting the first difference.

As ONNX's backend tests compare arrays: shape, then dtype, then values
(``|actual - desired| <= atol + rtol * |desired|``, NaN equal to NaN, infinities equal
only to themselves). The first thing that differs is reported, with its index. ``atol``
may be an array (one tolerance per element), which is how the dtype-derived tolerances of
:mod:`refkv.oracle.tolerance` are applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Mismatch", "as_array", "compare_arrays", "fmt", "fmt_pair"]


def fmt(x, digits: int = 10) -> str:
    x = float(x)
    return repr(x) if not np.isfinite(x) else f"{x:.{digits}g}"


def fmt_pair(a, b) -> tuple[str, str]:
    """Two numbers with the fewest digits (at least 6) that still tell them apart."""
    a, b = float(a), float(b)
    for digits in range(6, 18):
        sa, sb = fmt(a, digits), fmt(b, digits)
        if sa != sb or a == b:
            return sa, sb
    return repr(a), repr(b)


@dataclass(frozen=True)
class Mismatch:
    """The first way two arrays differ: ``kind`` is ``"shape"``, ``"dtype"`` or ``"values"``."""

    kind: str
    message: str
    index: tuple | None = None
    actual: float | None = None
    desired: float | None = None
    count: int = 0
    total: int = 0


def _default_index(index: tuple) -> str:
    return "index " + (str(index[0]) if len(index) == 1 else str(tuple(int(i) for i in index)))


def _dtype_mismatch(actual: np.dtype, desired: np.dtype, check_dtype) -> str | None:
    if check_dtype is False:
        return None
    if check_dtype == "kind":
        kinds = {"f": "float", "i": "integer", "u": "integer", "b": "bool", "c": "complex"}
        if kinds.get(actual.kind, actual.kind) != kinds.get(desired.kind, desired.kind):
            return (f"dtype mismatch: actual {actual} ({kinds.get(actual.kind, actual.kind)}), "
                    f"desired {desired} ({kinds.get(desired.kind, desired.kind)})")
        return None
    if actual != desired:
        return f"dtype mismatch: actual {actual}, desired {desired}"
    return None


def as_array(x, name: str = "array") -> np.ndarray:
    """``x`` as a NumPy array, for anything a kernel returns, without importing its library.

    NumPy arrays, lists and scalars go through ``numpy.asarray``. An object NumPy
    cannot convert, or converts to an ``object`` array (a torch ``bfloat16`` tensor, whose
    dtype NumPy lacks), is converted by duck typing: ``x.float()`` (torch) or
    ``x.astype("float32")`` (jax, ml_dtypes), then ``.numpy()`` or ``__array__``. A
    tensor on a GPU is moved with ``.cpu()`` first when it has one.

    Raises
    ------
    TypeError
        Naming ``name`` and the type, if nothing works.
    """
    if isinstance(x, np.ndarray) and x.dtype != object:
        return x
    try:
        out = np.asarray(x)
        if out.dtype != object and out.dtype.kind in "biufc":
            return out
    except (TypeError, ValueError, RuntimeError):
        pass
    y = x
    for method in ("detach", "cpu"):
        if callable(getattr(y, method, None)):
            y = getattr(y, method)()
    if str(getattr(y, "dtype", "")).endswith(("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")):
        if callable(getattr(y, "float", None)):
            y = y.float()
        elif callable(getattr(y, "astype", None)):
            y = y.astype("float32")
    for convert in ("numpy", "__array__"):
        if callable(getattr(y, convert, None)):
            try:
                out = np.asarray(getattr(y, convert)())
            except (TypeError, ValueError, RuntimeError):
                continue
            if out.dtype != object:
                return out
    raise TypeError(f"{name}: cannot convert {type(x).__name__} to a NumPy array (give a NumPy array, a list, "
                    f"or a tensor with .float()/.numpy() or __array__)")


def _beyond(rtol, atol) -> str:
    if np.ndim(atol) == 0:
        return f" beyond rtol={rtol:g}, atol={float(atol):g}"
    return " beyond their tolerances" + (f" (and rtol={rtol:g})" if rtol else "")


def compare_arrays(actual, desired, *, rtol: float = 0.0, atol=0.0, check_dtype="kind",
                   describe_index: Callable[[tuple], str] | None = None) -> Mismatch | None:
    """Compare shape, then dtype, then values; ``None`` if they agree.

    Parameters
    ----------
    actual, desired : array_like
    rtol : float
    atol : float or array_like
        Values agree where ``|actual - desired| <= atol + rtol * |desired|``; an array
        ``atol`` (broadcast to the shape) gives each element its own tolerance.
    check_dtype : {"kind", True, False}
        ``"kind"``: both float, both integer or both bool (a float32 kernel may be checked
        against float64 expectations); ``True``: identical dtypes; ``False``: no check.
    describe_index : callable, optional
        Turns an index tuple into words (``"head 1, position 7"``).
    """
    actual, desired = as_array(actual, "actual"), as_array(desired, "desired")
    name = describe_index or _default_index
    if actual.shape != desired.shape:
        return Mismatch("shape", f"shape mismatch: actual {actual.shape}, desired {desired.shape}")
    msg = _dtype_mismatch(actual.dtype, desired.dtype, check_dtype)
    if msg:
        return Mismatch("dtype", msg)
    if actual.size == 0:
        return None
    if actual.dtype.kind in "fc" or desired.dtype.kind in "fc":
        a, d = actual.astype(np.float64), desired.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(a - d)
            allowed = np.broadcast_to(np.asarray(atol, dtype=np.float64) + rtol * np.abs(d), d.shape)
            ok = (a == d) | (np.isnan(a) & np.isnan(d)) | (np.isfinite(a) & np.isfinite(d) & (diff <= allowed))
    else:
        a, d = actual, desired
        ok = actual == desired
        diff = allowed = None
    if ok.all():
        return None
    bad = np.argwhere(~ok)
    first = tuple(int(i) for i in bad[0])
    total, count = ok.size, int((~ok).sum())
    lines = [f"values differ: {count} of {total} elements ({100.0 * count / total:.3g}%)"
             + (_beyond(rtol, atol) if diff is not None else "")]
    if diff is None:
        lines.append(f"first at {name(first)}: actual {a[first]!r}, desired {d[first]!r}")
    else:
        sa, sd = fmt_pair(a[first], d[first])
        lines.append(f"first at {name(first)}: actual {sa}, desired {sd}, "
                     f"|diff| {fmt(diff[first], 4)} > allowed {fmt(allowed[first], 4)}")
        finite_bad = np.where(~ok & np.isfinite(diff), diff, -np.inf)
        if np.isfinite(finite_bad.max()):
            worst = tuple(int(i) for i in np.unravel_index(np.argmax(finite_bad), finite_bad.shape))
            if worst != first:
                sa, sd = fmt_pair(a[worst], d[worst])
                lines.append(f"largest |diff| {fmt(diff[worst], 4)} at {name(worst)} (actual {sa}, desired {sd})")
    return Mismatch("values", "\n".join(lines), first, float(a[first]), float(d[first]), count, total)
