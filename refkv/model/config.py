"""Model configuration: the shapes and constants of a Llama-family decoder."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["TINY", "ModelConfig"]


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
        if not self.rope_base > 1.0:
            raise ValueError(f"rope_base must be > 1, got {self.rope_base!r}")
        if not 0.0 < self.norm_eps < 1.0:
            raise ValueError(f"norm_eps must be in (0, 1), got {self.norm_eps!r}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (``n_heads // n_kv_heads``)."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes) -> ModelConfig:
        """Return a copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain-JSON form, for golden files and reports."""
        return dataclasses.asdict(self)


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
