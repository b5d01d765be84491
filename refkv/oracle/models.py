"""The models end-to-end goldens run, and the seeded inputs they are fed.

A golden names its model (an entry of :data:`MODELS`, built with seeded random weights)
and states the rules that rebuild its inputs: the prompt (:data:`PROMPT_RULE`), the tokens
decoded after it (:data:`DECODE_RULE`) and the weights (:data:`WEIGHTS_RULE`; a candidate
without refkv reads them from :func:`export_weights`'s file). :mod:`refkv.oracle.recorder`
runs them; :mod:`refkv.oracle.endtoend` reads and writes the goldens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..files import OutputFolder
from ..model import TINY, Model, builtin_model, families, random_weights
from ..model.heads import repeat_kv_heads
from .io import read_json, sha256, write_json, write_npz
from .schema import header

__all__ = ["DECODE_RULE", "MODELS", "PROMPT_RULE", "WEIGHTS_RULE", "build_model", "context_of", "decode_tokens",
           "export_weights", "is_checkpoint", "prompt_tokens"]

#: How a golden's prompt is drawn from its seed (:func:`prompt_tokens`).
PROMPT_RULE = "numpy.random.default_rng(seed).integers(0, vocab_size, length)"
#: How a golden's weights are drawn from its seed.
WEIGHTS_RULE = ("refkv.model.random_weights(config, seed, dtype), config from refkv.model.builtin_model or "
                "refkv.model.families.tiny (export: refkv golden weights --model NAME)")
#: How the tokens fed after the prompt of a schedule golden are drawn (:func:`decode_tokens`).
DECODE_RULE = "numpy.random.default_rng(seed).integers(0, vocab_size, new_tokens)"

#: The models end-to-end goldens can run: name -> ``builder(seed, dtype) -> Model``. A tiny model
#: of another architecture (RoPE scaling, biases, q/k norms) becomes a golden with one entry
#: here; :data:`refkv.oracle.recipes.E2E_MODELS` chooses which of them the suite holds.
MODELS: dict[str, Callable[[int, str], Model]] = {
    "tiny": lambda seed, dtype: builtin_model(seed=seed, dtype=dtype),
    # The architectures the papers and the backends use (refkv.model.families): Llama 3 RoPE
    # scaling with an original context shorter than the prompts, Qwen2 q/k/v biases, Qwen3
    # per-head q/k RMSNorm and a head width other than d_model / n_heads.
    "llama3": lambda seed, dtype: families.tiny("llama3", seed=seed, dtype=dtype),
    "qwen2": lambda seed, dtype: families.tiny("qwen2", seed=seed, dtype=dtype),
    "qwen3": lambda seed, dtype: families.tiny("qwen3", seed=seed, dtype=dtype),
    # One KV head per query head (no GQA): the regime of the authors' codes that select per query
    # head (SnapKV, PyramidKV, Ada-KV) or cannot run on GQA (H2O's real-drop cache); the suite of the
    # authors' forms (tests/golden-authors, refkv.oracle.recipes.AUTHORS_REGIMES) runs on it.
    "tiny-mha": lambda seed, dtype: _tiny_mha(seed, dtype),
    # ``tiny`` with each KV head repeated for its query heads (refkv.model.heads.repeat_kv_heads):
    # the regime of the authors' codes that select per query head on a GQA model (SnapKV,
    # PyramidKV, Ada-KV; tests/authors/).
    "tiny-kv-repeated": lambda seed, dtype: repeat_kv_heads(builtin_model(seed=seed, dtype=dtype)),
}


def _tiny_mha(seed: int, dtype: str) -> Model:
    """The built-in model's config with ``n_kv_heads = n_heads`` and its own seeded random weights."""
    config = replace(TINY, n_kv_heads=TINY.n_heads, name="tiny-mha")
    return Model(config, random_weights(config, seed=seed, dtype=dtype))


def build_model(name: str, seed: int, dtype) -> Model:
    """The model ``name`` of :data:`MODELS` with weights seeded by ``seed``, in ``dtype``."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name](seed, np.dtype(dtype).name)


def context_of(name: str) -> int:
    """The context (``max_positions``) of model ``name`` of :data:`MODELS`, without building it."""
    tiny = ("tiny", "tiny-mha", "tiny-kv-repeated")
    return TINY.max_positions if name in tiny else families.family_config(name).max_positions


def is_checkpoint(manifest: dict) -> bool:
    """Whether an end-to-end golden ran a real checkpoint rather than one of :data:`MODELS`
    (its coarse-dtype tolerance is then :data:`refkv.oracle.tolerance.E2E_RTOL`'s ``checkpoint`` row)."""
    model = manifest.get("model") if isinstance(manifest, dict) else None
    return not (isinstance(model, dict) and model.get("builder", "tiny") in MODELS)


def prompt_tokens(seed: int, length: int, vocab_size: int) -> np.ndarray:
    """The seeded prompt of an end-to-end golden (:data:`PROMPT_RULE`)."""
    return np.random.default_rng(seed).integers(0, vocab_size, length).astype(np.int64)


def decode_tokens(seed: int, length: int, vocab_size: int) -> np.ndarray:
    """The seeded tokens fed while decoding (:data:`DECODE_RULE`), teacher-forced."""
    return np.random.default_rng(seed).integers(0, vocab_size, length).astype(np.int64)


def _conventions(config) -> list[str]:
    """How a candidate must apply the exported arrays; one line per feature the model uses."""
    lines = ["projections are (in_features, out_features), applied as x @ W",
             "RoPE rotates dimension i with dimension i + d_head/2 of each head (rotate half)",
             "query head h belongs to KV head h // (n_heads / n_kv_heads)",
             "lm_head absent: tied to embed (logits = h @ embed.T)"]
    if config.attention_bias:
        lines.append("bq, bk, bv: biases added right after the projections (x @ W + b)")
    if config.output_bias:
        lines.append("bo: bias added after the output projection")
    if config.qk_norm:
        lines.append("q_norm, k_norm: RMSNorm over each head's d_head (eps = norm_eps), after the "
                     "projections and before RoPE")
    if config.rope_type != "default":
        lines.append(f"RoPE frequencies scaled by rope_type={config.rope_type!r} with the rope_* fields of "
                     f"the config (refkv.model.layers.rope_frequencies_of)")
    return lines


def _weights_settings(manifest: Path) -> dict | None:
    """The settings a weights manifest written by :func:`export_weights` records (None: no file)."""
    if not manifest.exists() and not manifest.is_symlink():
        return None
    try:
        m = read_json(manifest)
        return {"builder": m["model"]["builder"], "seed": m["model"]["seed"], "dtype": m["dtype"]}
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{manifest}: a file is there that is not a weights manifest refkv wrote ({err}); refusing "
                         f"to replace it -- use another name or remove it") from None


def export_weights(path, *, seed: int = 0, dtype="float64", model: str = "tiny") -> dict:
    """Write the weights of model ``model`` of :data:`MODELS` (default ``tiny``) as ``path`` (.npz)
    plus a JSON manifest beside it.

    For candidates that run the end-to-end goldens without refkv: array names are
    ``embed``, ``final_norm``, ``layers.<i>.<name>`` (``attn_norm``, ``wq``, ``wk``, ``wv``,
    ``wo``, ``mlp_norm``, ``w_gate``, ``w_up``, ``w_down``) and ``lm_head`` when untied.
    Projections are ``(in, out)`` and applied as ``x @ W``; RoPE rotates dimension ``i``
    with ``i + d_head/2`` ("rotate half"); see :mod:`refkv.model`.
    """
    path = Path(path)
    if path.suffix != ".npz":
        raise ValueError(f"the weights file must end in .npz, got {path.name}")
    folder = OutputFolder(path.parent, what="folder of --out")
    mine = {"builder": model, "seed": seed, "dtype": np.dtype(dtype).name}
    for name in (path.name, path.with_suffix(".json").name):
        folder.check_replaceable(name)
    folder.refuse_other_settings(path.with_suffix(".json").name, mine, _weights_settings(path.with_suffix(".json")),
                                 what="weights manifest")
    builder = model
    model = build_model(builder, seed, dtype)
    w = model.weights
    arrays = {"embed": w.embed, "final_norm": w.final_norm}
    if w.lm_head is not None:
        arrays["lm_head"] = w.lm_head
    for i, layer in enumerate(w.layers):
        for name, array in layer.arrays().items():  # the optional ones (biases, q/k norms) when present
            arrays[f"layers.{i}.{name}"] = array
    data = write_npz(path, arrays)
    manifest = {
        **header("refkv-weights"),
        "dtype": np.dtype(dtype).name,
        "model": {"name": model.config.name, "builder": builder, "config": model.config.to_dict(), "seed": seed,
                  "weights": WEIGHTS_RULE},
        "conventions": _conventions(model.config),
        "arrays": {"file": path.name, "sha256": sha256(data),
                   "contents": {k: {"dtype": a.dtype.name, "shape": list(a.shape)} for k, a in sorted(arrays.items())}},
    }
    write_json(path.with_suffix(".json"), manifest)
    return manifest

