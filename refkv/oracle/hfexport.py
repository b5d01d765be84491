"""A golden's model as a Hugging Face checkpoint directory (``config.json`` + safetensors).

``refkv golden weights --model NAME --out DIR`` writes what ``transformers``'
``AutoModelForCausalLM.from_pretrained(DIR)`` loads, for every family refkv runs
(:mod:`refkv.model.families`: Llama 2, Llama 3 RoPE scaling, Qwen2 q/k/v biases, Qwen3
q/k norms; and real checkpoints such as SmolLM2): ``LlamaForCausalLM``,
``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` by the config's features. Written with
NumPy only (the safetensors format is a little-endian u64 header length, a JSON header
and the raw arrays), so the core needs neither torch nor transformers.

The conversion is the inverse of :mod:`refkv.model.safetensors_dir`: refkv's ``(in, out)``
projections are written ``(out, in)`` as ``torch.nn.Linear`` stores them; both use the
"rotate half" RoPE layout, so nothing is permuted.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..files import atomic_write
from ..model import Model
from ..model.config import ModelConfig

__all__ = ["HF_NAMES", "hf_config_dict", "hf_tensors", "safetensors_bytes", "write_checkpoint"]

#: refkv's per-layer array names -> transformers' (after ``model.layers.<i>.``).
HF_NAMES = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
            "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
            "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
            "w_down": "mlp.down_proj.weight", "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
            "bv": "self_attn.v_proj.bias", "bo": "self_attn.o_proj.bias", "q_norm": "self_attn.q_norm.weight",
            "k_norm": "self_attn.k_norm.weight"}

_SAFETENSORS_DTYPES = {"float32": "F32", "float64": "F64"}


def hf_config_dict(cfg: ModelConfig, dtype="float32") -> dict:
    """The ``config.json`` of a transformers model with ``cfg``'s architecture.

    Qwen3 when the config has q/k norms, Qwen2 for q/k/v biases without an output bias,
    Llama otherwise (Llama's ``attention_bias`` covers the output projection too).
    """
    if cfg.rope_freq_factors is not None:
        raise ValueError(f"model {cfg.name!r}: explicit RoPE frequency factors (GGUF rope_freqs) have no "
                         f"transformers config field; export a model read from a checkpoint directory instead")
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_base}
    if cfg.rope_type == "linear":
        rope["factor"] = cfg.rope_factor
    elif cfg.rope_type == "llama3":
        rope.update(factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_context)
    elif cfg.rope_type != "default":
        raise ValueError(f"model {cfg.name!r}: rope_type {cfg.rope_type!r} has no export; allowed: default, linear, "
                         f"llama3")
    common = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
              "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head, "hidden_act": "silu",
              "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.norm_eps,
              "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_base, "rope_scaling": (
                  None if cfg.rope_type == "default" else rope), "rope_parameters": rope,
              "torch_dtype": np.dtype(dtype).name, "bos_token_id": None, "eos_token_id": None}
    if cfg.qk_norm:
        return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "attention_bias": cfg.attention_bias, "use_sliding_window": False}
    if cfg.attention_bias and not cfg.output_bias:
        return {**common, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False}
    if cfg.attention_bias != cfg.output_bias:
        raise ValueError(f"model {cfg.name!r}: an output bias without q/k/v biases has no transformers family")
    return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "attention_bias": cfg.attention_bias, "mlp_bias": False}


def hf_tensors(model: Model) -> dict[str, np.ndarray]:
    """The model's weights under transformers' names and layouts (``(out, in)`` projections)."""
    w = model.weights
    out = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    if w.lm_head is not None:
        out["lm_head.weight"] = w.lm_head.T
    for i, layer in enumerate(w.layers):
        for key, array in layer.arrays().items():
            out[f"model.layers.{i}.{HF_NAMES[key]}"] = array.T  # 1-D arrays unchanged
    return out


def safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    """The safetensors file of ``tensors`` (float32 or float64 arrays), names sorted."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        kind = _SAFETENSORS_DTYPES.get(array.dtype.name)
        if kind is None:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} not exported; allowed: float32, float64")
        raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": kind, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def write_checkpoint(folder, model: Model, *, extra: dict | None = None) -> dict:
    """Write ``model`` as ``folder/config.json`` + ``folder/model.safetensors``; return the config.

    ``extra`` entries are added to ``config.json`` (``refkv``: where the weights came from).
    The folder is created; files in it are replaced atomically.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {folder} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(model.dtype).name
    config = {**hf_config_dict(model.config, dtype), **(extra or {})}
    atomic_write(folder / "model.safetensors", safetensors_bytes(hf_tensors(model)))
    atomic_write(folder / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return config
