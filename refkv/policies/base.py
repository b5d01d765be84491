"""The policy protocol, the one selection routine every policy uses, and the registry.

A policy is a small frozen dataclass of parameters plus pure functions of a
:class:`View` (what the engine shows it at eviction time). Every attribute and method
of the protocol is declared on :class:`Policy`, with its default; a new policy sets
the class attributes and overrides ``score`` (and whatever else it needs):

* ``needs``: the signals it reads, from ``{"keys", "values", "queries", "attention",
  "positions"}``. The engine computes attention weights only if ``"attention"`` is
  in it.
* ``attention_need() -> AttentionNeed``: which of the weights it reads (the last rows,
  the column sums, or by default the whole matrix). The engine computes only those, tile
  by tile, and hands them over through :meth:`View.attention_last_rows` and
  :meth:`View.attention_column_sums`.
* ``score(view) -> (Hkv, n)``: higher means keep.
* ``protected(view) -> (Hkv, n) bool``: tokens that must stay (sinks, recent window).
* ``keep_indices(view) -> (Hkv, view.keep)``: the tokens kept; :func:`select` of the two
  above (not overridden by the policies here). With uneven per-head budgets
  (``head_budgets``) it returns one row per head instead (:func:`select_heads`).
* ``layer_budget(budget, layer, n_layers)``: the per-head budget of one layer (default:
  ``budget`` in every layer; PyramidKV's schedule).
* ``head_budgets(view) -> (Hkv,)``: how many tokens each KV head keeps at this eviction
  (default: ``view.keep`` each, or all a head holds; AdaKV allocates the layer's total
  ``view.keep * Hkv`` across its heads).
* ``fields(config)`` and ``observe(view) -> {name: array}``: per-token state kept in
  the cache (see :mod:`refkv.cache`), updated after every attention call.
* ``check(budget, config)``: raise ValueError if the protected set cannot fit.
* ``max_block(budget, config)``: the largest block a policy that evicts before
  attention can take.

Conventions shared by every policy (decided once, here):

* **Tie rule.** Equal scores keep the more recent token (larger position). The
  selection sorts on the pair (score, position) with :func:`numpy.lexsort`, so it does
  not depend on how a sort orders equal floats.
* **Budget.** ``N`` is per layer and per KV head; protected tokens count inside it. A
  policy may move budget between layers (``layer_budget``) or between the KV heads of a
  layer (``head_budgets``); the total is stated: a layer's heads keep ``keep * Hkv``
  tokens together, and the layers' budgets sum to ``N * L``.
* **Empty slots.** A cache whose heads hold different counts pads the shorter heads with
  empty slots at position :data:`refkv.cache.EMPTY` (see :mod:`refkv.cache`); only a policy
  with uneven head budgets ever sees one, and :func:`select_heads` never keeps one.
* **GQA.** Attention-based scores average the weights of the query heads that share a
  KV head (KeyDiff App. B.2): :meth:`View.attention_by_kv_head`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import numpy as np

from ..attention import AttentionNeed, AttentionSummary
from ..cache import EMPTY, FieldSpec
from ..model.config import ModelConfig
from ..validation import check_choice, check_int  # check_int re-exported: policies import it from here
from .card import PolicyCard

__all__ = [
    "SIGNALS",
    "AttentionNeed",
    "Policy",
    "View",
    "available",
    "check_int",
    "first_tokens",
    "get",
    "policy_class",
    "policy_forms",
    "recent_tokens",
    "register",
    "select",
    "select_heads",
]

#: Tie orders of :func:`select`: the shared rule, and the authors' forms' CUDA topk order.
TIE_ORDERS = ("recent", "older")

#: Signals a policy may declare in ``needs``.
SIGNALS = frozenset({"keys", "values", "queries", "attention", "positions"})


@dataclass(frozen=True)
class View:
    """What a policy sees of one layer at eviction (or observation) time.

    Attributes
    ----------
    layer, n_layers : int
        This layer's index and the model's layer count.
    keys, values : (Hkv, n, d)
        The candidate tokens: the cache after the block was appended (eviction after
        attention), or the cache before it (eviction before attention).
    positions : (Hkv, n) int64
        Their positions, increasing along each row.
    fields : mapping of str to (Hkv, n, ...) arrays
        Per-token policy state, aligned with ``positions``.
    queries : (H, B, d)
        The block's queries, after RoPE.
    query_positions : (B,) int64
    block_keys, block_values : (Hkv, B, d)
        The block's own keys and values (also inside ``keys`` after attention).
    attention : (Hkv, g, B, n) or None
        Attention weights of the block's queries over ``keys``; ``None`` unless the
        policy needs ``"attention"`` and eviction is after attention, and ``None`` also
        when the engine computed only what the policy's :meth:`Policy.attention_need`
        names (then in ``attention_summary``). Policies that declare a partial need read
        the weights through :meth:`attention_last_rows` and :meth:`attention_column_sums`,
        which give the same numbers from either.
    budget : int or None
        ``N``, the engine's budget per layer and KV head, always (``None``: no budget).
    keep : int or None
        Tokens this eviction keeps per head: ``N`` after attention, ``N - B`` when
        evicting before attention (so the block of ``B`` fits). Defaults to ``budget``.
    config : ModelConfig or None
        The model's configuration (RoPE base, head width, layer count), for policies
        that need a model fact; ``None`` in views not made from a model.
    attention_summary : AttentionSummary or None
        The parts of the weights the policy's :class:`AttentionNeed` names (the last rows
        of ``A``, its column sums), when the engine computed those instead of ``A``.
    """

    layer: int
    n_layers: int
    keys: np.ndarray
    values: np.ndarray
    positions: np.ndarray
    fields: Mapping[str, np.ndarray]
    queries: np.ndarray
    query_positions: np.ndarray
    block_keys: np.ndarray
    block_values: np.ndarray
    attention: np.ndarray | None = None
    budget: int | None = None
    keep: int | None = None
    config: ModelConfig | None = None
    attention_summary: AttentionSummary | None = None

    def __post_init__(self):
        if self.keep is None:
            object.__setattr__(self, "keep", self.budget)

    @property
    def n(self) -> int:
        """Tokens per KV head."""
        return self.keys.shape[1]

    @property
    def n_kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def head_lengths(self) -> np.ndarray:
        """(Hkv,) int64: real candidates per head (``n`` each unless the cache has empty slots)."""
        n_kv, n = self.positions.shape
        if n == 0 or not (self.positions[:, -1] == EMPTY).any():  # empty slots sit last: O(Hkv) when none
            return np.full(n_kv, n, dtype=np.int64)
        return np.count_nonzero(self.positions != EMPTY, axis=1).astype(np.int64)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.queries.shape[0] // self.keys.shape[0]

    def attention_by_kv_head(self) -> np.ndarray:
        """Attention weights averaged over each KV head's query group: (Hkv, B, n)."""
        if self.attention is None:
            raise ValueError("attention weights were not computed: the policy must declare "
                             "'attention' in its needs (and evict after attention)")
        return self.attention.mean(axis=1)

    def attention_last_rows(self, count: int) -> np.ndarray:
        """The weights of the block's last ``min(count, B)`` queries: ``A[..., -count:, :]``,
        (Hkv, g, min(count, B), n), from ``attention`` or from ``attention_summary``."""
        count = min(check_int("count", count, 0), self.queries.shape[1])
        b = self.queries.shape[1]
        if self.attention is not None:
            return self.attention[..., b - count:, :]
        rows = None if self.attention_summary is None else self.attention_summary.rows
        if rows is None or rows.shape[2] < count:
            held = 0 if rows is None else rows.shape[2]
            raise ValueError(f"the view holds the last {held} rows of the attention weights, not {count}: the "
                             f"policy's attention_need() must ask for them (and it must evict after attention)")
        return rows[..., rows.shape[2] - count:, :]

    def attention_column_sums(self) -> np.ndarray:
        """Each key's weight summed over the block's queries and averaged over the KV head's
        query group (KeyDiff App. B.2): :math:`\\bar A^\\top \\mathbf 1`, (Hkv, n).

        From ``attention`` as ``attention_by_kv_head().sum(axis=-2)``; from the summary's
        per-head sums as their group mean (the same number, summed in another order).
        """
        if self.attention is not None:
            return self.attention_by_kv_head().sum(axis=-2)
        sums = None if self.attention_summary is None else self.attention_summary.column_sums
        if sums is None:
            raise ValueError("the view holds no column sums of the attention weights: the policy's "
                             "attention_need() must ask for them (and it must evict after attention)")
        return sums.mean(axis=1)

    def queries_by_kv_head(self) -> np.ndarray:
        """Queries grouped under their KV head: (Hkv, g, B, d)."""
        h, b, d = self.queries.shape
        return self.queries.reshape(self.n_kv_heads, h // self.n_kv_heads, b, d)


class Policy:
    """Base class of eviction policies (subclasses are frozen dataclasses).

    Attributes
    ----------
    name : str
        Registry name.
    card : PolicyCard
        How the policy is presented and exercised, apart from what it computes: its
        summary, paper, label, table cells and order, the experiments' default specs and
        the golden suite's extra parameter sets (:mod:`refkv.policies.card`).
    needs : frozenset of str
        Subset of :data:`SIGNALS`.
    evict_before_attention : bool
        If true, the engine evicts from the cache *before* the block attends, down to
        ``N - B`` tokens (``view.keep``), so the block attends to at most ``N``
        (HashEvict's Algorithm 1).
    nonnegative_scores : bool
        True if ``score`` never returns a negative value, so the scores can be
        normalised into weights (CAOTE refuses a base that does not declare it).
    evicts : bool
        False for the no-eviction baseline only; experiments compare the others.
    shares_layer_budget : bool
        True if ``head_budgets`` allocates one layer total across the KV heads in one
        selection (AdaKV): a token may then move from one head to another, and checks compare
        the layer's heads pooled. (Uneven counts alone -- PyramidKV's authors' form keeping
        each head's share of a per-layer schedule -- are not that.)
    in_experiments : bool
        False leaves the policy out of the experiments' default lists (AdaKV and PyramidKV:
        the experiments' measurements read every head's cache as ``N`` real tokens, and
        their registered plans predate these policies); it can still be named explicitly.
    forms : mapping of str to dict
        The forms the policy implements, each ``{"source": where it comes from (a paper
        section, ``repo@commit:file``, ``kvpress X.Y.Z``), "proven": how it is shown identical
        to that source (a test, a harness) or None}``; ``"paper"`` is the default form.
        :func:`policy_forms` reads it (``refkv policies --forms``, the docs' forms table).

    Methods
    -------
    check(budget, config), max_block(budget, config), block_over_limit(budget, block, config),
    attention_need(), fields(config),
    observe(view), score(view), protected(view), keep_indices(view),
    layer_budget(budget, layer, n_layers), head_budgets(view), params(), describe()
        See each method; only ``score`` has no default.
    """

    name: ClassVar[str] = ""
    card: ClassVar[PolicyCard] = PolicyCard()
    needs: ClassVar[frozenset] = frozenset()
    evict_before_attention: ClassVar[bool] = False
    nonnegative_scores: ClassVar[bool] = False
    evicts: ClassVar[bool] = True
    shares_layer_budget: ClassVar[bool] = False
    in_experiments: ClassVar[bool] = True
    forms: ClassVar[Mapping] = MappingProxyType({})

    # -- the protocol ----------------------------------------------------------------
    def check(self, budget: int, config: ModelConfig) -> None:
        """Raise ValueError if this policy cannot run with ``budget`` on ``config``."""

    def max_block(self, budget: int, config: ModelConfig) -> int | None:
        """Largest block size ``B`` this policy can process under ``budget`` (None: any).

        A policy that evicts before attention must fit the block next to what it keeps:
        by default ``B <= N``; policies that protect tokens at that eviction lower it. The
        engine checks a block that would trigger an eviction against this before it
        changes any state (a block that fits in the budget as it is never needs it).
        """
        return budget if self.evict_before_attention else None

    def block_over_limit(self, budget: int, block: int, config: ModelConfig) -> int | None:
        """:meth:`max_block` if a block of ``block`` tokens is larger, else None.

        The block rule stated once: the engine (before a block that triggers an eviction
        changes any state) and the ``refkv`` command (before a model is loaded) both ask
        this, each wording its own message. Policies answer :meth:`max_block`, not this.
        """
        limit = self.max_block(budget, config)
        return limit if limit is not None and block > limit else None

    def attention_need(self) -> AttentionNeed:
        """Which of the block's attention weights this policy reads (only asked if
        ``"attention"`` is in ``needs``).

        The default is the whole matrix ``view.attention``, (Hkv, g, B, n): ``B x n``
        numbers per head, ``T^2`` in one-shot prefill. A policy that reads only the last
        rows or the column sums declares so, and reads them through
        :meth:`View.attention_last_rows` and :meth:`View.attention_column_sums`; the
        engine then computes just those, one query tile at a time
        (:func:`refkv.attention.attend_summary`). Views made with the whole matrix (the
        oracle's, ``Engine(record="views")``) serve the same methods from it.
        """
        return AttentionNeed()

    def fields(self, config: ModelConfig) -> dict[str, FieldSpec]:
        """Per-token state fields this policy keeps in the cache."""
        return {}

    def observe(self, view: View) -> dict[str, np.ndarray]:
        """New values of the state fields after the block attended (default: none)."""
        return {}

    def score(self, view: View) -> np.ndarray:
        """(Hkv, n) scores, higher means keep."""
        raise NotImplementedError

    def protected(self, view: View) -> np.ndarray:
        """(Hkv, n) bool mask of tokens that must stay (default: none)."""
        return np.zeros(view.positions.shape, dtype=bool)

    def layer_budget(self, budget: int, layer: int, n_layers: int, tokens: int | None = None) -> int:
        """Tokens per KV head that layer ``layer`` (of ``n_layers``) may hold under the engine's
        budget ``N`` (default: ``N``). The layers' budgets must sum to ``N * n_layers``.
        ``tokens``: how many tokens the layer holds when it compresses (None: not known, a
        prompt long enough not to matter); only kvpress's PyramidKV form reads it."""
        return budget

    def head_budgets(self, view: View) -> np.ndarray:
        """(Hkv,) int64: tokens each KV head keeps at this eviction (default: ``view.keep``
        each, or all a head holds if fewer). A policy with uneven budgets keeps the layer's
        total: the counts sum to ``view.keep * Hkv`` (or to every real token, if fewer)."""
        return np.minimum(view.keep, view.head_lengths)

    def tie_order(self) -> str:
        """Which token an exact tie keeps: ``"recent"`` (the shared rule, the default) or
        ``"older"`` (an authors' form whose code keeps the older one: CUDA ``torch.topk``)."""
        return "recent"

    def keep_indices(self, view: View):
        """The tokens to keep per head: :func:`select` of this policy's scores and protected set.

        Returns
        -------
        (Hkv, min(view.keep, n)) int64 column indices when every head keeps the same count
        (every uniform policy), else a list of ``Hkv`` 1-D arrays, head ``h`` keeping
        ``head_budgets(view)[h]`` tokens (:func:`select_heads`).
        """
        budgets = self.head_budgets(view)
        ties = self.tie_order()
        if np.all(budgets == min(view.keep, view.n)):
            return select(self.score(view), view.positions, view.keep, self.protected(view), ties=ties)
        return select_heads(self.score(view), view.positions, budgets, self.protected(view), ties=ties)

    # -- description -----------------------------------------------------------------
    def params(self) -> dict:
        """Parameters as a plain dict (dataclass fields)."""
        return {f: getattr(self, f) for f in getattr(self, "__dataclass_fields__", {})}

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{self.name}({args})"


def select(scores: np.ndarray, positions: np.ndarray, budget: int,
           protected: np.ndarray | None = None, *, ties: str = "recent") -> np.ndarray:
    """Turn scores, a protected mask and a budget into the indices to keep.

    The one selection routine (KeyDiff Eq. 5's ``topk``) that every policy uses.
    Per KV head: protected tokens first, then the highest scores, ties going to the
    more recent token (larger position); ``min(budget, n)`` tokens are kept.

    Parameters
    ----------
    scores : (Hkv, n) float array
        Higher means keep. NaN is an error.
    positions : (Hkv, n) int array
        Positions of the tokens (the tie-breaker).
    budget : int
        Tokens to keep per head, ``>= 0`` (0 empties the cache: a block of ``B = N``
        evicted before attention).
    protected : (Hkv, n) bool array, optional
        Tokens that must be kept; there must be at most ``budget`` per head.
    ties : {"recent", "older"}, default "recent"
        Which of two equal scores is kept: the more recent token (the shared rule) or the
        older one (the order of CUDA ``torch.topk`` on a cache in position order, which the
        authors' forms of H2O and TOVA reproduce).

    Returns
    -------
    (Hkv, min(budget, n)) int64 array of column indices, increasing along each row.
    """
    scores = np.asarray(scores)
    if scores.shape != positions.shape:
        raise ValueError(f"scores must have shape {positions.shape} (like positions), got {scores.shape}")
    check_int("budget", budget, 0)
    check_choice("ties", ties, TIE_ORDERS)
    if np.isnan(scores).any():
        raise ValueError("scores contain NaN; a policy must return comparable scores")
    if protected is None:
        protected = np.zeros(scores.shape, dtype=bool)
    elif protected.shape != scores.shape:
        raise ValueError(f"protected must have shape {scores.shape}, got {protected.shape}")
    n_protected = protected.sum(axis=1)
    if n_protected.max(initial=0) > budget:
        raise ValueError(f"{int(n_protected.max())} protected tokens do not fit in budget={budget}")
    n_kv, n = scores.shape
    m = min(int(budget), n)
    kept = np.empty((n_kv, m), dtype=np.int64)
    for h in range(n_kv):
        # lexsort sorts by its last key first: protected, then score, then position,
        # all descending (hence the negations; -0.0 == 0.0 so signed zeros tie); with
        # ties="older" the position ascends instead.
        tiebreak = -positions[h] if ties == "recent" else positions[h]
        order = np.lexsort((tiebreak, -scores[h], ~protected[h]))
        kept[h] = np.sort(order[:m])
    return kept


def select_heads(scores: np.ndarray, positions: np.ndarray, budgets, protected: np.ndarray | None = None,
                 *, ties: str = "recent") -> list[np.ndarray]:
    """:func:`select` with a budget per head: head ``h`` keeps ``budgets[h]`` of its real tokens.

    Parameters
    ----------
    scores, positions, protected, ties
        As for :func:`select`; empty slots (position :data:`refkv.cache.EMPTY`, after a head's
        real tokens) are never candidates.
    budgets : (Hkv,) ints
        ``0 <= budgets[h]``; a head keeps ``min(budgets[h], its real tokens)``.

    Returns
    -------
    list of ``Hkv`` int64 arrays of column indices, increasing (ragged).
    """
    scores, positions = np.asarray(scores), np.asarray(positions)
    budgets = np.asarray(budgets)
    if budgets.shape != (positions.shape[0],) or budgets.dtype.kind not in "iu":
        raise ValueError(f"budgets must be {positions.shape[0]} integers (one per KV head), got {budgets!r}")
    if scores.shape != positions.shape:
        raise ValueError(f"scores must have shape {positions.shape} (like positions), got {scores.shape}")
    if protected is None:
        protected = np.zeros(scores.shape, dtype=bool)
    kept = []
    for h, budget in enumerate(budgets):
        real = int(np.count_nonzero(positions[h] != EMPTY))  # real tokens first, then empty slots
        kept.append(select(scores[h:h + 1, :real], positions[h:h + 1, :real], int(budget),
                           protected[h:h + 1, :real], ties=ties)[0])
    return kept


def first_tokens(view: View, count: int) -> np.ndarray:
    """Mask of the prompt's first ``count`` tokens (positions ``< count``): attention sinks."""
    return view.positions < count


def recent_tokens(view: View, count: int) -> np.ndarray:
    """Mask of each head's ``count`` most recent tokens (the last columns)."""
    mask = np.zeros(view.positions.shape, dtype=bool)
    if count > 0:
        mask[:, -count:] = True
    return mask


# -- registry --------------------------------------------------------------------------
_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator adding a policy to the registry under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is already registered")
    bad = set(cls.needs) - SIGNALS
    if bad:
        raise ValueError(f"{cls.__name__}.needs has unknown signals {sorted(bad)}")
    if not isinstance(cls.card, PolicyCard):
        raise ValueError(f"{cls.__name__}.card must be a PolicyCard, got {type(cls.card).__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def policy_class(name: str) -> type[Policy]:
    """The policy class registered as ``name``."""
    if not isinstance(name, str):
        raise ValueError(f"policy name must be a str, got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        head = name.split(":", 1)[0].split("(", 1)[0].strip()
        if head != name and head in _REGISTRY:  # "keydiff:reserve=0.25" given where a bare name is read
            raise ValueError(f"unknown policy {name!r}: that is a policy spec (a name with parameters); "
                             f"refkv.policies.spec.make_policy reads it, or pass the name {head!r} and the "
                             f"parameters apart") from None
        raise ValueError(f"unknown policy {name!r}{_did_you_mean(name, available(), 'policy names are lower case')}; "
                         f"available: {', '.join(available())}") from None


def _did_you_mean(word: str, choices: list[str], case_note: str) -> str:
    """`` (did you mean 'h2o'?)`` for a mistyped name, or ``""``.

    A name that differs only in case gets its registered spelling (names are matched
    exactly, so that one policy has one spec in records and tables); otherwise the closest
    name by :func:`difflib.get_close_matches`, compared in lower case.
    """
    import difflib

    lower = {choice.lower(): choice for choice in choices}
    if word.lower() in lower:
        return f" (did you mean {lower[word.lower()]!r}? {case_note})"
    close = difflib.get_close_matches(word.lower(), list(lower), n=1, cutoff=0.6)
    return f" (did you mean {lower[close[0]]!r}?)" if close else ""


def get(name: str, **params) -> Policy:
    """Construct the policy registered as ``name`` with ``params``.

    Raises
    ------
    ValueError
        If ``name`` is not registered, or a parameter is not one of the policy's
        (the message names it and lists the allowed ones), or a value is out of range.
    """
    cls = policy_class(name)
    allowed = list(getattr(cls, "__dataclass_fields__", {}))
    unknown = [key for key in params if key not in allowed]
    if unknown:
        listed = ", ".join(allowed) if allowed else "none"
        hint = _did_you_mean(unknown[0], allowed, "parameter names are lower case")
        raise ValueError(f"policy {name!r} has no parameter {unknown[0]!r}{hint}; allowed: {listed}")
    return cls(**params)


def policy_forms(cls: type[Policy]) -> dict[str, dict]:
    """The forms a policy class declares (:attr:`Policy.forms`), in order, ``"paper"`` first.

    A class that declares none has the one paper form, its source the card's ``paper``
    line and nothing proven against code.
    """
    declared = cls.__dict__.get("forms") or {"paper": {"source": cls.card.paper, "proven": None}}
    for form, entry in declared.items():
        if set(entry) != {"source", "proven"}:
            raise ValueError(f"{cls.__name__}.forms[{form!r}] must have exactly the keys source and proven")
    return dict(declared)


def available() -> list[str]:
    """Names of all registered policies, sorted."""
    return sorted(_REGISTRY)
