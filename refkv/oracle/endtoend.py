"""End-to-end goldens: block prompt processing of a seeded prompt on the built-in model.

A golden is a JSON manifest (model config and seed, prompt rule, policy, ``N``, ``B``,
tolerances, array index) beside an ``.npz`` of arrays:

====================  ==============================  ======================================
array                 shape                           meaning
====================  ==============================  ======================================
``prompt``            (T,) int64                      the prompt's token ids
``kept``              (blocks, L, Hkv, K) int64       positions each layer/head holds after
                                                      each block, increasing, padded with -1
``kept_count``        (blocks, L) int64               how many of ``kept`` are real
``candidates``        (blocks, L, Hkv, C) int64       positions offered to the eviction of
                                                      that block and layer, padded with -1
``candidate_count``   (blocks, L) int64               0 where the layer did not evict
``scores``            (blocks, L, Hkv, C) float64     the reference scores of the candidates
                                                      (NaN padding; float32 and integer scores
                                                      are exact in float64)
``protected``         (blocks, L, Hkv, C) bool        the candidates the policy protected
``logits``            (vocab,) model dtype            logits of the prompt's last token
====================  ==============================  ======================================

The per-decision scores are what makes the comparison tie-aware end to end: where a
candidate keeps another token than the reference, the two tokens' reference scores are at
hand (see :mod:`refkv.oracle.retention` and :mod:`refkv.oracle.walk`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..engine import Engine, blocks
from ..model import Model, builtin_model, families
from ..policies import Policy
from .io import atomic_write, dumps, npz_bytes, read_json, read_npz, sha256, write_json, write_npz
from .schema import E2E_SCHEMA, FLOAT_FORMAT, SCHEDULE_VERSION, check_header, header, require
from .vectors import boundary_gap, json_params

__all__ = ["DEFAULT_E2E_TOLERANCE", "MODELS", "EndToEnd", "build_model", "decode_tokens", "end_to_end_files",
           "export_weights", "fingerprints", "is_schedule", "policy_from_manifest", "prompt_tokens",
           "read_end_to_end", "run_end_to_end", "run_schedule_golden", "write_end_to_end"]

#: rtol per dtype for logits and for score ties; ``atol = rtol * max(1, largest finite |value|)``.
DEFAULT_E2E_TOLERANCE = {"float64": 1e-8, "float32": 1e-4}

REFERENCE_ARRAYS = ("prompt", "kept", "kept_count", "candidates", "candidate_count", "scores", "protected",
                    "logits")
CANDIDATE_ARRAYS = ("kept", "kept_count", "logits")

PROMPT_RULE = "numpy.random.default_rng(seed).integers(0, vocab_size, length)"
WEIGHTS_RULE = ("refkv.model.random_weights(config, seed, dtype), config from refkv.model.builtin_model or "
                "refkv.model.families.tiny (export: refkv golden weights --model NAME)")


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
}


def build_model(name: str, seed: int, dtype) -> Model:
    """The model ``name`` of :data:`MODELS` with weights seeded by ``seed``, in ``dtype``."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name](seed, np.dtype(dtype).name)


def prompt_tokens(seed: int, length: int, vocab_size: int) -> np.ndarray:
    """The seeded prompt of an end-to-end golden (``PROMPT_RULE``)."""
    return np.random.default_rng(seed).integers(0, vocab_size, length).astype(np.int64)


def _tolerance(dtype, values) -> dict:
    rtol = DEFAULT_E2E_TOLERANCE[np.dtype(dtype).name]
    v = np.abs(np.asarray(values, dtype=np.float64))
    v = v[np.isfinite(v)]
    return {"rtol": rtol, "atol": rtol * max(1.0, float(v.max()) if v.size else 1.0)}


def _pad(rows, width, fill, dtype):
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def run_end_to_end(policy: Policy, *, budget: int | None, block_size: int | None, dtype="float64",
                   prompt_length: int = 40, model_seed: int = 0, prompt_seed: int = 1,
                   model: str = "tiny") -> tuple[dict, dict]:
    """Run a model of :data:`MODELS` (default the built-in ``tiny``) under ``policy``; record a golden.

    ``block_size=None`` is one-shot prefill: the whole prompt attends (full square causal
    attention), then each layer evicts once to ``budget``.

    Returns
    -------
    manifest : dict
        Without the ``arrays`` entry (added by :func:`write_end_to_end`).
    arrays : dict of str to ndarray

    Raises
    ------
    ValueError
        If the policy refuses the budget or the block size (the engine's errors).
    """
    builder = model
    model = build_model(builder, model_seed, dtype)
    cfg = model.config
    prompt = prompt_tokens(prompt_seed, prompt_length, cfg.vocab_size)
    engine = Engine(model, policy, budget, record="views")
    logits = engine.prefill(prompt, block_size)
    n_blocks = len(engine.trace.kept)
    if n_blocks != len(blocks(prompt, block_size)):
        raise RuntimeError("the trace does not hold one entry per block")
    log: dict = {}
    for event in engine.trace.evictions:  # at most one per (block, layer): the engine evicts once per step
        key = (event.block, event.layer)
        if key in log:
            raise RuntimeError(f"two evictions in block {event.block}, layer {event.layer}")
        view = event.view
        log[key] = (event.positions, np.asarray(policy.score(view), dtype=np.float64),
                    np.asarray(policy.protected(view), dtype=bool), event.kept)

    hkv, n_layers = cfg.n_kv_heads, cfg.n_layers
    kept_width = max(k.shape[1] for per_block in engine.trace.kept for k in per_block)
    cand_width = max((entry[0].shape[1] for entry in log.values()), default=0)
    kept = np.full((n_blocks, n_layers, hkv, kept_width), -1, dtype=np.int64)
    kept_count = np.zeros((n_blocks, n_layers), dtype=np.int64)
    candidates = np.full((n_blocks, n_layers, hkv, cand_width), -1, dtype=np.int64)
    candidate_count = np.zeros((n_blocks, n_layers), dtype=np.int64)
    scores = np.full((n_blocks, n_layers, hkv, cand_width), np.nan)
    protected = np.zeros((n_blocks, n_layers, hkv, cand_width), dtype=bool)
    closest = None
    for b, per_block in enumerate(engine.trace.kept):
        for layer, positions in enumerate(per_block):
            kept[b, layer, :, :positions.shape[1]] = positions
            kept_count[b, layer] = positions.shape[1]
            if (b, layer) in log:
                closest = _store_eviction(log[(b, layer)], (b, layer), candidates, candidate_count, scores,
                                          protected, closest, "block")

    tol_scores = _tolerance(dtype, scores)
    manifest = {
        **header(E2E_SCHEMA),
        "float_format": FLOAT_FORMAT,
        "dtype": np.dtype(dtype).name,
        "model": {"name": cfg.name, "builder": builder, "config": cfg.to_dict(), "seed": model_seed,
                  "weights": WEIGHTS_RULE},
        "prompt": {"length": prompt_length, "seed": prompt_seed, "rule": PROMPT_RULE},
        "policy": {"name": policy.name, "params": json_params(policy.params()), "needs": sorted(policy.needs),
                   "evict_before_attention": bool(policy.evict_before_attention)},
        "budget": budget,
        "block_size": block_size,
        "mode": "oneshot" if n_blocks == 1 else "block",
        "n_blocks": n_blocks,
        "evictions": int((candidate_count > 0).sum()),
        "tolerance": {"logits": _tolerance(dtype, logits), "scores": tol_scores},
        "closest_call": closest,
    }
    arrays = {"prompt": prompt, "kept": kept, "kept_count": kept_count, "candidates": candidates,
              "candidate_count": candidate_count, "scores": scores, "protected": protected,
              "logits": np.asarray(logits)}
    return manifest, arrays


def end_to_end_files(stem: str, manifest: dict, arrays: dict) -> tuple[dict, bytes, bytes]:
    """The complete manifest and the bytes of ``<stem>.json`` and ``<stem>.npz`` (not written)."""
    data = npz_bytes(arrays)
    manifest = {**manifest, "arrays": {
        "file": f"{stem}.npz",
        "sha256": sha256(data),
        "contents": {name: {"dtype": a.dtype.name, "shape": list(a.shape)} for name, a in sorted(arrays.items())},
    }}
    return manifest, dumps(manifest).encode("utf-8"), data


def write_end_to_end(json_path, manifest: dict, arrays: dict) -> dict:
    """Write the ``.npz`` (next to ``json_path``, same stem) and then the manifest; return it."""
    json_path = Path(json_path)
    manifest, text, data = end_to_end_files(json_path.stem, manifest, arrays)
    atomic_write(json_path.with_suffix(".npz"), data)
    atomic_write(json_path, text)
    return manifest


@dataclass(frozen=True)
class EndToEnd:
    """An end-to-end golden read back: its manifest and its arrays."""

    path: str
    manifest: dict
    arrays: dict

    @property
    def label(self) -> str:
        m = self.manifest
        pol = m.get("policy", {}).get("name", "?")
        if is_schedule(m):
            return f"{pol} {m.get('schedule_text', 'schedule')} {m.get('dtype', '')}".strip()
        return f"{pol} N={m.get('budget')} B={m.get('block_size')} {m.get('dtype', '')}".strip()


def read_end_to_end(path, *, candidate: bool = False) -> EndToEnd:
    """Read and validate an end-to-end golden (the JSON manifest; the npz beside it).

    Parameters
    ----------
    path : path-like
        The manifest.
    candidate : bool
        A candidate's golden: only ``kept``, ``kept_count`` and ``logits`` are required.

    Raises
    ------
    ValueError
        For an unknown schema version, a missing field or array, a checksum mismatch, or
        arrays whose shape or dtype disagree with the manifest or with each other.
    """
    path = Path(path)
    where = str(path)
    m = read_json(path)
    check_header(m, E2E_SCHEMA, where)
    index = require(m, "arrays", where)
    file, contents = require(index, "file", f"{where}: arrays"), require(index, "contents", f"{where}: arrays")
    if not isinstance(file, str) or Path(file).name != file or not isinstance(contents, dict):
        raise ValueError(f"{where}: arrays.file must be a file name beside the manifest and arrays.contents an "
                         f"object, got {type(file).__name__} {str(file)[:60]!r} and {type(contents).__name__}")
    npz_path = path.parent / file
    arrays = read_npz(npz_path)
    if "sha256" in index and not candidate:  # a candidate may reuse the reference's manifest
        actual = sha256(npz_path.read_bytes())
        if actual != index["sha256"]:
            raise ValueError(f"{npz_path}: checksum mismatch: the manifest says sha256 {index['sha256']}, "
                             f"the file has {actual} (regenerate, or restore the file)")
    required = CANDIDATE_ARRAYS if candidate else (SCHEDULE_ARRAYS if is_schedule(m) else REFERENCE_ARRAYS)
    for name in required:
        if name not in arrays:
            raise ValueError(f"{npz_path}: missing array {name!r}")
        if name not in contents:
            raise ValueError(f"{where}: missing field 'arrays.contents.{name}'")
    for name, a in arrays.items():
        if name not in contents:
            continue
        spec = contents[name]
        declared = require(spec, "shape", f"{where}: arrays.contents.{name}")
        if not isinstance(declared, list):
            raise ValueError(f"{where}: arrays.contents.{name}.shape must be a list, got {type(declared).__name__}")
        declared = tuple(declared)
        if a.shape != declared:
            raise ValueError(f"{npz_path}: shape mismatch: array {name!r} has shape {a.shape}, "
                             f"the manifest says {declared}")
        if a.dtype.name != require(spec, "dtype", f"{where}: arrays.contents.{name}"):
            raise ValueError(f"{npz_path}: array {name!r} has dtype {a.dtype}, the manifest says {spec['dtype']}")
    if candidate:
        return EndToEnd(where, m, arrays)
    if is_schedule(m):
        for key in ("dtype", "model", "prompt", "decode", "policy", "tolerance"):
            require(m, key, where)
        _check_schedule_arrays(m, arrays, where, npz_path)
        for key in ("logits", "scores", "prints"):
            tol = require(m["tolerance"], key, f"{where}: tolerance")
            for t in ("rtol", "atol"):
                require(tol, t, f"{where}: tolerance.{key}")
        return EndToEnd(where, m, arrays)

    for key in ("dtype", "model", "prompt", "policy", "budget", "block_size", "n_blocks", "tolerance"):
        require(m, key, where)
    cfg = require(m["model"], "config", f"{where}: model")
    n_layers = require(cfg, "n_layers", f"{where}: model.config")
    hkv = require(cfg, "n_kv_heads", f"{where}: model.config")
    vocab = require(cfg, "vocab_size", f"{where}: model.config")
    nb = m["n_blocks"]
    lead = (nb, n_layers)
    checks = {"kept": (*lead, hkv), "kept_count": lead, "candidates": (*lead, hkv), "candidate_count": lead,
              "scores": (*lead, hkv), "protected": (*lead, hkv), "logits": (vocab,),
              "prompt": (require(m["prompt"], "length", f"{where}: prompt"),)}
    for name, expected in checks.items():
        got = arrays[name].shape[:len(expected)]
        if got != expected:
            raise ValueError(f"{npz_path}: shape mismatch: array {name!r} must start with {expected} "
                             f"(blocks, layers, KV heads from the manifest), got {arrays[name].shape}")
    width = arrays["candidates"].shape[-1]
    if arrays["scores"].shape[-1] != width or arrays["protected"].shape[-1] != width:
        raise ValueError(f"{npz_path}: shape mismatch: candidates, scores and protected must share their last axis")
    if arrays["logits"].dtype.name != m["dtype"]:
        raise ValueError(f"{npz_path}: logits have dtype {arrays['logits'].dtype}, the manifest's dtype is "
                         f"{m['dtype']}")
    for key in ("logits", "scores"):
        tol = require(m["tolerance"], key, f"{where}: tolerance")
        for t in ("rtol", "atol"):
            require(tol, t, f"{where}: tolerance.{key}")
    return EndToEnd(where, m, arrays)


def policy_from_manifest(manifest: dict) -> Policy:
    """The policy an end-to-end golden was generated with."""
    from ..policies import get
    from .vectors import python_params

    return get(manifest["policy"]["name"], **python_params(manifest["policy"]["params"]))



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


# -- goldens with a compression schedule (refkv.schedule) ------------------------------------------------
#: Arrays of a schedule golden beyond the per-round ones (see :func:`run_schedule_golden`).
SCHEDULE_ARRAYS = ("prompt", "decode", "round_step", "round_position", "kept", "kept_count", "candidates",
                   "candidate_count", "scores", "protected", "key_print", "value_print", "logits")
DECODE_RULE = "numpy.random.default_rng(seed).integers(0, vocab_size, new_tokens)"
#: How a cache row's key (value) is fingerprinted: its dot product with this unit vector. A row
#: that holds another position's key than it claims differs by about the keys' norm.
PRINT_RULE = "row @ u, u = v / ||v||, v = numpy.random.default_rng(seed).standard_normal(d_head) (float64)"
PRINT_SEED = 0


def print_vector(d_head: int, seed: int = PRINT_SEED) -> np.ndarray:
    """The unit vector ``u`` of :data:`PRINT_RULE` (float64, shape ``(d_head,)``)."""
    v = np.random.default_rng(seed).standard_normal(d_head)
    return v / np.linalg.norm(v)


def fingerprints(rows, d_head: int, seed: int = PRINT_SEED) -> np.ndarray:
    """``rows @ u`` in float64: the fingerprint of every key (value) of ``rows`` (..., d_head)."""
    return np.asarray(rows, dtype=np.float64) @ print_vector(d_head, seed)


def decode_tokens(seed: int, length: int, vocab_size: int) -> np.ndarray:
    """The seeded tokens fed while decoding (:data:`DECODE_RULE`), teacher-forced."""
    return np.random.default_rng(seed).integers(0, vocab_size, length).astype(np.int64)


def is_schedule(manifest: dict) -> bool:
    """Whether an end-to-end manifest states a compression schedule (arrays indexed by round)."""
    return isinstance(manifest, dict) and "schedule" in manifest


def _store_eviction(entry, at, candidates, candidate_count, scores, protected, closest, step_name):
    """Write one recorded eviction (candidates, scores, protected flags; ``entry`` as logged
    from the trace) into the golden's arrays at ``at`` = (step, layer), and return the
    closest call so far (the smallest gap at a kept/evicted boundary), updated."""
    cand, s, prot, cols = entry
    c = cand.shape[1]
    candidates[at][:, :c] = cand
    candidate_count[at] = c
    scores[at][:, :c] = s
    protected[at][:, :c] = prot
    for h, gap in enumerate(boundary_gap(s, cols, prot)):
        if gap is not None and (closest is None or gap < closest["gap"]):
            closest = {step_name: at[0], "layer": at[1], "head": h, "gap": gap}
    return closest


def run_schedule_golden(policy: Policy, schedule, *, dtype="float64", prompt_length: int = 24,
                        model_seed: int = 0, prompt_seed: int = 1, decode_seed: int = 2,
                        model: str = "tiny", built: Model | None = None) -> tuple[dict, dict]:
    """Run a model under ``policy`` and :class:`refkv.schedule.Schedule` ``schedule``; record a golden.

    Arrays (``R`` rounds, see :mod:`refkv.schedule`; per round, layer and KV head):

    ====================  ==============================  ======================================
    array                 shape                           meaning
    ====================  ==============================  ======================================
    ``prompt``            (T,) int64                      the prompt
    ``decode``            (D,) int64                      the tokens fed one at a time after it
    ``round_step``        (R,) int64                      forward call of each round (prefill
                                                          blocks first, from 0)
    ``round_position``    (R,) int64                      tokens processed after the round
    ``kept``              (R, L, Hkv, K) int64            positions held after the round,
                                                          increasing, padded with -1
    ``kept_count``        (R, L) int64
    ``candidates``        (R, L, Hkv, C) int64            positions offered to the round's
                                                          eviction (candidate_count 0: none)
    ``candidate_count``   (R, L) int64
    ``scores``            (R, L, Hkv, C) float64          reference scores of the candidates
    ``protected``         (R, L, Hkv, C) bool
    ``key_print``         (R, L, Hkv, K) float64          fingerprint of the key each kept
                                                          position holds (:data:`PRINT_RULE`)
    ``value_print``       (R, L, Hkv, K) float64          the same for its value
    ``logits``            (vocab,) model dtype            logits of the last token fed
    ====================  ==============================  ======================================

    ``built`` is a model already built (a real checkpoint); ``model`` then only names it.
    """
    from ..schedule import run_schedule

    builder = model
    model = built if built is not None else build_model(builder, model_seed, dtype)
    cfg = model.config
    prompt = prompt_tokens(prompt_seed, prompt_length, cfg.vocab_size)
    new = decode_tokens(decode_seed, schedule.new_tokens, cfg.vocab_size)
    engine = Engine(model, policy, None, record="views")
    snapshots: list[tuple] = []

    def on_step(step, rnd):
        if rnd is not None:
            # Empty slots of an uneven cache (AdaKV, PyramidKV) are recorded as -1, like the padding.
            snapshots.append((rnd, [(c.positions_or(-1), c.keys.copy(), c.values.copy()) for c in engine.caches]))

    logits, rounds = run_schedule(engine, prompt, new, schedule, on_step=on_step)
    by_step = {r.step: i for i, r in enumerate(rounds)}
    log: dict = {}
    for event in engine.trace.evictions:
        key = (by_step[event.block], event.layer)
        if key in log:
            raise RuntimeError(f"two evictions in round {key[0]}, layer {key[1]}")
        view = event.view
        log[key] = (event.positions, np.asarray(policy.score(view), dtype=np.float64),
                    np.asarray(policy.protected(view), dtype=bool), event.kept)

    n_rounds, n_layers, hkv = len(rounds), cfg.n_layers, cfg.n_kv_heads
    kept_width = max((s[0].shape[1] for _, per in snapshots for s in per), default=0)
    cand_width = max((entry[0].shape[1] for entry in log.values()), default=0)
    kept = np.full((n_rounds, n_layers, hkv, kept_width), -1, dtype=np.int64)
    kept_count = np.zeros((n_rounds, n_layers), dtype=np.int64)
    key_print = np.full((n_rounds, n_layers, hkv, kept_width), np.nan)
    value_print = np.full((n_rounds, n_layers, hkv, kept_width), np.nan)
    candidates = np.full((n_rounds, n_layers, hkv, cand_width), -1, dtype=np.int64)
    candidate_count = np.zeros((n_rounds, n_layers), dtype=np.int64)
    scores = np.full((n_rounds, n_layers, hkv, cand_width), np.nan)
    protected = np.zeros((n_rounds, n_layers, hkv, cand_width), dtype=bool)
    closest = None
    for r, (_, per_layer) in enumerate(snapshots):
        for layer, (positions, keys, values) in enumerate(per_layer):
            n = positions.shape[1]
            kept[r, layer, :, :n] = positions
            kept_count[r, layer] = n
            real = positions >= 0  # (Hkv, n): False at an empty slot, whose print stays NaN
            key_print[r, layer, :, :n] = np.where(real, fingerprints(keys, cfg.d_head), np.nan)
            value_print[r, layer, :, :n] = np.where(real, fingerprints(values, cfg.d_head), np.nan)
            if (r, layer) in log:
                closest = _store_eviction(log[(r, layer)], (r, layer), candidates, candidate_count, scores,
                                          protected, closest, "round")

    prints = np.concatenate([key_print.ravel(), value_print.ravel()])
    manifest = {
        **header(E2E_SCHEMA, SCHEDULE_VERSION),
        "float_format": FLOAT_FORMAT,
        "dtype": np.dtype(model.dtype).name,
        "model": {"name": cfg.name, "builder": builder, "config": cfg.to_dict(), "seed": model_seed,
                  "weights": WEIGHTS_RULE if built is None else f"the checkpoint {builder}"},
        "prompt": {"length": len(prompt), "seed": prompt_seed, "rule": PROMPT_RULE},
        "decode": {"length": schedule.new_tokens, "seed": decode_seed, "rule": DECODE_RULE,
                   "note": "teacher-forced: the candidate feeds these tokens one at a time after the prompt"},
        "policy": {"name": policy.name, "params": json_params(policy.params()), "needs": sorted(policy.needs),
                   "evict_before_attention": bool(policy.evict_before_attention)},
        "schedule": schedule.to_dict(),
        "schedule_text": schedule.describe(),
        "budget": schedule.budget,
        "block_size": schedule.block_size,
        "mode": "schedule",
        "rounds": [{"step": r.step, "phase": r.phase, "budget": r.budget, "position": r.position} for r in rounds],
        "n_rounds": n_rounds,
        "evictions": int((candidate_count > 0).sum()),
        "prints": {"rule": PRINT_RULE, "seed": PRINT_SEED},
        "tolerance": {"logits": _tolerance(model.dtype, logits), "scores": _tolerance(model.dtype, scores),
                      "prints": _tolerance(model.dtype, prints)},
        "closest_call": closest,
    }
    arrays = {"prompt": prompt, "decode": new, "round_step": np.array([r.step for r in rounds], dtype=np.int64),
              "round_position": np.array([r.position for r in rounds], dtype=np.int64), "kept": kept,
              "kept_count": kept_count, "candidates": candidates, "candidate_count": candidate_count,
              "scores": scores, "protected": protected, "key_print": key_print, "value_print": value_print,
              "logits": np.asarray(logits)}
    return manifest, arrays


def _check_schedule_arrays(m: dict, arrays: dict, where: str, npz_path) -> None:
    """Shapes of a schedule golden's arrays against its manifest (rounds, layers, KV heads)."""
    from ..schedule import Schedule

    Schedule.from_dict(require(m, "schedule", where))
    rounds = require(m, "rounds", where)
    if not isinstance(rounds, list):
        raise ValueError(f"{where}: rounds must be a list")
    cfg = require(m["model"], "config", f"{where}: model")
    lead = (len(rounds), require(cfg, "n_layers", f"{where}: model.config"))
    hkv = require(cfg, "n_kv_heads", f"{where}: model.config")
    checks = {"kept": (*lead, hkv), "kept_count": lead, "candidates": (*lead, hkv), "candidate_count": lead,
              "scores": (*lead, hkv), "protected": (*lead, hkv), "key_print": (*lead, hkv),
              "value_print": (*lead, hkv), "round_step": lead[:1], "round_position": lead[:1],
              "logits": (require(cfg, "vocab_size", f"{where}: model.config"),)}
    for name, expected in checks.items():
        if name not in arrays:
            raise ValueError(f"{npz_path}: missing array {name!r}")
        got = arrays[name].shape[:len(expected)]
        if got != expected:
            raise ValueError(f"{npz_path}: shape mismatch: array {name!r} must start with {expected} "
                             f"(rounds, layers, KV heads from the manifest), got {arrays[name].shape}")
    for name in ("key_print", "value_print"):
        if arrays[name].shape != arrays["kept"].shape:
            raise ValueError(f"{npz_path}: shape mismatch: {name} must have kept's shape {arrays['kept'].shape}")
