"""Decoder weights: containers, validation and a seeded random initialiser.

Convention: every projection is stored as ``(in_features, out_features)`` and applied
as ``x @ W`` (the transpose of PyTorch's ``nn.Linear.weight``). Loaders transpose.
Query/key projections are in the Hugging Face layout: RoPE rotates dimension ``i``
with dimension ``i + d_head / 2`` of each head ("rotate half").
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from .config import ModelConfig

__all__ = ["LayerWeights", "ModelWeights", "PackedLayer", "pack_projections", "random_weights"]

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class LayerWeights:
    """Weights of one decoder layer (shapes with ``H = n_heads``, ``Hkv = n_kv_heads``).

    Attributes
    ----------
    attn_norm : (d_model,)
        RMSNorm gain before attention.
    wq : (d_model, H * d_head)
    wk : (d_model, Hkv * d_head)
    wv : (d_model, Hkv * d_head)
    wo : (H * d_head, d_model)
    mlp_norm : (d_model,)
        RMSNorm gain before the MLP.
    w_gate, w_up : (d_model, d_ff)
    w_down : (d_ff, d_model)
    bq : (H * d_head,) or None
    bk, bv : (Hkv * d_head,) or None
        q/k/v projection biases, present exactly when ``config.attention_bias`` (Qwen2).
    bo : (d_model,) or None
        Output projection bias, present exactly when ``config.output_bias``.
    q_norm, k_norm : (d_head,) or None
        Per-head RMSNorm gains of q and k, present exactly when ``config.qk_norm`` (Qwen3).
    """

    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    mlp_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    # -- optional, by architecture (None when the config does not use them) --------------
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None

    def expected_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every array ``cfg`` needs (the optional ones only when used)."""
        q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
        shapes = {
            "attn_norm": (cfg.d_model,), "wq": (cfg.d_model, q), "wk": (cfg.d_model, kv),
            "wv": (cfg.d_model, kv), "wo": (q, cfg.d_model), "mlp_norm": (cfg.d_model,),
            "w_gate": (cfg.d_model, cfg.d_ff), "w_up": (cfg.d_model, cfg.d_ff),
            "w_down": (cfg.d_ff, cfg.d_model),
        }
        if cfg.attention_bias:
            shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
        if cfg.output_bias:
            shapes["bo"] = (cfg.d_model,)
        if cfg.qk_norm:
            shapes.update(q_norm=(cfg.d_head,), k_norm=(cfg.d_head,))
        return shapes

    def arrays(self) -> dict[str, np.ndarray]:
        """Name -> array of the weights present (the optional ones that are None left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class ModelWeights:
    """All weights of a decoder.

    Attributes
    ----------
    embed : (vocab_size, d_model)
        Token embedding.
    layers : tuple of LayerWeights
    final_norm : (d_model,)
    lm_head : (d_model, vocab_size) or None
        ``None`` when the head is tied to ``embed`` (then ``embed.T`` is used).
    """

    embed: np.ndarray
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray
    lm_head: np.ndarray | None = None

    @property
    def dtype(self) -> np.dtype:
        return self.embed.dtype

    def validate(self, cfg: ModelConfig) -> None:
        """Check shapes, dtype and finiteness against ``cfg``; raise ValueError if off."""
        dtype = self.embed.dtype
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"weights dtype must be float32 or float64, got {dtype}")
        if len(self.layers) != cfg.n_layers:
            raise ValueError(f"weights have {len(self.layers)} layers, config n_layers={cfg.n_layers}")
        if cfg.tie_embeddings != (self.lm_head is None):
            raise ValueError("lm_head must be None exactly when config.tie_embeddings is true")
        top = {"embed": (cfg.vocab_size, cfg.d_model), "final_norm": (cfg.d_model,)}
        if self.lm_head is not None:
            top["lm_head"] = (cfg.d_model, cfg.vocab_size)
        checks = [(name, getattr(self, name), shape) for name, shape in top.items()]
        for i, layer in enumerate(self.layers):
            expected = layer.expected_shapes(cfg)
            checks += [(f"layers[{i}].{name}", getattr(layer, name), shape) for name, shape in expected.items()]
            for name in set(layer.arrays()) - set(expected):
                raise ValueError(f"weight layers[{i}].{name} is given but the config does not use it "
                                 f"(attention_bias={cfg.attention_bias}, output_bias={cfg.output_bias}, "
                                 f"qk_norm={cfg.qk_norm})")
        # Beyond sqrt(max) a value's square overflows (RMSNorm squares activations, q . k
        # multiplies them): no trained model has such weights, a corrupt file or a broken
        # dequantisation scale does. float64 has room for what float32 cannot hold.
        limit = float(np.sqrt(np.finfo(dtype).max))
        for name, array, shape in checks:
            if not isinstance(array, np.ndarray):
                raise ValueError(f"weight {name} must be a numpy array, got {type(array).__name__}")
            if array.shape != shape:
                raise ValueError(f"weight {name} has shape {array.shape}, expected {shape}")
            if array.dtype != dtype:
                raise ValueError(f"weight {name} has dtype {array.dtype}, expected {dtype} like embed")
            if not np.all(np.isfinite(array)):
                raise ValueError(f"weight {name} contains NaN or inf; weights must be finite")
            peak = float(np.max(np.abs(array))) if array.size else 0.0
            if peak > limit:
                raise ValueError(f"weight {name} has a value of magnitude {peak:.3g}, beyond {limit:.3g} (the "
                                 f"square root of the largest {dtype}): the forward pass would overflow")

    def astype(self, dtype) -> ModelWeights:
        """A copy with every array cast to ``dtype`` (float32 or float64)."""
        dtype = np.dtype(dtype)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be float32 or float64, got {dtype}")

        def cast(a):
            return None if a is None else np.ascontiguousarray(a, dtype=dtype)

        layers = tuple(LayerWeights(**{f.name: cast(getattr(lw, f.name)) for f in fields(LayerWeights)})
                       for lw in self.layers)
        return ModelWeights(cast(self.embed), layers, cast(self.final_norm), cast(self.lm_head))


def random_weights(cfg: ModelConfig, seed: int = 0, dtype=np.float64) -> ModelWeights:
    """Seeded random weights for ``cfg``.

    Projections are Gaussian with standard deviation ``1 / sqrt(fan_in)`` so activations
    keep unit scale through the layers; norm gains are ``1 + 0.1 * N(0, 1)`` so they are
    not trivially all-ones (a bug that ignores a gain would go unnoticed otherwise).
    The same ``(cfg, seed)`` gives the same float64 values on every platform; float32
    weights are the float64 ones rounded.
    """
    dtype = np.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    rng = np.random.default_rng(seed)

    def dense(n_in, n_out):
        return rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)

    def gain(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    def bias(n):  # large enough to move q . k visibly (Qwen2's trained k biases reach tens)
        return 0.5 * rng.standard_normal(n)

    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    embed = rng.standard_normal((cfg.vocab_size, cfg.d_model))
    layers = []
    for _ in range(cfg.n_layers):
        layers.append(dict(
            attn_norm=gain(cfg.d_model), wq=dense(cfg.d_model, q), wk=dense(cfg.d_model, kv),
            wv=dense(cfg.d_model, kv), wo=dense(q, cfg.d_model), mlp_norm=gain(cfg.d_model),
            w_gate=dense(cfg.d_model, cfg.d_ff), w_up=dense(cfg.d_model, cfg.d_ff),
            w_down=dense(cfg.d_ff, cfg.d_model)))
    final_norm = gain(cfg.d_model)
    lm_head = None if cfg.tie_embeddings else dense(cfg.d_model, cfg.vocab_size)
    # The variants' arrays are drawn after all of Llama 2's: a variant config gets the same
    # Llama 2 arrays as the plain config, plus its own (and a plain config is unchanged).
    for layer in layers:
        if cfg.attention_bias:
            layer.update(bq=bias(q), bk=bias(kv), bv=bias(kv))
        if cfg.output_bias:
            layer["bo"] = bias(cfg.d_model)
        if cfg.qk_norm:
            layer.update(q_norm=gain(cfg.d_head), k_norm=gain(cfg.d_head))
    layers = [LayerWeights(**layer) for layer in layers]
    weights = ModelWeights(embed, tuple(layers), final_norm, lm_head).astype(dtype)
    weights.validate(cfg)
    return weights


# -- packed projections (speed only; issue 17) ---------------------------------------------------
@dataclass(frozen=True)
class PackedLayer:
    """The projections of one layer that read the same input, side by side in one matrix.

    One GEMM ``h @ [W_q | W_k | W_v]`` does the work of three and reads ``h`` once; for a
    block of 128 tokens or a single decoding step the three small products cost more in
    call overhead and in re-reading ``h`` than the one large one. The results are the
    same products (column ``j`` of the packed product is column ``j`` of its part's
    product), up to the last bits a BLAS may change with the matrix width.

    Attributes
    ----------
    qkv : (d_model, H * d_head + 2 * Hkv * d_head)
        ``[wq | wk | wv]``.
    qkv_splits : tuple of int
        Column offsets where ``wk`` and ``wv`` start (for ``np.split``).
    gate_up : (d_model, 2 * d_ff)
        ``[w_gate | w_up]``.
    """

    qkv: np.ndarray
    qkv_splits: tuple[int, int]
    gate_up: np.ndarray


def pack_projections(weights: ModelWeights) -> tuple[ModelWeights, tuple[PackedLayer, ...]]:
    """Pack each layer's q/k/v and gate/up weights into one matrix each, without a second copy.

    Returns
    -------
    weights : ModelWeights
        The same values, with ``wq``, ``wk``, ``wv``, ``w_gate`` and ``w_up`` now column
        views into the packed matrices (so the model holds each weight once, and an edit
        through either name is seen by both).
    packed : tuple of PackedLayer
        One per layer.
    """
    layers, packed = [], []
    for lw in weights.layers:
        q, kv = lw.wq.shape[1], lw.wk.shape[1]
        qkv = np.concatenate([lw.wq, lw.wk, lw.wv], axis=1)  # (d_model, q + 2 kv)
        gate_up = np.concatenate([lw.w_gate, lw.w_up], axis=1)  # (d_model, 2 d_ff)
        d_ff = lw.w_gate.shape[1]
        packed.append(PackedLayer(qkv=qkv, qkv_splits=(q, q + kv), gate_up=gate_up))
        layers.append(replace(lw, wq=qkv[:, :q], wk=qkv[:, q:q + kv], wv=qkv[:, q + kv:],
                              w_gate=gate_up[:, :d_ff], w_up=gate_up[:, d_ff:]))
    return replace(weights, layers=tuple(layers)), tuple(packed)
