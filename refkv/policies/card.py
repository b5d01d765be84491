"""A policy's card: how it is named, cited, tabulated and exercised, apart from what it computes.

Every policy class declares one :class:`PolicyCard` as its ``card`` class attribute::

    card = PolicyCard(summary="...", paper="...", label="KeyDiff", table_order=70,
                      variants=({"anchor": "mean"},))

Nothing in a card changes a decision: the engine and the selection never read it. Its
readers are ``refkv policies`` (``summary``, ``paper``), the generated policy tables of the
README and the docs (``docs/policy_tables.py``: ``citation``, ``score_rule``, ``protects``,
``implements``, ``table_order``), the experiments (``label``, ``table_order``,
``experiment_specs``) and the golden suite (``variants``). The protocol the engine calls
(``needs``, ``evict_before_attention``, ...) stays on :class:`refkv.policies.Policy`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PolicyCard"]


@dataclass(frozen=True)
class PolicyCard:
    """What a policy tells readers, tables and test suites about itself.

    Attributes
    ----------
    summary : str
        One line for ``refkv policies``.
    paper : str
        Where the policy comes from, with its defaults (``refkv policies``, the vector files).
    label : str
        How tables and plots name it (empty: the registry name).
    citation, score_rule, protects, implements : str
        One line each for the generated policy tables: the paper in short, what the score
        is, what is protected (reST), and what of the paper is implemented (the README).
        An empty ``citation``, ``score_rule`` or ``implements`` falls back to ``paper``,
        ``--`` and ``summary``.
    table_order : int
        Where tables and the experiments list it (smaller first, then by name).
    experiment_specs : tuple of str
        The policy specs (:mod:`refkv.policies.spec`) the experiments run by default
        (empty: the policy's name alone, if it evicts).
    variants : tuple of dict
        Extra parameter sets, beyond the defaults, that the golden suite covers.
    """

    summary: str = ""
    paper: str = ""
    label: str = ""
    citation: str = ""
    score_rule: str = ""
    protects: str = "--"
    implements: str = ""
    table_order: int = 1000
    experiment_specs: tuple[str, ...] = ()
    variants: tuple[dict, ...] = ()

    def __post_init__(self):
        # A list here would be shared, mutable class state; a bare dict or str would be
        # iterated as its keys or characters. Both are slips worth a clear error.
        if not (isinstance(self.experiment_specs, tuple) and all(isinstance(s, str) for s in self.experiment_specs)):
            raise TypeError(f"experiment_specs must be a tuple of str, got {self.experiment_specs!r}")
        if not (isinstance(self.variants, tuple) and all(isinstance(v, dict) for v in self.variants)):
            raise TypeError(f"variants must be a tuple of dict, got {self.variants!r}")
