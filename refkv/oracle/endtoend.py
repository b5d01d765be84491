"""End-to-end golden files: block prompt processing of a seeded prompt on a tiny model.

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

A golden with a compression schedule holds the same per round, plus the decoded tokens and
fingerprints of the rows each position holds (:data:`SCHEDULE_ARRAYS`,
:func:`refkv.oracle.recorder.run_schedule_golden`).

The per-decision scores are what makes the comparison tie-aware end to end: where a
candidate keeps another token than the reference, the two tokens' reference scores are at
hand (see :mod:`refkv.oracle.retention` and :mod:`refkv.oracle.walk`). This module reads and writes goldens;
:mod:`refkv.oracle.recorder` records them, running a model of :mod:`refkv.oracle.models`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..files import Target, atomic_write
from ..policies import Policy, get
from ..schedule import Schedule
from ..validation import MAX_CONTEXT, check_choice, check_float, check_lengths, check_size
from .io import dumps, npz_bytes, read_json, read_npz, sha256
from .schema import E2E_SCHEMA, check_header, require
from .vectors import python_params

__all__ = ["CANDIDATE_ARRAYS", "PRINT_RULE", "REFERENCE_ARRAYS", "SCHEDULE_ARRAYS", "EndToEnd", "end_to_end_files",
           "fingerprints", "is_schedule", "policy_from_manifest", "read_end_to_end", "write_end_to_end"]

REFERENCE_ARRAYS = ("prompt", "kept", "kept_count", "candidates", "candidate_count", "scores", "protected",
                    "logits")
CANDIDATE_ARRAYS = ("kept", "kept_count", "logits")
#: Arrays of a schedule golden beyond the per-round ones (see :func:`refkv.oracle.recorder.run_schedule_golden`).
SCHEDULE_ARRAYS = ("prompt", "decode", "round_step", "round_position", "kept", "kept_count", "candidates",
                   "candidate_count", "scores", "protected", "key_print", "value_print", "logits")
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


def is_schedule(manifest: dict) -> bool:
    """Whether an end-to-end manifest states a compression schedule (arrays indexed by round)."""
    return isinstance(manifest, dict) and "schedule" in manifest


def end_to_end_files(stem: str, manifest: dict, arrays: dict, compresslevel: int = 9) -> tuple[dict, bytes, bytes]:
    """The complete manifest and the bytes of ``<stem>.json`` and ``<stem>.npz`` (not written)."""
    data = npz_bytes(arrays, compresslevel)
    manifest = {**manifest, "arrays": {
        "file": f"{stem}.npz",
        "sha256": sha256(data),
        "contents": {name: {"dtype": a.dtype.name, "shape": list(a.shape)} for name, a in sorted(arrays.items())},
    }}
    return manifest, dumps(manifest).encode("utf-8"), data


def write_end_to_end(json_path, manifest: dict, arrays: dict, compresslevel: int = 9) -> dict:
    """Write the ``.npz`` (next to ``json_path``, same stem) and then the manifest; return it.

    ``compresslevel`` of the ``.npz`` (:func:`refkv.oracle.io.npz_bytes`): 9 for goldens, 1
    for the adapter's large candidates.

    ``json_path`` is a :class:`refkv.files.Target` of the folder the user named
    (``folder / "e2e/keydiff/x.json"``: written through its guards) or a plain path.
    """
    if not isinstance(json_path, Target):
        json_path = Path(json_path)
    manifest, text, data = end_to_end_files(Path(json_path.name).stem, manifest, arrays, compresslevel)
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
    return get(manifest["policy"]["name"], **python_params(manifest["policy"]["params"]))


#: Upper bound of every model size a golden's manifest states (``d_head``, ``vocab_size``, ...):
#: larger than any model refkv reads, small enough that nothing sized by it can exhaust memory.
#: A schedule golden folder has no ``suite.json``, so its manifests carry no checksum: their
#: sizes are bounded here, and checked against the arrays' shapes, before anything uses them.
MAX_MANIFEST_SIZE = 1 << 18

_CONFIG_SIZES = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff", "max_positions")


def _check_schedule_manifest(m: dict, arrays: dict, where: str) -> None:
    """The schema of a schedule golden's manifest: types, ranges and sizes, each against the arrays."""
    def field(obj, key, what=""):
        return require(obj, key, f"{where}: {what}" if what else where)

    def size(name, value, low=1, high=MAX_MANIFEST_SIZE):
        try:
            return check_size(name, value, low, high, why="a bound of golden manifests")
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    def obj(name, value):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {name} must be an object, got {type(value).__name__}")
        return value

    _choice(where, "dtype", field(m, "dtype"), ("float32", "float64"))
    cfg = obj("model.config", field(obj("model", m["model"]), "config", "model"))
    for key in _CONFIG_SIZES:
        size(f"model.config.{key}", field(cfg, key, "model.config"))
    policy = obj("policy", m["policy"])
    if not isinstance(policy.get("name"), str) or not isinstance(policy.get("params", {}), dict):
        raise ValueError(f"{where}: policy must have a string name and a params object")
    for part, array in (("prompt", "prompt"), ("decode", "decode")):
        length = size(f"{part}.length", field(obj(part, m[part]), "length", part), 0, MAX_CONTEXT)
        if array in arrays and arrays[array].shape != (length,):
            raise ValueError(f"{where}: {part}.length is {length}, the array {array!r} has shape "
                             f"{arrays[array].shape}")
    tolerance = obj("tolerance", m["tolerance"])
    for key in ("logits", "scores", "prints"):
        tol = obj(f"tolerance.{key}", field(tolerance, key, "tolerance"))
        for t in ("rtol", "atol"):
            try:
                check_float(f"tolerance.{key}.{t}", field(tol, t, f"tolerance.{key}"), 0.0)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
    schedule = obj("schedule", m["schedule"])
    try:
        Schedule.from_dict(schedule)
        check_lengths({"schedule.interval": (schedule.get("interval"), 1),
                       "schedule.block_size": (schedule.get("block_size"), 1),
                       "schedule.new_tokens": (schedule.get("new_tokens"), 0)})
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: schedule: {err}") from None


def _choice(where: str, name: str, value, choices) -> None:
    """:func:`refkv.validation.check_choice` with the file named."""
    try:
        check_choice(name, value, choices)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _check_schedule_arrays(m: dict, arrays: dict, where: str, npz_path) -> None:
    """Shapes of a schedule golden's arrays against its manifest (rounds, layers, KV heads)."""
    _check_schedule_manifest(m, arrays, where)
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
