"""The model a press runs on: refkv's weights in ``transformers``, and kvpress's ratio arithmetic."""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


import torch
import transformers

from ...model import load
from ...model.loading import model_path
from ...oracle.hfexport import hf_config_dict, hf_tensors
from ...oracle.models import MODELS, build_model
from ...validation import check_int, shown

__all__ = ["DTYPES", "compression_ratio", "hf_model", "model_of"]

#: The torch dtypes a press can run in (bf16 and fp16 are checked on the float32 cases).
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}




def compression_ratio(n: int, keep: int) -> float:
    """The ratio for which kvpress keeps exactly ``keep`` of ``n`` tokens.

    ``compute_n_kept`` truncates ``n * (1 - ratio)``; aiming half a token above ``keep``
    makes the truncation land on ``keep`` whatever the rounding of the ratio. Keeping
    everything takes ratio 0 (kvpress then skips the press), except for a one-token prompt,
    where any ratio keeps the token and the press runs, as it would in a pipeline.
    """
    if keep >= n:
        return 0.5 if n == 1 else 0.0
    return (n - keep - 0.5) / n


def hf_model(model, dtype: str = "float32", attention: str = "eager"):
    """A transformers model (Llama, Qwen2 or Qwen3 by its features) holding refkv ``model``'s weights.

    ``attention="eager"`` materialises the attention weights (presses that read them need
    it); ``"sdpa"`` does not (``BlockPress`` and ``ChunkPress`` refuse attention weights).
    """
    cfg_dict = hf_config_dict(model.config, "float32")
    cfg_dict = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "torch_dtype")}
    config = transformers.AutoConfig.for_model(**cfg_dict)
    config._attn_implementation = attention
    cls = getattr(transformers, hf_config_dict(model.config)["architectures"][0])
    hf = cls(config).eval()
    state = {name: torch.from_numpy(np.array(a, dtype=np.float64, order="C")) for name, a in hf_tensors(model).items()}
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not fit {cls.__name__}: missing {missing}, unexpected {unexpected}")
    return hf.to(DTYPES[dtype])


#: The last checkpoint read, by (path, size, mtime): reading SmolLM2's GGUF took 66 s of a
#: 212 s adapter run (the tokenizer's 150,000 metadata fields), once per write_candidates call.
_LAST_CHECKPOINT: dict = {}


def _checkpoint(builder: str):
    """The refkv model of checkpoint ``builder`` in float64, read once while the file is unchanged."""
    path = model_path(builder)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _LAST_CHECKPOINT:
        _LAST_CHECKPOINT.clear()  # one at a time: a checkpoint's weights are hundreds of megabytes
        _LAST_CHECKPOINT[key] = load(builder, dtype=np.float64)
    return _LAST_CHECKPOINT[key]


def model_of(manifest: dict):
    """The refkv model a golden was generated with (a built-in tiny model, or its checkpoint)."""
    m = manifest["model"]
    builder, seed = m.get("builder", "tiny"), m.get("seed", 0)
    if not isinstance(builder, str) or not builder:
        raise ValueError(f"the golden's model.builder must be a model name or checkpoint path, got {builder!r}")
    check_int("the golden's model.seed", seed, 0)
    if builder in MODELS:
        model = build_model(builder, seed, "float64")
    else:
        model = _checkpoint(builder)
    # The arrays are indexed by the manifest's layers and heads: a builder edited to another
    # model would index past them (an IndexError deep in the run) or compare the wrong model.
    stated = m.get("config")
    if isinstance(stated, dict):
        built = model.config.to_dict()
        differ = sorted(k for k in stated if k != "name" and k in built and stated[k] != built[k])
        if differ or set(stated) - set(built):
            key = differ[0] if differ else sorted(set(stated) - set(built))[0]
            raise ValueError(f"the golden's model.builder {builder!r} builds a model unlike its model.config "
                             f"({key}: {shown(built.get(key))} built, {shown(stated[key])} stated); the golden was "
                             f"edited or belongs to another model")
    return model

