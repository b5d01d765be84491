"""Model configuration: the shapes and constants of a Llama-family decoder."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..validation import check_choice, check_float, check_int

__all__ = ["ROPE_TYPES", "TINY", "ModelConfig"]

#: RoPE variants refkv implements (Hugging Face ``rope_type`` names).
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder.

    Parameters
    ----------
    vocab_size : int
        Number of token ids; valid ids are ``0 .. vocab_size - 1``.
    d_model : int
        Width of the residual stream.
    n_layers : int
        Number of decoder layers.
    n_heads : int
        Number of query heads per layer.
    n_kv_heads : int
        Number of key/value heads per layer (grouped-query attention). Must divide
        ``n_heads``; each KV head serves ``n_heads // n_kv_heads`` query heads.
    d_head : int
        Width of one attention head. Must be even (RoPE rotates pairs).
    d_ff : int
        Hidden width of the SwiGLU MLP.
    rope_base : float
        Base ``theta`` of the rotary frequencies ``theta ** (-2 i / d_head)``.
    norm_eps : float
        Epsilon inside RMSNorm's square root.
    tie_embeddings : bool
        If true the LM head is the transpose of the token embedding.
    max_positions : int
        Context length the model was trained for. Informational: refkv does not
        refuse longer inputs (RoPE is defined for any position), but experiments
        use it to stay inside the trained range.
    name : str
        A label used in reports and golden files.
    rope_type : {"default", "linear", "llama3"}
        How the rotary frequencies are rescaled; Hugging Face ``rope_parameters["rope_type"]``
        (``rope_scaling`` in transformers 4). ``"default"`` is RoPE as in RoFormer (Su et al.
        2021, Sec. 3.2); ``"linear"`` divides every frequency by ``rope_factor`` (position
        interpolation, Chen et al. 2023); ``"llama3"`` is Llama 3.1's band-wise rule
        (:func:`refkv.model.layers.llama3_frequencies`). ``"dynamic"`` NTK scaling is refused:
        its frequencies depend on the length seen so far, so keys cached early would carry a
        different rotation than keys computed later.
    rope_factor : float
        ``rope_parameters["factor"]`` of ``"linear"`` and ``"llama3"`` scaling (Llama 3.1: 8,
        Llama 3.2: 32).
    rope_low_freq_factor, rope_high_freq_factor : float or None
        ``rope_parameters["low_freq_factor"]`` / ``["high_freq_factor"]`` of ``"llama3"``
        scaling (Llama 3.1: 1 and 4): wavelengths above ``original_context / low`` are divided
        by ``rope_factor``, below ``original_context / high`` kept, in between interpolated.
    rope_original_context : int or None
        ``rope_parameters["original_max_position_embeddings"]`` of ``"llama3"`` scaling: the
        pre-training context (Llama 3.1: 8192) that sets the band edges.
    rope_freq_factors : tuple of float or None
        One divisor per rotary frequency (``d_head / 2`` values), llama.cpp's ``rope_freqs.weight``
        tensor: its converter stores Llama 3 scaling this way in GGUF files, without the four
        parameters above. Applied after ``rope_type``.
    attention_bias : bool
        Biases on the q, k and v projections: Qwen2/Qwen2.5 always (``Qwen2Attention``), Llama
        and Qwen3 when ``config.json`` has ``attention_bias: true``. Added right after the
        projection, before the q/k norm and RoPE.
    output_bias : bool
        Bias on the attention output projection: Llama and Qwen3 with ``attention_bias: true``;
        never Qwen2 (its ``o_proj`` has ``bias=False``).
    qk_norm : bool
        Qwen3's RMSNorm over each head's ``d_head`` values of q and k (``q_norm``, ``k_norm``
        in ``Qwen3Attention``), applied after the projection and before RoPE, with gains shared
        by all heads and the model's ``norm_eps``.

    Notes
    -----
    Which families switch on which variant, and from which key of their files, is one
    table: :data:`refkv.model.families.FAMILIES`. ``d_head`` need not equal ``d_model / n_heads``
    (Hugging Face ``head_dim``; Qwen3-0.6B has ``d_model`` 1024, 16 heads of 128), and
    ``tie_embeddings`` follows ``tie_word_embeddings`` (false for Llama 3.1-8B and
    Qwen2.5-7B: an untied LM head).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_ff: int
    # Llama 2's value; Llama 3 uses 500000 and SmolLM2 100000, loaders override it.
    rope_base: float = 10000.0
    # Llama's value; small enough not to matter for trained activations, large
    # enough to keep an all-zero row finite.
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_positions: int = 2048
    name: str = "custom"
    # -- architecture variants (Llama 3, Qwen2/2.5, Qwen3); the defaults are Llama 2 --------
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_context: int | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    attention_bias: bool = False
    output_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff",
                      "max_positions"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads must be a multiple of n_kv_heads, got n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}")
        if self.d_head % 2:
            raise ValueError(f"d_head must be even (RoPE rotates pairs), got {self.d_head}")
        check_float("rope_base", self.rope_base, 1.0, low_open=True)
        check_float("norm_eps", self.norm_eps, 0.0, 1.0, low_open=True, high_open=True)
        for field in ("attention_bias", "output_bias", "qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be True or False, got {getattr(self, field)!r}")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        check_choice("rope_type", self.rope_type, ROPE_TYPES)
        check_float("rope_factor", self.rope_factor, 0.0, low_open=True)
        if self.rope_type == "default" and self.rope_factor != 1.0:
            raise ValueError(f"rope_factor must be 1 with rope_type {self.rope_type!r}, got {self.rope_factor!r}")
        llama3 = (self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_context)
        if self.rope_type == "llama3":
            low = check_float("rope_low_freq_factor", self.rope_low_freq_factor, 0.0, low_open=True)
            check_float("rope_high_freq_factor", self.rope_high_freq_factor, low, low_open=True)
            check_int("rope_original_context", self.rope_original_context, 1)
        elif any(v is not None for v in llama3):
            raise ValueError(f"rope_low_freq_factor, rope_high_freq_factor and rope_original_context apply to "
                             f"rope_type 'llama3' only, got rope_type {self.rope_type!r}")
        if isinstance(self.rope_freq_factors, list):  # as to_dict() and JSON give it back
            object.__setattr__(self, "rope_freq_factors", tuple(self.rope_freq_factors))
        if self.rope_freq_factors is not None:
            factors = self.rope_freq_factors
            if not isinstance(factors, tuple) or len(factors) != self.d_head // 2:
                raise ValueError(f"rope_freq_factors must be a tuple of d_head / 2 = {self.d_head // 2} numbers, "
                                 f"got {factors!r}")
            for f in factors:
                check_float("rope_freq_factors", f, 0.0, low_open=True)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (``n_heads // n_kv_heads``)."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes) -> ModelConfig:
        """Return a copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain-JSON form, for golden files and reports.

        The architecture-variant fields appear only where they differ from their Llama 2
        defaults, so a Llama 2-style config has the same form as before they existed.
        """
        out = dataclasses.asdict(self)
        for field, default in _VARIANT_DEFAULTS.items():
            if out[field] == default:
                del out[field]
        if out.get("rope_freq_factors") is not None:
            out["rope_freq_factors"] = list(out["rope_freq_factors"])
        return out

    @property
    def features(self) -> tuple[str, ...]:
        """Names of the architecture variants switched on (empty for a Llama 2-style model)."""
        return tuple(f for f in _VARIANT_DEFAULTS if getattr(self, f) != _VARIANT_DEFAULTS[f])


_VARIANT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                     if f.name in ("rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                                   "rope_original_context", "rope_freq_factors", "attention_bias", "output_bias",
                                   "qk_norm")}


#: The built-in model: small enough that a 1,000-token prompt runs in well under a
#: second per block, large enough to have GQA (2 query heads per KV head), several
#: layers (so shallow/deep layer rules are exercised) and a d_head where cosine
#: geometry is not degenerate.
TINY = ModelConfig(
    vocab_size=512,
    d_model=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    d_head=16,
    d_ff=128,
    rope_base=10000.0,
    norm_eps=1e-5,
    tie_embeddings=True,
    max_positions=4096,
    name="tiny",
)
