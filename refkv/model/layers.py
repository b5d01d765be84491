"""The per-token building blocks of a Llama-family decoder: RMSNorm, RoPE, SwiGLU.

Every function keeps the dtype of its input (float32 stays float32): constants are
Python floats, which NumPy treats as "weak" scalars that never promote an array.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

__all__ = ["apply_rope", "rms_norm", "rope_angles", "swiglu"]


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm: ``x / sqrt(mean(x**2) + eps) * gain`` over the last axis.

    Parameters
    ----------
    x : (..., d) array
    gain : (d,) array
    eps : float
    """
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True)
    return x / np.sqrt(mean_square + float(eps)) * gain


def rope_angles(positions: np.ndarray, d_head: int, base: float, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Cosines and sines of the rotary angles ``p * base**(-2i/d)`` for each position.

    The angles are formed in float64 and only then rounded to ``dtype``: at position
    8,000 a float32 product would already lose three digits of the angle.

    Returns
    -------
    cos, sin : (T, d_head) arrays of ``dtype``
        Each frequency appears twice, in dimensions ``i`` and ``i + d_head/2``, to match
        the "rotate half" pairing of :func:`apply_rope`.
    """
    inv_freq = float(base) ** (-np.arange(0, d_head, 2, dtype=np.float64) / d_head)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each pair ``(x[i], x[i + d/2])`` by its angle (Hugging Face "rotate half").

    Parameters
    ----------
    x : (heads, T, d_head) array
    cos, sin : (T, d_head) arrays from :func:`rope_angles`
    """
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """SwiGLU MLP: ``(silu(x W_gate) * (x W_up)) W_down`` with ``silu(z) = z * sigmoid(z)``."""
    gate = x @ w_gate
    hidden = expit(gate)  # then in place: the (T, d_ff) arrays are the MLP's largest temporaries
    hidden *= gate
    hidden *= x @ w_up
    return hidden @ w_down
