"""Block prompt processing under a KV budget (KeyDiff Eq. 6, Fig. 1) and greedy generation.

The prompt is cut into blocks of ``B`` tokens. Each block runs through every layer;
inside each layer (KeyDiff Fig. 1):

1. the block's q, k, v are computed (k after RoPE at the tokens' positions);
2. [only for policies with ``evict_before_attention``: the cache is evicted to
   ``N - B`` tokens first, so the block attends to at most ``N``];
3. k, v are appended to the cache: ``C_i <- [K_{i-1} || k_block]`` (Eq. 6);
4. the block's queries attend over cache + block (weights formed only if the policy
   reads them, and then only the rows or sums its ``attention_need`` names);
5. the policy observes (updates per-token state);
6. if the cache holds more than ``N`` tokens, ``C'_i <- pi_N(C_i)``: the policy's
   scores pick ``N`` tokens per KV head.

Uneven budgets come from the policy: ``policy.layer_budget(N, layer, L)`` is the layer's
per-head budget ``N_l`` (``N`` for every policy but PyramidKV), and the eviction keeps
``N_l * Hkv`` tokens in the layer, split over its heads by ``policy.head_budgets`` (even
for every policy but AdaKV). A layer evicts when its heads hold more than ``N_l * Hkv``
tokens together, which for even heads is "more than ``N_l`` per head".

Steps 2-6 are :func:`layer_step`, written once and called by both :class:`Engine` and
the oracle's one-layer replay (:func:`refkv.oracle.synthetic.replay`). With ``record``
set, the engine keeps a :class:`Trace`: the kept positions after every block and every
eviction as an :class:`Eviction` event (with the view the policy decided on, on request).

So a block's outputs saw at most ``N + B`` cache entries, and the next block sees the
evicted cache. ``B = 1`` is token generation; ``B = None`` processes the whole prompt
at once and then evicts (one-shot prefill, kvpress's setting). Positions come from
the caches (each :class:`refkv.cache.LayerCache` counts ``next_position``), never from loop counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from .attention import DEFAULT_KEY_CHUNK, AttentionSummary, NonFiniteError, attend, attend_summary
from .cache import EMPTY, LayerCache
from .model.config import ModelConfig
from .model.decoder import Model
from .policies import Policy, View
from .policies import get as get_policy
from .validation import check_int

__all__ = ["Engine", "EngineStats", "Eviction", "Step", "Trace", "blocks", "decision_view", "generate", "layer_step",
           "prefill", "step_view"]


#: Rows (tokens) of a block that go through the MLP at once; longer blocks are sliced.
MLP_ROWS = 1024


@dataclass
class EngineStats:
    """Counters an engine keeps; tests read them.

    Attributes
    ----------
    attention_materialised : int
        Layer calls that formed attention weights for the policy: the full matrix or the
        rows and column sums its ``attention_need`` names (attention-free policies: 0).
    attention_matrices : int
        Of those, the calls that formed the full (Hkv, g, B, n) matrix.
    attention_calls : int
        All layer attention calls.
    peak_cache_tokens : int
        Largest per-head token count any layer's cache reached (between append and
        eviction, so up to ``N + B``).
    evictions : int
        Layer calls that evicted at least one token.
    tokens : int
        Tokens processed.
    """

    attention_materialised: int = 0
    attention_matrices: int = 0
    attention_calls: int = 0
    peak_cache_tokens: int = 0
    evictions: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class Eviction:
    """One eviction the engine made: which tokens of one layer were offered and which stayed.

    Attributes
    ----------
    block : int
        Index of the block (``forward`` call) it happened in, from 0.
    layer : int
    stage : {"after-attention", "before-attention"}
        After the block attended (the block is among the candidates), or before it
        (policies with ``evict_before_attention``).
    positions : (Hkv, n) int64
        The candidates' positions; ``-1`` marks an empty slot (a head holding fewer
        candidates than the widest, after an uneven eviction).
    kept : (Hkv, m) int64
        Column indices into ``positions`` of the tokens kept, increasing along each row.
        With uneven head budgets ``m`` is the largest count and each shorter row ends in
        ``-1`` (so ``(kept >= 0).sum(axis=1)`` is what each head kept).
    view : View or None
        The view the policy decided on (its signals: keys, queries, attention, state), when
        the trace was asked for views (``Engine(record="views")``); ``None`` otherwise.
    """

    block: int
    layer: int
    stage: str
    positions: np.ndarray
    kept: np.ndarray
    view: View | None = None

    @property
    def kept_positions(self) -> np.ndarray:
        """(Hkv, m) positions of the kept tokens (``-1`` where ``kept`` is ``-1``)."""
        taken = np.take_along_axis(self.positions, np.maximum(self.kept, 0), axis=1)
        return np.where(self.kept >= 0, taken, -1)


@dataclass
class Trace:
    """What the engine did, recorded when ``record`` is set.

    ``kept[b][l]`` is the (Hkv, n) int64 array of positions layer ``l`` holds after
    block ``b`` (``-1`` in the empty slots of a head holding fewer tokens than the
    widest, under uneven head budgets); ``evictions`` lists every eviction in the order the engine made them
    (:class:`Eviction`), with its view when ``views`` is true.
    """

    kept: list[list[np.ndarray]] = field(default_factory=list)
    evictions: list[Eviction] = field(default_factory=list)
    views: bool = False


class Engine:
    """A decoder with a KV cache per layer under an eviction policy.

    Parameters
    ----------
    model : Model
    policy : Policy or str, default "full"
        A policy object, or a registered name (constructed with defaults).
    budget : int or None
        ``N``: tokens kept per layer and KV head. ``None``: never evict. A policy may
        spread it unevenly, keeping the totals: over the layers
        (``policy.layer_budget``, PyramidKV) and over a layer's KV heads
        (``policy.head_budgets``, AdaKV; the caches then hold empty slots, see
        :mod:`refkv.cache`).
    record : bool or "views"
        Keep a :class:`Trace`: the kept positions after every block and layer and every
        eviction (:class:`Eviction`); ``"views"`` also keeps the view each eviction decided
        on (all its signals: memory grows with the prompt).
    key_chunk : int
        Tile width of the attention route that does not form the weights.

    Raises
    ------
    ValueError
        If ``budget < 1`` or the policy's protected set cannot fit in it.

    Examples
    --------
    Block prompt processing of 100 tokens in blocks of ``B = 16`` under ``N = 32``, then
    three greedy steps:

    >>> import numpy as np
    >>> import refkv
    >>> model = refkv.load("tiny")
    >>> tokens = np.arange(100) % model.config.vocab_size
    >>> engine = refkv.Engine(model, "keydiff", budget=32)
    >>> logits = engine.prefill(tokens, block_size=16)
    >>> engine.caches[0].positions.shape     # KV heads x kept tokens
    (2, 32)
    >>> engine.stats.peak_cache_tokens       # N + B: append, then evict
    48
    >>> engine.stats.attention_materialised  # KeyDiff never reads them
    0
    >>> len(engine.generate(logits, max_new_tokens=3))
    3
    """

    def __init__(self, model: Model, policy: Policy | str = "full", budget: int | None = None, *,
                 record: bool | str = False, key_chunk: int = DEFAULT_KEY_CHUNK):
        if not isinstance(model, Model):
            raise ValueError(f"model must be a refkv Model (e.g. refkv.model.load('tiny')), "
                             f"got {type(model).__name__}")
        key_chunk = check_int("key_chunk", key_chunk, 1)
        if isinstance(policy, str):
            policy = get_policy(policy)
        if not isinstance(policy, Policy):
            raise ValueError(f"policy must be a Policy or a registered name, got {type(policy).__name__}")
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
                raise ValueError(f"budget must be an integer >= 1 or None, got {budget!r}")
            budget = int(budget)
            policy.check(budget, model.config)
        self.model = model
        self.policy = policy
        self.budget = budget
        self.key_chunk = key_chunk
        self.stats = EngineStats()
        if record not in (False, True, "views"):
            raise ValueError(f"record must be False, True or 'views', got {record!r}")
        self.trace = Trace(views=record == "views") if record else None
        cfg = model.config
        specs = policy.fields(cfg)
        self.caches = [LayerCache(cfg.n_kv_heads, cfg.d_head, model.dtype, specs) for _ in range(cfg.n_layers)]

    @property
    def position(self) -> int:
        """Position of the next token (tokens processed so far)."""
        return self.caches[0].next_position

    def forward(self, tokens, *, all_logits: bool = False) -> np.ndarray:
        """Process one block of tokens through every layer, evicting as it goes.

        Parameters
        ----------
        tokens : (B,) ints
        all_logits : bool
            Return logits for every token of the block (B, vocab) instead of only the
            last one (vocab,). The LM head is the most expensive matrix of a small
            model, so it is skipped for positions nobody reads.

        Raises
        ------
        refkv.attention.NonFiniteError
            (a ValueError) if a layer's attention output or hidden state, or the logits,
            hold NaN or inf; the message names the layer. The caches are then partly
            updated: start a new engine.
        """
        tokens = self.model.check_tokens(tokens)
        evicts = self.budget is not None and len(self.caches[0]) + len(tokens) > self.budget
        limit = self.policy.block_over_limit(self.budget, len(tokens), self.model.config) if evicts else None
        if limit is not None:
            # Every layer holds the same count, so this is known before any layer changes its
            # cache: a refused block leaves the engine intact.
            raise ValueError(f"block size must be <= {limit} for {self.policy.name} with budget={self.budget} "
                             f"(it evicts before attention); got a block of {len(tokens)}")
        positions = np.arange(self.position, self.position + len(tokens), dtype=np.int64)
        rope = self.model.rope(positions)
        x = self.model.embed(tokens)
        for layer in range(self.model.config.n_layers):
            try:
                x = self._layer(layer, x, rope)
            except NonFiniteError as err:
                raise NonFiniteError(f"layer {layer}: {err}") from None
            _check_finite(x, f"layer {layer}: the hidden state after the layer")
        self.stats.tokens += len(tokens)
        if self.trace is not None:
            self.trace.kept.append([c.positions_or(-1) for c in self.caches])
        logits = self.model.head(x if all_logits else x[-1:])
        _check_finite(logits, f"the logits (LM head after layer {self.model.config.n_layers - 1})")
        return logits if all_logits else logits[0]

    def _layer(self, layer: int, x: np.ndarray, rope) -> np.ndarray:
        model = self.model
        q, k, v = model.qkv(layer, x, rope)  # (H, B, d), (Hkv, B, d), (Hkv, B, d); q and k after RoPE
        step = layer_step(self.policy, self.caches[layer], q, k, v, layer=layer, n_layers=model.config.n_layers,
                          budget=self.budget, evict=self._evictor(layer), key_chunk=self.key_chunk,
                          config=model.config,
                          # views kept in a trace show the whole matrix, as the oracle's do
                          attention="matrix" if self.trace is not None and self.trace.views else "needed")
        self.stats.peak_cache_tokens = max(self.stats.peak_cache_tokens, step.peak)
        self.stats.attention_calls += 1
        self.stats.attention_materialised += step.weights is not None or step.summary is not None
        self.stats.attention_matrices += step.weights is not None
        x = x + model.attn_out(layer, step.out)  # (B, D)
        if len(x) <= MLP_ROWS:
            return x + model.mlp(layer, x)  # (B, D)
        # A long block (one-shot prefill) goes through the MLP in slices of rows: each row's
        # MLP is its own, and the (B, 2 d_ff) activations are the largest temporary of a
        # one-shot layer once attention is tiled (50 MB at 4K tokens on SmolLM2).
        out = np.empty_like(x)
        for start in range(0, len(x), MLP_ROWS):
            rows = x[start:start + MLP_ROWS]
            out[start:start + MLP_ROWS] = rows + model.mlp(layer, rows)
        return out  # (B, D)

    def _evictor(self, layer: int) -> Callable[[View, int, str], None]:
        """The ``evict`` callback of :func:`layer_step` for ``layer``: evict, then record the event."""
        def evict(view: View, keep: int, stage: str) -> None:
            self._evict(layer, view, keep)
            if self.trace is not None:
                after = self.caches[layer].positions  # (Hkv, m), a subset of view.positions per row
                # rows are sorted (empty slots, at EMPTY, last): an empty slot maps to -1
                kept = [np.where(a == EMPTY, -1, np.searchsorted(row, a)) for row, a in zip(view.positions, after)]
                positions = view.positions.copy()
                positions[positions == EMPTY] = -1
                self.trace.evictions.append(Eviction(
                    block=len(self.trace.kept), layer=layer, stage=stage, positions=positions,
                    kept=np.asarray(kept, dtype=np.int64).reshape(after.shape),
                    view=decision_view(view, keep) if self.trace.views else None))
        return evict

    def _evict(self, layer: int, view: View, keep: int) -> None:
        """Shrink ``layer``'s cache to ``keep`` tokens per head (``keep * Hkv`` in all) with the policy's choice."""
        kept = self.policy.keep_indices(decision_view(view, keep))  # (Hkv, keep), or Hkv rows (uneven)
        self.caches[layer].keep(kept)
        self.stats.evictions += 1

    def prefill(self, tokens, block_size: int | None = None, *, all_logits: bool = False,
                progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """Block prompt processing of ``tokens`` (KeyDiff Eq. 6).

        Parameters
        ----------
        tokens : sequence of ints
        block_size : int or None
            ``B``; ``None`` processes the whole prompt as one block.
        all_logits : bool
            Return (T, vocab) logits of every prompt token instead of the last (vocab,).
        progress : callable, optional
            Called as ``progress(done, total)`` after each block.
        """
        tokens = self.model.check_tokens(tokens)
        out = []
        for chunk in blocks(tokens, block_size):
            out.append(self.forward(chunk, all_logits=all_logits))
            if progress is not None:
                progress(self.position, len(tokens))
        return np.concatenate(out, axis=0) if all_logits else out[-1]

    def generate(self, logits: np.ndarray, max_new_tokens: int, *, eos: Iterable[int] = (),
                 on_token: Callable[[int], None] | None = None) -> list[int]:
        """Greedy decoding (B = 1) from the last prompt logits.

        Parameters
        ----------
        logits : (vocab,) array
            Logits of the last processed token (what :meth:`prefill` returns).
        max_new_tokens : int
            Upper bound on generated tokens (``>= 0``).
        eos : iterable of int
            Stop after emitting any of these ids (the id is included in the output).
        on_token : callable, optional
            Called with each new id as soon as it is chosen (streaming).
        """
        check_int("max_new_tokens", max_new_tokens, 0)
        eos = set(int(e) for e in eos)
        generated: list[int] = []
        for step in range(max_new_tokens):
            token = int(np.argmax(logits))  # ties go to the lowest id, as numpy documents
            generated.append(token)
            if on_token is not None:
                on_token(token)
            if token in eos or step == max_new_tokens - 1:
                break
            logits = self.forward([token])
        return generated


def _check_finite(array: np.ndarray, what: str) -> None:
    """Raise :class:`~refkv.attention.NonFiniteError` if ``array`` holds NaN or inf.

    Run on each layer's (B, d_model) output and on the logits: a pass over arrays far
    smaller than the weights that made them, and what stops overflowing weights from
    turning into NaN logits that greedy decoding would read as token 0.
    """
    if not np.isfinite(array).all():
        bad = int(array.size - np.count_nonzero(np.isfinite(array)))
        raise NonFiniteError(f"{what} has {bad} non-finite value(s) (NaN or inf): the weights or inputs "
                             f"overflow {array.dtype}")


# -- one layer's step, shared by the engine and the oracle's one-layer replay -------------------------
def decision_view(view: View, keep: int) -> View:
    """The view a policy decides on at an eviction that keeps ``keep`` tokens per head
    (``view.keep``; ``view.budget`` stays ``N``)."""
    return replace(view, keep=keep)


def step_view(layer: int, n_layers: int, cache: LayerCache, q: np.ndarray, query_positions: np.ndarray,
              k: np.ndarray, v: np.ndarray, weights: np.ndarray | None, budget: int | None,
              config: ModelConfig | None = None, summary: AttentionSummary | None = None) -> View:
    """What a policy sees of layer ``layer``'s ``cache`` and the block (q, k, v, weights or
    the summary of them the policy needs)."""
    return View(layer=layer, n_layers=n_layers, keys=cache.keys, values=cache.values, positions=cache.positions,
                fields=dict(cache.fields), queries=q, query_positions=query_positions, block_keys=k,
                block_values=v, attention=weights, budget=budget, config=config, attention_summary=summary)


@dataclass(frozen=True)
class Step:
    """What :func:`layer_step` returns.

    Attributes
    ----------
    out : (H, B, d)
        The block's attention outputs.
    weights : (Hkv, g, B, n) or None
        The attention weights, when the policy reads them and ``attention="matrix"``.
    peak : int
        Tokens per head in the cache between append and eviction (up to ``N + B``).
    summary : AttentionSummary or None
        The parts of the weights the policy's ``attention_need`` names, when
        ``attention="needed"`` formed those instead of the matrix.
    """

    out: np.ndarray
    weights: np.ndarray | None
    peak: int
    summary: AttentionSummary | None = None


def layer_step(policy: Policy, cache: LayerCache, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, layer: int,
               n_layers: int, budget: int | None, evict: Callable[[View, int, str], None],
               key_chunk: int = DEFAULT_KEY_CHUNK, evict_always: bool = False,
               config: ModelConfig | None = None, attention: str = "matrix") -> Step:
    """One layer's attention step under an eviction policy: steps 2-6 of this module's docstring.

    The one place where the order of a layer's step is written; :class:`Engine` and
    :func:`refkv.oracle.synthetic.replay` both call it.

    Parameters
    ----------
    policy : Policy
    cache : LayerCache
        The layer's cache; the block is appended to it and it is evicted in place.
    q : (H, B, d)
        The block's queries, after RoPE.
    k, v : (Hkv, B, d)
        The block's keys (after RoPE) and values.
    layer, n_layers : int
        What the views report.
    budget : int or None
        ``N``; ``None`` never evicts. The layer's own budget is
        ``policy.layer_budget(N, layer, n_layers, tokens=...)`` for the tokens the layer holds once
        the block is in (what the views report as ``budget``).
    evict : callable
        ``evict(view, keep, stage)`` must shrink ``cache`` to the ``keep`` tokens per head the
        policy chooses from ``view`` (``view.budget`` is ``N``; see :func:`decision_view`);
        ``stage`` is ``"before-attention"`` or ``"after-attention"``.
    key_chunk : int
        Tile width of the attention route that does not form the weights.
    evict_always : bool
        Call ``evict`` at the policy's stage even when the cache fits in the budget (the
        replay uses it to see the decision of a block that needs no eviction).
    config : ModelConfig, optional
        The model's configuration, handed to the policy in every view (``view.config``).
    attention : {"matrix", "needed"}
        For a policy that reads the weights: form the whole matrix ``A`` (the definition;
        the oracle's replay) or only what ``policy.attention_need()`` names, tile by tile
        (:func:`refkv.attention.attend_summary`; the engine). The policy sees the same
        numbers either way, up to the rounding of differently shaped products.
    """
    if attention not in ("matrix", "needed"):
        raise ValueError(f"attention must be 'matrix' or 'needed', got {attention!r}")
    b = q.shape[1]
    query_positions = np.arange(cache.next_position, cache.next_position + b, dtype=np.int64)  # (B,)
    if budget is not None:  # the layer's own budget, for the tokens it holds once the block is in
        budget = policy.layer_budget(budget, layer, n_layers, tokens=len(cache) + b)
    hkv = cache.n_kv_heads

    # cache.total > budget * hkv: the layer's heads together hold more than their budget
    # (for even heads, exactly len(cache) > budget)
    if policy.evict_before_attention and budget is not None and (evict_always or cache.total + b * hkv > budget * hkv):
        evict(step_view(layer, n_layers, cache, q, query_positions, k, v, None, budget, config), budget - b,
              "before-attention")

    cache.append(k, v)  # C_i <- [K_{i-1} || k_block]: (Hkv, n + B, d)
    peak = len(cache)  # the widest head's count
    summary = None
    need = policy.attention_need() if "attention" in policy.needs else None
    if need is not None and (attention == "matrix" or need.whole):
        out, weights = attend(q, cache.keys, cache.values, query_positions, cache.positions, return_weights=True)
    elif need is not None:
        out, summary = attend_summary(q, cache.keys, cache.values, query_positions, cache.positions, need,
                                      key_chunk=key_chunk)
        weights = None
    else:
        out, weights = attend(q, cache.keys, cache.values, query_positions, cache.positions,
                              key_chunk=key_chunk)  # (H, B, d), no weights

    observed = step_view(layer, n_layers, cache, q, query_positions, k, v, weights, budget, config, summary)
    for name, array in policy.observe(observed).items():
        cache.set_field(name, array)  # (Hkv, n, ...)
    after = not policy.evict_before_attention and evict_always
    if budget is not None and (after or cache.total > budget * hkv):
        evict(step_view(layer, n_layers, cache, q, query_positions, k, v, weights, budget, config, summary),
              budget, "after-attention")
    return Step(out=out, weights=weights, peak=peak, summary=summary)


def blocks(tokens: np.ndarray, block_size: int | None) -> list[np.ndarray]:
    """Split ``tokens`` into consecutive blocks of ``block_size`` (the last may be shorter)."""
    if block_size is None:
        return [tokens]
    check_int("block_size", block_size, 1)
    return [tokens[i:i + block_size] for i in range(0, len(tokens), block_size)]


def prefill(model: Model, tokens, policy: Policy | str = "full", budget: int | None = None,
            block_size: int | None = None, **kwargs) -> tuple[np.ndarray, Engine]:
    """Run block prompt processing; return the last logits and the engine (its caches).

    Examples
    --------
    >>> import numpy as np
    >>> import refkv
    >>> from refkv.engine import prefill
    >>> model = refkv.load("tiny")
    >>> logits, engine = prefill(model, np.arange(100), "sink", budget=32, block_size=16)
    >>> logits.shape                         # the last token's logits
    (512,)
    >>> from refkv.formatting import format_ranges
    >>> format_ranges(engine.caches[0].positions[0])  # first 4, last 28
    '0-3,72-99'
    """
    engine = Engine(model, policy, budget, **kwargs)
    return engine.prefill(tokens, block_size), engine


def generate(model: Model, tokens, policy: Policy | str = "full", budget: int | None = None,
             block_size: int | None = None, max_new_tokens: int = 16, eos: Iterable[int] = (),
             **kwargs) -> tuple[list[int], Engine]:
    """Prefill ``tokens`` then decode greedily; return the new ids and the engine.

    Examples
    --------
    >>> import numpy as np
    >>> import refkv
    >>> from refkv.engine import generate
    >>> model = refkv.load("tiny")
    >>> new, engine = generate(model, np.arange(100), "h2o", budget=32,
    ...                        block_size=16, max_new_tokens=3)
    >>> len(new), engine.position  # the last new token is not fed back
    (3, 102)
    """
    logits, engine = prefill(model, tokens, policy, budget, block_size, **kwargs)
    return engine.generate(logits, max_new_tokens, eos=eos), engine
