"""Golden test vectors for pytest: :func:`load_cases`."""

from __future__ import annotations

from pathlib import Path

from ..oracle.vectors import json_params, read_vectors
from ..validation import check_choice

__all__ = ["case_mode", "load_cases"]

MODES = ("oneshot", "block")


def case_mode(case) -> str:
    """``"oneshot"`` or ``"block"``: the case's ``mode`` (files without it are block mode)."""
    return getattr(case, "mode", None) or "block"


def load_cases(path, *, policy: str | None = None, dtype: str | None = None, flags=(), mode: str | None = None,
               params: dict | None = None) -> list:
    """The test vectors of a vectors file, a suite directory or a folder of vectors files, filtered.

    Parameters
    ----------
    path : path-like
        A ``vectors/<policy>.json`` file, a suite directory (its ``vectors/`` folder), or
        any folder of vectors files.
    policy : str, optional
        Only this policy.
    dtype : {"float32", "float64"}, optional
        Only cases of this dtype.
    flags : iterable of str
        Only cases carrying all of these flags.
    mode : {"oneshot", "block"}, optional
        Only one-shot cases (the whole prompt one block, then one eviction) or block-mode
        cases (the case's ``mode``; files written before it existed are block mode).
    params : dict, optional
        Only cases whose group parameters equal these, the parameters not named taking the
        policy's defaults (``{"all_heads": False}`` is TOVA's ``all_heads=False`` with every
        other parameter at its default, so a parameter added later does not empty the
        selection); ``{}`` selects the defaults (compared in JSON form: tuples as lists).

    Returns
    -------
    list of :class:`refkv.oracle.VectorCase`; ``str(case)`` is a short id for pytest.
    """
    path = Path(path)
    if mode is not None:
        check_choice("mode", mode, MODES)
    if params is not None:
        params = json_params(params)
    if path.is_dir():
        folder = path / "vectors" if (path / "vectors").is_dir() else path
        files = sorted(folder.glob("*.json")) if policy is None else [folder / f"{policy}.json"]
        if policy is not None and not files[0].exists():
            files = sorted(folder.glob("*.json"))
    else:
        files = [path]
    out = []
    wanted = set(flags)
    for file in files:
        if file.name == "suite.json":
            continue
        vf = read_vectors(file)
        if policy is not None and vf.policy != policy:
            continue
        want = None if params is None else _completed(vf.policy, params)
        for case in vf.cases:
            if dtype is not None and case.dtype != dtype:
                continue
            if not wanted <= set(case.flags):
                continue
            if mode is not None and case_mode(case) != mode:
                continue
            if want is not None and case.params != want:
                continue
            out.append(case)
    return out


def _completed(policy: str, params: dict) -> dict:
    """``params`` with the policy's defaults for the parameters not named (JSON form); as given
    if the policy cannot be built with them (a policy this process does not know)."""
    from ..oracle.vectors import python_params
    from ..policies import get

    try:
        return json_params(get(policy, **python_params(params)).params())
    except (TypeError, ValueError):
        return params
