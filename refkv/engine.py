"""Block prompt processing under a KV budget (KeyDiff Eq. 6, Fig. 1) and greedy generation.

The prompt is cut into blocks of ``B`` tokens. Each block runs through every layer;
inside each layer (KeyDiff Fig. 1):

1. the block's q, k, v are computed (k after RoPE at the tokens' positions);
2. [only for policies with ``evict_before_attention``: the cache is evicted to
   ``N - B`` tokens first, so the block attends to at most ``N``];
3. k, v are appended to the cache: ``C_i <- [K_{i-1} || k_block]`` (Eq. 6);
4. the block's queries attend over cache + block (weights materialised only if the
   policy reads them);
5. the policy observes (updates per-token state);
6. if the cache holds more than ``N`` tokens, ``C'_i <- pi_N(C_i)``: the policy's
   scores pick ``N`` tokens per KV head.

So a block's outputs saw at most ``N + B`` cache entries, and the next block sees the
evicted cache. ``B = 1`` is token generation; ``B = None`` processes the whole prompt
at once and then evicts (one-shot prefill, kvpress's setting). Positions come from
the caches (each :class:`refkv.cache.LayerCache` counts ``next_position``), never from loop counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from .attention import DEFAULT_KEY_CHUNK, attend
from .cache import LayerCache
from .model.decoder import Model
from .policies import Policy, View
from .policies import get as get_policy

__all__ = ["Engine", "EngineStats", "blocks", "generate", "prefill"]


@dataclass
class EngineStats:
    """Counters an engine keeps; tests read them.

    Attributes
    ----------
    attention_materialised : int
        Layer calls that formed the full attention-weight matrix.
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
    attention_calls: int = 0
    peak_cache_tokens: int = 0
    evictions: int = 0
    tokens: int = 0


@dataclass
class Trace:
    """Kept positions after every (block, layer), recorded when ``record=True``.

    ``kept[b][l]`` is the (Hkv, n) int64 array of positions layer ``l`` holds after
    block ``b``.
    """

    kept: list[list[np.ndarray]] = field(default_factory=list)


class Engine:
    """A decoder with a KV cache per layer under an eviction policy.

    Parameters
    ----------
    model : Model
    policy : Policy or str, default "full"
        A policy object, or a registered name (constructed with defaults).
    budget : int or None
        ``N``: tokens kept per layer and KV head. ``None``: never evict.
    record : bool
        Keep a :class:`Trace` of the kept positions after every block and layer.
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
                 record: bool = False, key_chunk: int = DEFAULT_KEY_CHUNK):
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
        self.trace = Trace() if record else None
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
        """
        tokens = self.model.check_tokens(tokens)
        limit = None if self.budget is None else self.policy.max_block(self.budget, self.model.config)
        evicts = self.budget is not None and len(self.caches[0]) + len(tokens) > self.budget
        if limit is not None and evicts and len(tokens) > limit:
            # Every layer holds the same count, so this is known before any layer changes its
            # cache: a refused block leaves the engine intact.
            raise ValueError(f"block size must be <= {limit} for {self.policy.name} with budget={self.budget} "
                             f"(it evicts before attention); got a block of {len(tokens)}")
        positions = np.arange(self.position, self.position + len(tokens), dtype=np.int64)
        rope = self.model.rope(positions)
        x = self.model.embed(tokens)
        for layer in range(self.model.config.n_layers):
            x = self._layer(layer, x, rope)
        self.stats.tokens += len(tokens)
        if self.trace is not None:
            self.trace.kept.append([c.positions.copy() for c in self.caches])
        if all_logits:
            return self.model.head(x)
        return self.model.head(x[-1:])[0]

    def _layer(self, layer: int, x: np.ndarray, rope) -> np.ndarray:
        model, policy, cache, budget = self.model, self.policy, self.caches[layer], self.budget
        q, k, v = model.qkv(layer, x, rope)
        b = q.shape[1]
        query_positions = np.arange(cache.next_position, cache.next_position + b, dtype=np.int64)

        if policy.evict_before_attention and budget is not None and len(cache) + b > budget:
            self._evict(layer, self._view(layer, cache, q, query_positions, k, v, None), budget - b)

        cache.append(k, v)
        self.stats.peak_cache_tokens = max(self.stats.peak_cache_tokens, len(cache))
        want_weights = "attention" in policy.needs
        out, weights = attend(q, cache.keys, cache.values, query_positions, cache.positions,
                              return_weights=want_weights, key_chunk=self.key_chunk)
        self.stats.attention_calls += 1
        self.stats.attention_materialised += weights is not None

        view = self._view(layer, cache, q, query_positions, k, v, weights)
        for name, array in policy.observe(view).items():
            cache.set_field(name, array)
        if budget is not None and len(cache) > budget:
            self._evict(layer, self._view(layer, cache, q, query_positions, k, v, weights), budget)

        x = x + model.attn_out(layer, out)
        return x + model.mlp(layer, x)

    def _view(self, layer, cache, q, query_positions, k, v, weights) -> View:
        return View(layer=layer, n_layers=self.model.config.n_layers, keys=cache.keys, values=cache.values,
                    positions=cache.positions, fields=dict(cache.fields), queries=q,
                    query_positions=query_positions, block_keys=k, block_values=v, attention=weights,
                    budget=self.budget)

    def _evict(self, layer: int, view: View, keep: int) -> None:
        """Shrink ``layer``'s cache to ``keep`` tokens per head with the policy's choice."""
        kept = self.policy.keep_indices(replace(view, budget=keep), keep)
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
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
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


def blocks(tokens: np.ndarray, block_size: int | None) -> list[np.ndarray]:
    """Split ``tokens`` into consecutive blocks of ``block_size`` (the last may be shorter)."""
    if block_size is None:
        return [tokens]
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 or None, got {block_size!r}")
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
