"""Pieces every experiment shares: models, policy specs, text, dense captures, tables.

Notes
-----
**Policy specs.** A policy is named on the command line and in the records by a *spec*:
``name`` or ``name:param=value,param=value`` (values are Python literals, or plain words
taken as strings), e.g. ``caote:base=h2o,fast=True``, read by :mod:`refkv.policies.spec`.
:func:`canonical_spec` puts the parameters in sorted order so one policy has one spec (and
one cell key).

**Dense captures.** :func:`dense_capture` runs the model with no cache limit and keeps
every layer's RoPE'd queries, keys and values. It is the same computation as
:meth:`refkv.model.Model.forward_full` (a test checks the logits agree); the attention
route is :func:`refkv.attention.attend` without weights, so nothing of size ``T x T``
is kept. Experiments form attention weights per layer when they need them.

**Text.** Real English prose from two offline sources
(:data:`refkv.model.sample_text.PROSE_SOURCES`): CPython's ``pydoc_data.topics``
(``"pydoc_prose"``, technical) and the shipped King James narrative chapters
(``"kjv_narrative"``). Each source is tokenised once; segment ``s`` of length ``T`` is
tokens ``[s T, (s + 1) T)`` of that stream, so segments of a source never overlap.
Perplexity takes its texts from both sources in turn (:func:`text_source`); the other
experiments read ``pydoc_prose``.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import policies
from ..attention import attend
from ..files import atomic_write
from ..policies.spec import canonical_spec, make_policy, parse_spec
from ..validation import check_context

__all__ = [
    "COMPARABLE_BASELINES",
    "LayerCapture",
    "best_of_grid",
    "cached_capture",
    "canonical_spec",
    "cell_tokens",
    "configuration",
    "default_policies",
    "dense_capture",
    "equal_memory_budget",
    "evicting_policies",
    "format_spec_label",
    "grid_axes",
    "layer_attention",
    "load_model",
    "make_policy",
    "mat_grid",
    "parse_spec",
    "policy_cells",
    "policy_error",
    "prefill_or_skip",
    "prose_tokens",
    "text_source",
    "write_csv",
]

#: The CAOTE variants of the default list with FastCAOTE (Eq. 22) instead.
FAST_CAOTE = tuple(f"{spec},fast=True" for spec in policies.policy_class("caote").card.experiment_specs)

_MODELS: dict[tuple[str, str], tuple] = {}
_TOKENS: dict[tuple, np.ndarray] = {}


# -- models --------------------------------------------------------------------------------
def load_model(name: str, dtype: str):
    """The model and tokenizer ``name`` in ``dtype``, loaded once per process."""
    key = (name, dtype)
    if key not in _MODELS:
        from ..model.loading import load_with_tokenizer

        _MODELS[key] = load_with_tokenizer(name, dtype=np.dtype(dtype))
    return _MODELS[key]


# -- policy specs (parsed by refkv.policies.spec) -------------------------------------------
def format_spec_label(spec: str) -> str:
    """A short human label: a policy's ``label`` (``keydiff`` -> ``KeyDiff``), ``caote:base=h2o`` ->
    ``H2O+CAOTE``; specs with other parameters unchanged."""
    name, params = parse_spec(spec)
    if name == "caote" and set(params) <= {"base", "fast"}:
        base = str(params.get("base", "h2o"))
        upper = (policies.policy_class(base).card.label or base) if base in policies.available() else base
        return f"{upper}+{'Fast' if params.get('fast') else ''}CAOTE"
    return (policies.policy_class(name).card.label or name) if spec == name else spec


def evicting_policies() -> list[str]:
    """The default specs of every evicting policy, in ``table_order``: each class's
    ``experiment_specs``, or its name (classes with ``in_experiments = False`` left out)."""
    classes = sorted((policies.policy_class(name) for name in policies.available()),
                     key=lambda cls: (cls.card.table_order, cls.name))
    return [spec for cls in classes if cls.evicts and cls.in_experiments
            for spec in (cls.card.experiment_specs or (cls.name,))]


def default_policies(extra: tuple[str, ...] = (), *, caote: bool = True) -> list[str]:
    """The default evicting policies (canonical specs), then ``extra``.

    ``caote=False`` leaves out the CAOTE variants of the default list (``extra`` is kept).
    """
    base = [spec for spec in evicting_policies() if caote or not spec.startswith("caote")]
    return [canonical_spec(spec) for spec in dict.fromkeys((*base, *extra))]


def policy_error(spec: str, budget, block, config) -> str | None:
    """Why ``spec`` cannot run with this budget and block size, or None if it can.

    The policy answers: ``check`` for the budget, ``max_block`` for the block (a policy
    that evicts before attention must fit the block beside what it keeps).
    """
    try:
        policy = make_policy(spec)
        if budget is not None:
            policy.check(budget, config)
            limit = policy.max_block(budget, config)
            if limit is not None and (block is None or block > limit):
                whole = "the whole prompt" if block is None else str(block)
                return (f"{spec} evicts before attention, so a block must fit beside what it keeps: "
                        f"B must be <= {limit} with N={budget}, got B={whole}")
    except ValueError as err:
        return str(err)
    return None


def prefill_or_skip(params: dict, model, tokens, *, on_block=None):
    """Run a cell's policy (``params["policy"]``, ``"budget"``, ``"block"``) over ``tokens``.

    Returns ``(engine, logits, None)`` (the last token's logits), or ``(None, None, reason)``
    when the policy cannot run this cell: refused up front (:func:`policy_error`) or by the
    engine mid-run. ``on_block(start, logits)`` is called after each block with all its
    logits (B, vocab) when given (perplexity reads every token's).
    """
    spec, budget, block = params["policy"], params["budget"], params["block"]
    check_context(len(tokens), model.config.max_positions, f"the cell's prompt ({params.get('length', '?')} "
                  f"tokens asked)")  # a prompt beyond the context is an error of the grid, not a skip
    reason = policy_error(spec, budget, block, model.config)
    if reason is not None:
        return None, None, reason
    from ..engine import Engine, blocks

    engine = Engine(model, make_policy(spec), budget)
    logits, start = None, 0
    try:
        for chunk in blocks(model.check_tokens(tokens), block):
            logits = engine.forward(chunk, all_logits=on_block is not None)
            if on_block is not None:
                on_block(start, logits)
                logits = logits[-1]
            start += len(chunk)
    except ValueError as err:  # a block / budget combination the policy refuses mid-run
        return None, None, str(err)
    return engine, logits, None


# -- text ----------------------------------------------------------------------------------
def prose_tokens(model_name: str, dtype: str, length: int, segment: int = 0,
                 source: str = "pydoc_prose") -> np.ndarray:
    """Tokens ``[segment * length, (segment + 1) * length)`` of the tokenised prose ``source``
    (one of :data:`refkv.model.sample_text.PROSE_SOURCES`)."""
    from ..model.sample_text import prose

    if length < 2 or segment < 0:
        raise ValueError(f"length must be >= 2 and segment >= 0, got {length} and {segment}")
    _, tokenizer = load_model(model_name, dtype)
    key = (model_name, dtype, source)
    needed = (segment + 1) * length
    if key not in _TOKENS or len(_TOKENS[key]) < needed:
        # ~4.5 characters per BPE token of English, 1 per byte token: 8 is generous
        _TOKENS[key] = np.asarray(tokenizer.encode(prose(source, needed * 8)), dtype=np.int64)
    tokens = _TOKENS[key]
    if len(tokens) < needed:
        raise ValueError(f"the prose {source!r} holds {len(tokens)} tokens; segment {segment} of length "
                         f"{length} needs {needed}")
    return tokens[segment * length:needed]


def prose_tail(model_name: str, dtype: str, source: str, start: int) -> np.ndarray:
    """All tokens of the prose ``source`` from token ``start`` on (the passkey haystacks of
    the registered design draw from beyond the perplexity segments)."""
    from ..model.sample_text import prose

    _, tokenizer = load_model(model_name, dtype)
    key = (model_name, dtype, source, "all")
    if key not in _TOKENS:
        _TOKENS[key] = np.asarray(tokenizer.encode(prose(source, _ALL_PROSE_CHARS)), dtype=np.int64)
    tokens = _TOKENS[key]
    if len(tokens) <= start:
        raise ValueError(f"the prose {source!r} holds {len(tokens)} tokens, none from token {start} on")
    return tokens[start:]


#: Characters asked of a prose source for its whole text (both shipped sources hold less).
_ALL_PROSE_CHARS = 120_000


def text_source(number: int) -> tuple[str, int]:
    """Text ``number`` of a perplexity grid: ``(source, segment)``, taking the sources of
    :data:`~refkv.model.sample_text.PROSE_SOURCES` in turn (text 0 is pydoc segment 0, text 1
    King James segment 0, text 2 pydoc segment 1, ...), so any number of texts spans both."""
    from ..model.sample_text import PROSE_SOURCES

    if number < 0:
        raise ValueError(f"number must be >= 0, got {number}")
    return PROSE_SOURCES[number % len(PROSE_SOURCES)], number // len(PROSE_SOURCES)


# -- dense captures ------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCapture:
    """One layer's RoPE'd queries ``q`` (H, T, d), keys ``k`` and values ``v`` (Hkv, T, d)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


def dense_capture(model, tokens) -> tuple[list[LayerCapture], np.ndarray]:
    """Run ``tokens`` with no eviction; every layer's q, k, v and the last logits."""
    tokens = model.check_tokens(tokens)
    positions = np.arange(len(tokens), dtype=np.int64)
    rope = model.rope(positions)
    key_positions = np.broadcast_to(positions, (model.config.n_kv_heads, len(tokens)))
    x = model.embed(tokens)
    layers = []
    for layer in range(model.config.n_layers):
        q, k, v = model.qkv(layer, x, rope)
        out, _ = attend(q, k, v, positions, key_positions)
        layers.append(LayerCapture(q, k, v))
        x = x + model.attn_out(layer, out)
        x = x + model.mlp(layer, x)
    return layers, model.head(x[-1:])[0]


def cell_tokens(params: dict) -> np.ndarray:
    """A dense cell's prompt: the first ``params["length"]`` tokens of its text.

    A cell names its text by ``"text"`` (a prose source, default the pydoc prose) and
    ``"segment"``; with ``"text_length"`` the segment is counted in texts of that length and
    the prompt is that text's first ``length`` tokens (the registered design's prompts are
    the first 512 tokens of the 1,024-token perplexity texts), else in prompts of ``length``.
    """
    length = params["length"]
    text_length = params.get("text_length") or length
    if text_length < length:
        raise ValueError(f"text_length must be >= length ({length}), got {text_length}")
    tokens = prose_tokens(params["model"], params["dtype"], text_length, params["segment"],
                          params.get("text", "pydoc_prose"))
    return tokens[:length]


_CAPTURES: dict[tuple, tuple] = {}


def cached_capture(model_name: str, dtype: str, length: int, segment: int, source: str = "pydoc_prose",
                   text_length: int | None = None):
    """:func:`dense_capture` of a cell's prompt (:func:`cell_tokens`: the first ``length``
    tokens of segment ``segment`` of ``source`` counted in texts of ``text_length``, default
    ``length``), kept per process.

    One capture is kept at a time (the real model's is ~100 MB for 1K tokens); cells of
    the same prompt that run one after the other in a process share it.
    """
    key = (model_name, dtype, length, segment, source, text_length)
    if key not in _CAPTURES:
        model, _ = load_model(model_name, dtype)
        _CAPTURES.clear()
        tokens = cell_tokens({"model": model_name, "dtype": dtype, "length": length, "segment": segment,
                              "text": source, "text_length": text_length})
        _CAPTURES[key] = dense_capture(model, tokens)
    return _CAPTURES[key]


def layer_attention(params: dict):
    """A cell's model and, layer by layer, its dense capture and causal attention weights.

    Reads ``params["model"]``, ``"dtype"``, ``"length"`` (``T``), ``"segment"`` and, where
    given, ``"text"`` and ``"text_length"`` (:func:`cell_tokens`). Returns
    ``(model, layers)`` where ``layers`` yields ``(layer, capture, weights)`` with ``weights``
    the (Hkv, g, T, T) attention of every query over the prompt, formed one layer at a time.
    """
    from ..attention import attention_weights

    model, _ = load_model(params["model"], params["dtype"])
    captures, _ = cached_capture(params["model"], params["dtype"], params["length"], params["segment"],
                                 params.get("text", "pydoc_prose"), params.get("text_length"))
    positions = np.arange(params["length"], dtype=np.int64)  # (T,)
    kv_positions = np.broadcast_to(positions, (model.config.n_kv_heads, len(positions)))  # (Hkv, T)

    def each():
        for layer, cap in enumerate(captures):
            yield layer, cap, attention_weights(cap.q, cap.k, positions, kv_positions)  # (Hkv, g, T, T)

    return model, each()


# -- grids ---------------------------------------------------------------------------------
def grid_axes(settings, policies, budgets, blocks) -> tuple[list[str], list, list]:
    """The grid's policies (canonical specs), budgets and block sizes: the user's settings
    where given, else these defaults."""
    return ([canonical_spec(p) for p in (settings.policies or policies)], list(settings.budgets or budgets),
            list(settings.blocks or blocks))


def policy_cells(base: dict, policies, budgets, blocks) -> list[dict]:
    """One cell per evicting policy x budget x block size (``full`` left out), each ``base`` plus
    ``policy``, ``budget`` and ``block``."""
    return [{**base, "policy": policy, "budget": budget, "block": block}
            for policy in policies if policy != "full" for budget in budgets for block in blocks]


# -- comparable baselines (issue 16) -------------------------------------------------------
#: Baselines under the configurations the seed papers compare against, run beside each
#: policy's own default: L2 with HashEvict's protection (first 4 + last 10, HashEvict
#: Sec. 4); H2O as KeyDiff App. A.1 and CAOTE Sec. 2 score it (accumulated attention, no
#: recent window), with CAOTE and FastCAOTE over it; KeyDiff with a recent reserve of 25%
#: and 50% (KeyDiff Table 11). The defaults (L2 unprotected, H2O with ``r = N // 2``,
#: KeyDiff reserve 0) stay in the list, so every table shows both.
COMPARABLE_BASELINES = (
    "knorm:recent=10,sink=4",
    "h2o:recent=0",
    "caote:base=h2o,base_params={'recent': 0}",
    "caote:base=h2o,base_params={'recent': 0},fast=True",
    "keydiff:reserve=0.25",
    "keydiff:reserve=0.5",
)

#: MAT Sec. 5.1 grid-searches the anchor cache size beta; refkv also varies the shallow layers L_s.
MAT_BETAS = (8, 16, 32, 48, 64)
MAT_SHALLOW_LAYERS = (0, 2, 10)


def mat_grid(budget: int, n_layers: int | None, betas=MAT_BETAS, shallow=MAT_SHALLOW_LAYERS) -> list[str]:
    """MAT specs over ``beta`` x ``shallow_layers`` that can run at budget ``budget`` on a model of
    ``n_layers`` layers (None: any): ``beta < budget`` (room for the recent window) and
    ``L_s <= n_layers``."""
    return [canonical_spec(f"mat:beta={beta},shallow_layers={layers}")
            for beta in betas if beta < budget for layers in shallow if n_layers is None or layers <= n_layers]


def equal_memory_budget(spec: str, budget: int | None, block: int | None) -> int | None:
    """The budget at which ``spec`` holds at most as many keys at its peak as an evict-before
    policy at ``budget``: ``budget - block``. A policy that evicts after attention holds its
    ``N`` kept keys plus the block's ``B`` while the block attends; one that evicts before
    attention makes room for the block first, so it holds ``N`` in all (issue 16: equal
    peak memory). None when the modes already match (evict-before policy, no budget,
    ``B = 1``) or no budget would be left."""
    if budget is None or block is None or block <= 1 or make_policy(spec).evict_before_attention:
        return None
    matched = budget - block
    return matched if matched >= 1 else None


def configuration(spec: str) -> str:
    """Every parameter of the policy ``spec`` builds, defaults included: ``"recent=None"`` for
    plain ``h2o``, so a table row says its configuration even when the spec does not."""
    policy = make_policy(spec)
    # Every dataclass field (a policy may leave a default out of params()), then params()
    # (which spells a wrapped base out as plain values).
    params = {**{f: getattr(policy, f) for f in getattr(policy, "__dataclass_fields__", {})}, **policy.params()}
    return ", ".join(f"{k}={params[k]!r}" if isinstance(params[k], str) else f"{k}={params[k]}"
                     for k in sorted(params)) or "(no parameters)"


def best_of_grid(rows: list[dict], name: str, *, by: str, group=("budget", "block")) -> None:
    """Mark, per ``group``, the row of policy ``name`` with the lowest ``by`` (``best_of_grid``
    column True, other rows of that policy False): a grid search reported as its best cell,
    as MAT Sec. 5.1 reports its beta search. Rows without a value of ``by`` are not candidates."""
    best: dict[tuple, dict] = {}
    for row in rows:
        if parse_spec(row["policy"])[0] != name:
            continue
        row["best_of_grid"] = False
        value = row.get(by)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        key = tuple(row.get(k) for k in group)
        if key not in best or value < best[key][by]:
            best[key] = row
    for row in best.values():
        row["best_of_grid"] = True


# -- tables --------------------------------------------------------------------------------
def _cell(value):
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.6g}"
    if value is None:
        return ""
    return value


def write_csv(path, rows: list[dict], columns: list[str] | None = None) -> Path:
    """Write ``rows`` as CSV atomically (temp file + ``os.replace``)."""
    path = Path(path)
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(row.get(k)) for k in columns})
    atomic_write(path, buffer.getvalue())
    return path


def mean_std(values) -> tuple[float, float, int]:
    """Mean, sample standard deviation (0 for one value) and count, ignoring NaN."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return float("nan"), float("nan"), 0
    std = float(arr.std(ddof=1)) if arr.size > 1 else 0.0
    return float(arr.mean()), std, int(arr.size)
