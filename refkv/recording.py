"""Recording what a policy sees: keys, queries, attention and scores per block and layer.

:class:`Recorder` wraps a policy and behaves exactly like it (same needs, state, scores
and decisions) while keeping every :class:`~refkv.policies.View` the engine shows it, and
the scores and kept columns of every eviction. It is the tool of the tutorials for
"what did layer 20 see?", with or without a budget:

>>> import numpy as np
>>> import refkv
>>> from refkv.recording import Recorder
>>> model = refkv.load("tiny")
>>> recorder = Recorder("full", needs=("keys", "attention"))
>>> _ = refkv.Engine(model, recorder).prefill(np.arange(24), block_size=8)
>>> len(recorder.steps), recorder.views(block=2)[0].attention.shape   # 3 blocks x 4 layers
(12, (2, 2, 8, 24))

The engine's own :class:`refkv.engine.Trace` (``Engine(record="views")``) records the view
of each *eviction*; a recorder also records the layer calls that evict nothing, the
block index of each, and the scores behind each decision.

:func:`observed` answers a smaller question: what a stateful policy (H2O, Scissorhands)
stores after observing a view, as a view that carries that state, without building a
:class:`~refkv.policies.View` by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .model.config import ModelConfig
from .policies import SIGNALS, Policy, View
from .policies import get as get_policy

__all__ = ["Decision", "Recorder", "Step", "observed"]


@dataclass(frozen=True)
class Step:
    """One layer call of one block, as the wrapped policy observed it.

    Attributes
    ----------
    block : int
        Index of the block (engine ``forward`` call) from 0, counted per layer.
    layer : int
    view : View
        The view after the block attended (keys, queries, attention if needed, state).
    """

    block: int
    layer: int
    view: View


@dataclass(frozen=True)
class Decision:
    """One eviction: what the wrapped policy scored and kept.

    Attributes
    ----------
    block, layer : int
    view : View
        The view the decision was made on (``view.keep`` tokens kept per head).
    scores : (Hkv, n) float array
        The wrapped policy's scores (``policy.score(view)``).
    kept : (Hkv, keep) int64 array
        Column indices into ``view.positions`` of the kept tokens.
    """

    block: int
    layer: int
    view: View
    scores: np.ndarray
    kept: np.ndarray

    @property
    def kept_positions(self) -> np.ndarray:
        """(Hkv, keep) positions of the kept tokens."""
        return np.take_along_axis(self.view.positions, self.kept, axis=1)


class Recorder(Policy):
    """A policy that behaves as ``policy`` and records every view and decision.

    Parameters
    ----------
    policy : Policy or str, default "full"
        The policy to run (a registered name is constructed with its defaults).
    needs : iterable of str, optional
        Extra signals to have the engine form, beyond the policy's own (for example
        ``("keys", "attention")`` to record attention weights under KeyDiff). Adding
        ``"attention"`` only makes the engine form the weights; the decisions stay the
        policy's.

    Attributes
    ----------
    steps : list of Step
        Every layer call, in the engine's order (block by block, layer by layer).
    decisions : list of Decision
        Every eviction, with the scores behind it.

    Raises
    ------
    ValueError
        If ``needs`` names an unknown signal or ``policy`` is neither a Policy nor a name.

    Notes
    -----
    A decision's scores are computed a second time, by ``policy.score`` on the decision's
    view, after ``policy.keep_indices`` chose: the same numbers for every registered
    policy (their scores are functions of the view), at twice the scoring cost.

    Memory grows with the prompt: every view holds its layer's keys (and the attention
    matrix when recorded). Record short prompts, or one engine call at a time.
    """

    def __init__(self, policy: Policy | str = "full", *, needs=()):
        if isinstance(policy, str):
            policy = get_policy(policy)
        if not isinstance(policy, Policy):
            raise ValueError(f"policy must be a Policy or a registered name, got {type(policy).__name__}")
        needs = frozenset(needs)
        if needs - SIGNALS:
            raise ValueError(f"needs must be a subset of {sorted(SIGNALS)}, got unknown {sorted(needs - SIGNALS)}")
        self.policy = policy
        # Instance attributes shadow the class's: the engine reads them from the object.
        self.needs = policy.needs | needs
        self.evict_before_attention = policy.evict_before_attention
        self.nonnegative_scores = policy.nonnegative_scores
        self.name = policy.name
        self.steps: list[Step] = []
        self.decisions: list[Decision] = []
        self._blocks: dict[int, int] = {}   # layer -> blocks observed so far

    # -- the protocol: the wrapped policy's, with a record --------------------------------
    def check(self, budget: int, config: ModelConfig) -> None:
        self.policy.check(budget, config)

    def max_block(self, budget: int, config: ModelConfig) -> int | None:
        return self.policy.max_block(budget, config)

    def fields(self, config: ModelConfig):
        return self.policy.fields(config)

    def observe(self, view: View) -> dict[str, np.ndarray]:
        block = self._blocks.get(view.layer, 0)
        self._blocks[view.layer] = block + 1
        self.steps.append(Step(block=block, layer=view.layer, view=view))
        return self.policy.observe(view)

    def score(self, view: View) -> np.ndarray:
        return self.policy.score(view)

    def protected(self, view: View) -> np.ndarray:
        return self.policy.protected(view)

    def keep_indices(self, view: View) -> np.ndarray:
        kept = self.policy.keep_indices(view)
        # Eviction before attention happens before this block's observe: it belongs to the
        # block about to be counted.
        block = self._blocks.get(view.layer, 0) - (0 if self.evict_before_attention else 1)
        self.decisions.append(Decision(block=block, layer=view.layer, view=view,
                                       scores=np.asarray(self.policy.score(view)), kept=kept))
        return kept

    def describe(self) -> str:
        return f"Recorder({self.policy.describe()})"

    def params(self) -> dict:
        return self.policy.params()

    # -- reading the record -----------------------------------------------------------
    def views(self, block: int = -1) -> list[View]:
        """The views of one block, one per layer in layer order (default: the last block).

        Raises
        ------
        ValueError
            If nothing was recorded or ``block`` is out of range.
        """
        if not self.steps:
            raise ValueError("nothing recorded yet: run an engine with this recorder first")
        n_blocks = 1 + max(s.block for s in self.steps)
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or not -n_blocks <= block < n_blocks:
            raise ValueError(f"block must be an integer in [{-n_blocks}, {n_blocks - 1}], got {block!r}")
        block = int(block) % n_blocks
        return [s.view for s in sorted(self.steps, key=lambda s: s.layer) if s.block == block]


def observed(policy: Policy, view: View) -> View:
    """``view`` with the state ``policy`` stores after observing it (its ``fields`` updated).

    What the engine does between attention and eviction, for one view: a stateful policy
    (H2O's accumulated attention, Scissorhands' counters) then scores the result. A field
    the policy declares but ``view.fields`` lacks starts at its declared fill value, as a
    fresh cache's would (so a view built by hand may give ``fields={}``).

    >>> import numpy as np
    >>> import refkv
    >>> from refkv.recording import Recorder, observed
    >>> recorder = Recorder("h2o")
    >>> _ = refkv.Engine(refkv.load("tiny"), recorder).prefill(np.arange(6))
    >>> view = recorder.views()[0]
    >>> h2o = refkv.policies.get("h2o")
    >>> bool(np.allclose(h2o.score(observed(h2o, view)), view.attention_by_kv_head().sum(axis=1)))
    True
    """
    fields = dict(view.fields)
    for name, spec in policy.fields(view.config).items():
        if name not in fields:
            fields[name] = np.full(view.positions.shape + tuple(spec.shape), spec.fill, dtype=spec.dtype)
    view = replace(view, fields=fields)
    return replace(view, fields={**fields, **policy.observe(view)})
