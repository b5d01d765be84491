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

import numpy as np

from ..files import OutputFolder, load_json
from ..model import Model
from ..model.config import ModelConfig

__all__ = ["CHECKPOINT_FILES", "HF_NAMES", "checkpoint_folder", "hf_config_dict", "hf_tensors", "safetensors_bytes",
           "write_checkpoint"]

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


#: The files of a checkpoint :func:`write_checkpoint` writes: a folder holding anything else is not its own.
CHECKPOINT_FILES = ("config.json", "model.safetensors")
#: Largest ``config.json`` read back to compare a folder's settings.
MAX_CONFIG_BYTES = 16 << 20


def checkpoint_folder(out, settings: dict, *, inputs=()) -> OutputFolder:
    """The guarded folder a checkpoint made with ``settings`` may be written into.

    It must be empty (or not exist yet), or hold exactly a checkpoint refkv wrote
    (:data:`CHECKPOINT_FILES`, whose ``config.json`` records its ``refkv`` settings) made
    with the same ``settings``. Anything else is refused with one line, before a model is
    built: writing new weights over another checkpoint would replace it and leave its
    other files (``generation_config.json``, tokenizer, shards and their index) beside
    weights they do not describe -- a folder that no longer loads, or loads wrongly.
    ``inputs`` (a checkpoint named as ``--model``) are never written.
    """
    folder = OutputFolder(out, what="--out", inputs=inputs)
    root = folder.root
    for name in CHECKPOINT_FILES:
        folder.check_replaceable(name)
    if not root.exists():
        return folder
    names = sorted(p.name for p in root.iterdir())
    foreign = [n for n in names if n not in CHECKPOINT_FILES]
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise ValueError(f"--out {root} holds files golden weights does not write ({shown}); it writes into an "
                         f"empty folder or one holding a checkpoint it wrote itself -- use another folder")
    if names:
        config = root / "config.json"
        try:
            theirs = load_json(config, MAX_CONFIG_BYTES, what="config.json", allow_constants=True)["refkv"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--out {root} holds a checkpoint refkv did not write (its config.json has no refkv "
                             f"settings); refusing to replace it -- use another folder") from None
        if not isinstance(theirs, dict):
            raise ValueError(f"{config}: refkv must be an object of settings, got {type(theirs).__name__}")
        folder.refuse_other_settings("config.json", settings, theirs, what="checkpoint")
    return folder


def write_checkpoint(folder, model: Model, *, extra: dict | None = None) -> dict:
    """Write ``model`` as ``folder/config.json`` + ``folder/model.safetensors``; return the config.

    ``extra`` entries are added to ``config.json`` (``refkv``: where the weights came from,
    the settings compared by :func:`checkpoint_folder`). ``folder`` is the
    :class:`refkv.files.OutputFolder` :func:`checkpoint_folder` returned, or a path checked
    by it here. Each file is replaced atomically, the weights first.
    """
    if not isinstance(folder, OutputFolder):
        folder = checkpoint_folder(folder, (extra or {}).get("refkv", {}))
    dtype = np.dtype(model.dtype).name
    config = {**hf_config_dict(model.config, dtype), **(extra or {})}
    folder.write_bytes("model.safetensors", safetensors_bytes(hf_tensors(model)))
    folder.write_bytes("config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return config
