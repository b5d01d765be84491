"""The per-token building blocks of a Llama-family decoder: RMSNorm, RoPE, SwiGLU.

The architecture variants of Llama 3 and Qwen2/Qwen3 are here too, each a few lines:
RoPE frequency scaling (:func:`llama3_frequencies`, :func:`rope_frequencies_of`), and
(used in :meth:`refkv.model.Model.qkv`) q/k/v biases and per-head q/k RMSNorm, which are
:func:`rms_norm` over the last axis of a ``(heads, T, d_head)`` array.

Every function keeps the dtype of its input (float32 stays float32): constants are
Python floats, which NumPy treats as "weak" scalars that never promote an array.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GATE_ROWS", "apply_rope", "gated_silu", "llama3_frequencies", "rms_norm", "rope_angles",
           "rope_frequencies", "rope_frequencies_of", "silu", "swiglu"]


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm: ``x / sqrt(mean(x**2) + eps) * gain`` over the last axis.

    Parameters
    ----------
    x : (..., d) array
    gain : (d,) array
    eps : float
    """
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True)
    out = x / np.sqrt(mean_square + float(eps))
    out *= gain  # in place: one (..., d) temporary fewer
    return out


def rope_frequencies(d_head: int, base: float) -> np.ndarray:
    """The rotary frequencies ``theta_i = base ** (-2 i / d_head)``, ``i < d_head / 2`` (float64)."""
    return float(base) ** (-np.arange(0, d_head, 2, dtype=np.float64) / d_head)


def llama3_frequencies(inv_freq: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_context: int) -> np.ndarray:
    """Llama 3.1's RoPE scaling of the frequencies ``inv_freq`` (radians per position).

    Meta's reference ``apply_scaling`` (llama-models, Llama 3.1), the same rule as
    transformers' ``_compute_llama3_parameters`` and llama.cpp's ``rope_freqs`` factors.
    With wavelength ``w = 2 pi / theta`` and the band edges
    ``w_high = original_context / high_freq_factor < w_low = original_context / low_freq_factor``:
    ``w < w_high`` keeps ``theta``; ``w > w_low`` uses ``theta / factor``; in between
    ``(1 - s) theta / factor + s theta`` with ``s = (original_context / w - low) / (high - low)``.
    """
    wavelength = 2 * np.pi / inv_freq
    smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = np.where(wavelength > original_context / low_freq_factor, inv_freq / factor, blended)
    return np.where(wavelength < original_context / high_freq_factor, inv_freq, scaled)


def rope_frequencies_of(cfg) -> np.ndarray:
    """The rotary frequencies of a :class:`~refkv.model.ModelConfig`, scaling applied (float64)."""
    inv_freq = rope_frequencies(cfg.d_head, cfg.rope_base)
    if cfg.rope_type == "linear":  # position interpolation: position p behaves as p / factor
        inv_freq = inv_freq / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        inv_freq = llama3_frequencies(inv_freq, cfg.rope_factor, cfg.rope_low_freq_factor,
                                      cfg.rope_high_freq_factor, cfg.rope_original_context)
    if cfg.rope_freq_factors is not None:  # llama.cpp's rope_freqs: theta_i / factor_i
        inv_freq = inv_freq / np.asarray(cfg.rope_freq_factors, dtype=np.float64)
    return inv_freq


def rope_angles(positions: np.ndarray, d_head: int, base: float, dtype,
                inv_freq: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Cosines and sines of the rotary angles ``p * theta_i`` for each position.

    The angles are formed in float64 and only then rounded to ``dtype``: at position
    8,000 a float32 product would already lose three digits of the angle.

    Parameters
    ----------
    positions : (T,) ints
    d_head, base
        Give ``theta_i = base ** (-2i/d_head)`` (:func:`rope_frequencies`) unless ``inv_freq``
        (``d_head / 2`` frequencies, e.g. from :func:`rope_frequencies_of`) is given.

    Returns
    -------
    cos, sin : (T, d_head) arrays of ``dtype``
        Each frequency appears twice, in dimensions ``i`` and ``i + d_head/2``, to match
        the "rotate half" pairing of :func:`apply_rope`.
    """
    if inv_freq is None:
        inv_freq = rope_frequencies(d_head, base)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * np.asarray(inv_freq, dtype=np.float64)[None, :]
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
    # x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], one half at a time:
    # three passes instead of five and no (heads, T, d) copy of x rotated. Each element
    # gets the same operations (a + (-b) is a - b), so the same bits.
    out = x * cos  # (heads, T, d_head)
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


def silu(z: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """SiLU ``z * sigmoid(z)``, computed as ``z / (1 + exp(-z))`` (into ``out`` if given,
    an array of ``z``'s shape and dtype, else a new array).

    The same function as ``z * scipy.special.expit(z)`` to the last bits or so, at two
    fifths of its time on a (128, 1536) float32 block: NumPy's SIMD ``exp`` is far faster
    than SciPy's ``expit``, and the MLP's (T, d_ff) activations are its largest
    elementwise pass. For ``z`` below about -88 (float32) ``exp(-z)`` overflows to
    infinity and ``z / inf`` gives -0, SiLU's limit, so the overflow is expected and not
    reported.
    """
    denominator = np.negative(z, out=out)
    with np.errstate(over="ignore"):
        np.exp(denominator, out=denominator)
    denominator += 1.0
    return np.divide(z, denominator, out=denominator)


#: Rows per block of :func:`gated_silu`: a (64, 1536) float32 block of SmolLM2's
#: activations is 384 KiB, so its passes stay in a core's L2 cache.
GATE_ROWS = 64


def gated_silu(gate_up: np.ndarray) -> np.ndarray:
    """SwiGLU's activation ``silu(gate) * up`` from the packed product ``[h W_gate | h W_up]``:
    (T, 2 d_ff) -> (T, d_ff).

    The four passes of :func:`silu` and the product with ``up`` run on blocks of
    :data:`GATE_ROWS` rows, each block's five passes in the L2 cache, instead of five
    passes over (T, d_ff) arrays that only the last-level cache or memory holds (at T =
    1,024 on SmolLM2: 6 MiB each). The same operations on each element as unblocked, so
    the same bits; 0.8 of the time of the unblocked passes.
    """
    t, width = gate_up.shape
    d_ff = width // 2
    hidden = np.empty((t, d_ff), dtype=gate_up.dtype)
    for start in range(0, t, GATE_ROWS):
        rows = slice(start, start + GATE_ROWS)
        silu(gate_up[rows, :d_ff], out=hidden[rows])
        hidden[rows] *= gate_up[rows, d_ff:]
    return hidden


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """SwiGLU MLP: ``(silu(x W_gate) * (x W_up)) W_down`` with ``silu(z) = z * sigmoid(z)``."""
    hidden = silu(x @ w_gate)  # then in place: the (T, d_ff) arrays are the MLP's largest temporaries
    hidden *= x @ w_up
    return hidden @ w_down
